"""Tools over the generation layer: tree and quality tuning (`tune`, `quality_tune`,
`quality_budget`), the hardware self-check (`selfcheck`) and the step cost models (`step_timing`,
`roofline`) that the bench's projections read."""
