"""Quality measures: the demo classifier's (quality), torch-fidelity's FID / IS / KID / PR (fidelity), CLIP score,
bootstrap intervals over images (intervals), and ADM's .npz layout (adm, images)."""

# where `runtime eval` looks for torch-fidelity's InceptionV3 weights when --inception-weights is absent
INCEPTION_ENV = "LANTERN_INCEPTION_WEIGHTS"
