"""A tuned profile's text: what `runtime tune` measured (as comments) and the settings it chose
(the [device], [tree], [method], [bench], [auto], [quality] and [roof] tables)."""

from __future__ import annotations

import json
from typing import Any

from runtime.config.method_options import RelaxKind


def profile_toml(result: Any, base: Any, spec: Any, tree_file: str, record_file: str,
                 occupancy: list[dict[str, Any]] | None = None, roof: Any = None, quality: Any = None) -> str:
    """The tuned profile: the base profile's device and bench settings, the chosen tree and
    method settings, comments saying what was measured and why this tree won, and (on a CPU)
    the machine's measured peaks as `[roof]` for the phases' floors."""
    lines = _measured(result, record_file) + _settings(result, base, spec, tree_file)
    if occupancy:
        lines += _auto_table(occupancy)
    if quality is not None:
        lines += _quality_table(quality, record_file)
    if roof is not None:
        lines += _roof_table(roof)
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _measured(result: Any, record_file: str) -> list[str]:
    """Comments: what was measured, and why this tree won."""
    c, costs, ms = result.choice, result.costs, _ms
    lines = [
        f"# Written by `runtime tune` in {result.seconds:.0f} s on {result.device.get('name', '?')} "
        f"({'graph' if result.graph else 'eager'}, batch {result.batch_size}); measurements in {record_file}.",
        f"# Calibration: {result.calibration['iterations']} iterations of {result.method} over a "
        f"{result.calibration['tree']} tree, classes {result.calibration['conditions']}.",
        "# Acceptance rate by depth (rows) and rank (columns), given the parent accepted and lower ranks rejected:",
        *[f"#   depth {d + 1}: " + " ".join(f"{a:.2f}" for a in row) for d, row in enumerate(result.rate)],
        f"# Step costs (median of {costs['rounds']} interleaved rounds; verify and accept fitted non-decreasing "
        f"in nodes, measured values in the record): AR step {ms(costs['ar_step_s'])}; verify by nodes "
        + ", ".join(f"{n}: {ms(t)}" for n, t in costs["verify_s"].items()) + ";",
        "#   accept by nodes " + ", ".join(f"{n}: {ms(t)}" for n, t in costs["accept_s"].items())
        + "; draft by depth " + ", ".join(f"{d}: {ms(t)}" for d, t in costs["draft_s"].items()) + ".",
        "# Best tree of each depth (expected tokens per iteration, ms per iteration, expected speedup over AR):",
        *[f"#   depth {p['depth']}: {p['nodes']} nodes, {p['expected_tokens']:.2f} tokens, "
          f"{ms(p['iteration_s'])}, {p['expected_speedup']:.2f}x" for p in result.per_depth],
        f"# Chosen: depth {c['depth']}, {c['nodes']} nodes (largest expected tokens per second). The expected "
        "speedup is a model's projection; `runtime bench` measures it.",
    ]
    if result.ddd:
        lines.append("# DDD thresholds timed (images/s): "
                     + ", ".join(f"{r['threshold']}: {r['images_per_s']:.3f}" for r in result.ddd["runs"]))
    return lines


def _settings(result: Any, base: Any, spec: Any, tree_file: str) -> list[str]:
    """The [device], [tree], [method] and [bench] tables."""
    c = result.choice
    lines = [
        f'description = "tuned by runtime tune: {c["nodes"]}-node depth-{c["depth"]} tree for {result.method}"',
        "",
        "[device]",
        f'dtype = "{base.device.dtype}"',
        f"graph = {'true' if result.graph else 'false'}",
        *([f'hpu_mode = "{base.device.hpu_mode}"'] if base.device.hpu_mode else []),
        f"batch_size = {result.batch_size}",
        "",
        "[tree]",
        f'name = "{tree_file}"',
        "",
        "[method]",
        'name = "lantern++"',
    ]
    if spec.decl.relaxation == RelaxKind.LAMBDA:
        lines.append(f"lantern_lambda = {spec.lantern_lambda}")
        lines.append(f'relax_rule = "{spec.relax_rule}"')
    else:  # sd: exact acceptance over the tuned tree
        lines.append("lantern_lambda = 1.0")
    if result.ddd:
        lines.append(f"ddd_threshold = {result.ddd['threshold']}")
    pinned = base.method.pinned()
    for key in ("top_k_draft", "total_tokens", "depth"):
        if key in pinned:
            lines.append(f"{key} = {pinned[key]}")
    return lines + ["", "[bench]", f"warmup = {base.bench.warmup}", f"repeats = {base.bench.repeats}", ""]


def _auto_table(occupancy: list[dict[str, Any]]) -> list[str]:
    """The [auto] table: the faster method at each measured occupancy."""
    return ["# --method auto: the faster of AR and the tree above (exact, lambda 1) at each batch occupancy, "
           "measured (images/s):",
           *[f"#   {row['occupancy']}: " + ", ".join(f"{m} {v:.3f}" for m, v in row["images_per_s"].items())
             for row in occupancy],
           "[auto]",
           "by_occupancy = { " + ", ".join(f'{row["occupancy"]} = "{row["fastest"]}"' for row in occupancy)
           + " }", ""]


def _quality_table(quality: Any, record_file: str) -> list[str]:
    """The [quality] table: the relaxation chosen within the budget, every setting in comments."""
    c = quality.chosen
    return [f"# Quality: AR and {len(quality.candidates)} settings of the tree above decoded {quality.images} "
           f"images each from the same seeds, judged by the {quality.features} against AR (paired "
           f"differences, 95 % intervals) and against AR on disjoint seeds (the band); chosen: the "
           f"fastest within {quality.budget:g} band(s) on every figure ({quality.seconds:.0f} s). "
           f"Every setting, in {record_file}:",
           *[f"#   {x.rule} lambda {x.lantern_lambda:g}: {x.images_per_s / quality.ar_images_per_s:.2f}x, "
             + ("within" if x.verdict.indistinguishable else "outside") + "; "
             + ", ".join(f"{m} {e.value:+.3f}" for m, e in x.verdict.vs_ar.items())
             for x in quality.candidates],
           "[quality]", f"budget = {float(quality.budget)}", f"images = {quality.images}",
           f"features = {json.dumps(quality.features)}", f'relax_rule = "{c.rule}"',
           f"lantern_lambda = {float(c.lantern_lambda)}",
           f"speedup = {_toml_float(c.images_per_s / quality.ar_images_per_s)}",
           "band = { " + ", ".join(f"{m} = {_toml_float(v)}" for m, v in quality.band.items()) + " }",
           "vs_ar = { " + ", ".join(f"{m} = [{_toml_float(e.value)}, {_toml_float(e.lo)}, {_toml_float(e.hi)}]"
                                    for m, e in c.verdict.vs_ar.items()) + " }", ""]


def _roof_table(roof: Any) -> list[str]:
    """The [roof] table: this machine's measured peaks."""
    (dtype, rate), = roof.matmul.items()
    return ["# This machine's peaks, for each phase's roofline floor (runtime bench, selfcheck, report):",
           "[roof]", f"bandwidth_gbs = {roof.bandwidth / 1e9:.3f}", f"matmul_tflops = {rate / 1e12:.4f}",
           f"source = {json.dumps(f'runtime tune: {roof.source} ({dtype})')}", ""]


def _toml_float(x: float) -> str:
    """A TOML float (always a decimal point or exponent: the profile's keys are strict floats)."""
    return repr(float(f"{float(x):.6g}"))
