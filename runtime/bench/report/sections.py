"""The report's sections: one per device file, cross-device comparisons, projections."""


from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from runtime.bench.report.blocks import BenchFile, Block, Heading, Paragraph, Table, figure
from runtime.bench.report.numbers import (
    QUALITY_NOTE,
    Decomposition,
    batch_scaling_table,
    bench_warnings,
    decompose,
    depth_table,
    device_budget_table,
    floor_table,
    device_label,
    env_summary,
    file_mode,
    fmt_bytes,
    fmt_interval,
    fmt_seconds,
    fmt_speedup,
    fmt_tau,
    image_samples,
    images_independent,
    quality_text,
    run_label,
    sig,
    speedup_text,
    summary_line,
    tau_ci,
    workload_differences,
    workload_summary,
)
from runtime.bench.report.plots import (
    image_comparisons,
    plot_batch_scaling,
    plot_depth_acceptance,
    plot_latency,
    plot_phases,
    plot_speed_quality,
    plot_speedup_vs_tau,
    plot_speedups,
    plot_sweep,
    sweep_methods,
)
from runtime.bench.schema import (
    RunResult,
    ar_baseline,
)
from runtime.config.method_options import BASELINE

if TYPE_CHECKING:

    pass



def group_by_workload(benches: Sequence[BenchFile]) -> list[list[BenchFile]]:
    """Files with identical workloads, grouped in order of first appearance."""
    groups: list[list[BenchFile]] = []
    for bench in benches:
        for group in groups:
            if not workload_differences(group[0].result, bench.result):
                group.append(bench)
                break
        else:
            groups.append([bench])
    return groups




def _label_devices(benches: Sequence[BenchFile]) -> None:
    """Device labels; where two files in `benches` share a device, its mode (graph / eager) is
    added when the modes differ, else the file name."""
    labels = [device_label(b.result) for b in benches]
    modes = [file_mode(b.result) for b in benches]
    for bench, label, mode in zip(benches, labels, modes):
        same = [m for lab, m in zip(labels, modes) if lab == label]
        if len(same) == 1:
            bench.label = label
        elif same.count(mode) == 1:
            bench.label = f"{label} ({mode})"
        else:
            bench.label = f"{label} ({mode}, {Path(bench.path).name})"


def same_device(group: Sequence[BenchFile]) -> bool:
    return len({device_label(b.result) for b in group}) == 1


def _device_section(bench: BenchFile, slug: str) -> list[Block]:
    result = bench.result
    blocks: list[Block] = [Heading(3, bench.label), Paragraph(env_summary(bench))]
    summary = summary_line(result)
    if summary is not None:
        blocks.append(Paragraph(summary))
    for warning in bench_warnings(result):
        blocks.append(Paragraph(f"Warning: {warning}."))
    rows = []
    for run in result.runs:
        rows.append([
            run.method,
            run.params.label(),
            fmt_tau(run.stats.mean_accepted_length),
            speedup_text(run, ar_baseline(result.runs, run.params.batch_size)),
            sig(run.images_per_s),
            fmt_seconds(run.latency_s.p50),
            fmt_seconds(run.latency_s.p90),
            fmt_bytes(run.memory.peak_bytes),
            quality_text(run),
        ])
    headers = ["method", "params", "tau", "speedup [95% CI]", "images/s", "p50 s", "p90 s", "peak memory", "quality"]
    if any(image_samples(r) is not None for r in result.runs):
        headers[3:3] = ["tau [95% CI]"]
        for row, run in zip(rows, result.runs):
            row[3:3] = [fmt_interval(tau_ci(run), "")]
    blocks.append(Table(headers, rows))
    if any(run.quality.measured for run in result.runs):
        blocks.append(Paragraph(QUALITY_NOTE))
    ar = ar_baseline(result.runs)
    if ar is None:
        blocks.append(Paragraph(
            "Speedup n/a: this file has no `ar` run, and speedups are only computed against an ar "
            "baseline measured in the same bench (re-run `runtime bench` with `ar` in `--methods`)."
        ))
        return blocks
    blocks.append(Paragraph(
        "Speedup decomposition: speedup = tau x (AR step time / iteration time), with tau = ar "
        "target forwards / method target forwards (tokens per target forward relative to ar; it "
        "matches the mean accepted length up to the prefill forward), AR step time = ar mean time / ar "
        "target forwards, iteration time = method mean time / method target forwards."
    ))
    drows = []
    for run in result.runs:
        base = ar_baseline(result.runs, run.params.batch_size)
        if base is None:
            continue
        d = decompose(run, base)
        drows.append([
            run.method,
            run.params.label(),
            fmt_speedup(d.speedup),
            fmt_tau(d.tau),
            fmt_tau(d.step_ratio),
            sig(d.ar_step_s * 1e3),
            sig(d.iteration_s * 1e3),
        ])
    blocks.append(Table(
        ["method", "params", "speedup", "= tau (AR fwd / fwd)", "x step ratio", "AR step ms", "iteration ms"], drows
    ))
    scaling = batch_scaling_table(result.runs)
    if scaling is not None:
        blocks.append(Paragraph(
            "Batch sizes: B images decode together (the same tokens at every B); speedups compare "
            "each run with ar at the same B. ms per image = p50 latency / images."
        ))
        blocks.append(scaling)
        curve = plot_batch_scaling(result.runs)
        if curve is not None:
            blocks.append(figure(f"{slug}-batch", curve, f"Throughput against batch size, {bench.label}"))
    measured = [r for r in result.runs if r.stats.step_tvd is not None]
    if measured:
        blocks.append(Paragraph(
            "What each acceptance rule does to the law: the mean total variation between a step's output "
            "distribution and the target's, at the first drafted position of every iteration of an untimed "
            "pass (`runtime.core.law`: exact for deterministic drafts, for exact and bounded sampled drafts; "
            "estimated for the paper rule's sampled drafts), beside the bound the relaxation is stated with "
            "at the same steps (delta, or (lambda - 1) times the drafts' target mass; 0 = exact)."
        ))
        blocks.append(Table(["method", "params", "step TVD", "stated bound", "steps"],
                            [[r.method, r.params.label(), sig(r.stats.step_tvd),
                              sig(r.stats.step_tvd_bound or 0.0), str(r.stats.law_steps)] for r in measured]))
    relaxed = [r for r in result.runs if r.stats.mean_relaxation_mass]
    if relaxed:
        blocks.append(Paragraph(
            "Lossy runs: the mean, per accepted draft, of the relaxation mass moved onto drafts "
            "(LANTERN / LANTERN++: the total-variation shift each relaxed stage may cause) or of the "
            "per-position TVD bound summed over committed positions (`sjd` with `accept=grouped`)."
        ))
        blocks.append(Table(["method", "params", "relaxation / TVD bound per accepted draft"],
                            [[r.method, r.params.label(), sig(r.stats.mean_relaxation_mass)] for r in relaxed]))
    depths = depth_table(result.runs)
    if depths is not None:
        blocks.append(Paragraph(
            "Draft depth: tree levels drafted per iteration (fixed for static trees and EAGLE-2, decided "
            "per iteration by `ddd` and `--dynamic-depth`) and the acceptance rate at each depth: the "
            "fraction of iterations reaching depth d (drafted that deep, path accepted down to d - 1) "
            "whose path was accepted at d. Dotted lines in the figure mark mean drafted depths."
        ))
        blocks.append(depths)
        curve = plot_depth_acceptance(result.runs)
        if curve is not None:
            blocks.append(figure(f"{slug}-depth", curve, f"Acceptance by draft depth, {bench.label}"))
    budget = device_budget_table(result.runs)
    if budget is not None:
        blocks.append(Paragraph(
            "Device budget: non-view aten ops dispatched per iteration in each phase (counted eagerly; "
            "the kernels a GPU would launch without fusion) / kernels the graph compiler generated for "
            "the phase's captured step. Loop efficiency = speedup / (tau x AR step / verify time) = "
            "verify time / iteration time: 1.00 would mean drafting, acceptance and the host loop are free."
        ))
        blocks.append(budget)
    floors = floor_table(result.runs)
    if floors is not None:
        roof = result.device.roof
        blocks.append(Paragraph(
            "Against the physical floor: each phase's mean time per call over the least time this device's peaks "
            "allow, max(bytes / bandwidth, FLOPs / matmul rate), with the bytes (weights once per forward, the KV "
            "cache of the context, the logits) and FLOPs counted from the shapes at the mean context of an image "
            f"(`runtime.tools.roofline`). Peaks: {roof.name if roof else '?'}, "
            f"{(roof.bandwidth_bytes_per_s / 1e9) if roof else float('nan'):,.0f} GB/s ({roof.source if roof else '-'})."
        ))
        blocks.append(floors)
    latency = plot_latency(bench)
    if latency is not None:
        blocks.append(figure(f"{slug}-latency", latency, f"Seconds per image, every timed repeat, {bench.label}"))
    versus = plot_speedup_vs_tau(bench)
    if versus is not None:
        blocks.append(figure(f"{slug}-tau", versus, f"Speedup against tau, {bench.label}"))
    sweep = plot_sweep(bench)
    if sweep is not None:
        blocks.append(figure(f"{slug}-sweep", sweep, f"Speedup along the swept parameter, {bench.label}"))
    blocks.extend(image_comparisons(bench, slug))
    phases = plot_phases(bench)
    if phases is not None:
        blocks.append(figure(f"{slug}-phases", phases, f"Phase breakdown per method, {bench.label}"))
    swept = sweep_methods(result)
    if swept:
        curve = plot_speed_quality(bench)
        if curve is not None:
            blocks.append(figure(f"{slug}-speed-quality", curve, f"Speed vs quality, {bench.label}"))
        else:
            blocks.append(Paragraph(
                f"Sweep of {', '.join(swept)} present but no measured quality for it: speed-quality curve omitted."
            ))
    return blocks


def _cross_device_section(group: Sequence[BenchFile], slug: str) -> list[Block]:
    if same_device(group):
        blocks: list[Block] = [
            Heading(3, "Across modes and repeated benches (one device)"),
            Paragraph(
                "The same workload on one device, in different modes or benched more than once: these "
                "compare modes (graph / eager) and runs, not hardware. A difference is attributed only "
                "where it lies outside the two runs' combined noise."
            ),
        ]
    else:
        blocks = [
            Heading(3, "Across devices"),
            Paragraph(
                "Same workload on every device below. tau (forward reduction) is a property of the "
                "method and workload; the step ratio is what one draft+verify iteration costs relative "
                "to one AR step on that device. A difference is attributed only where it lies outside "
                "the two runs' combined noise."
            ),
        ]
    order: dict[str, str] = {}
    for bench in group:
        for run in bench.result.runs:
            order.setdefault(run_label(run), run.method)
    rows = []
    explained: list[str] = []
    for label, method in order.items():
        points: list[tuple[BenchFile, Decomposition, RunResult, RunResult]] = []
        for bench in group:
            for run in bench.result.runs:
                if run_label(run) != label:
                    continue
                ar = ar_baseline(bench.result.runs, run.params.batch_size)
                d = decompose(run, ar) if ar is not None else None
                rows.append([
                    label,
                    bench.label,
                    fmt_tau(run.stats.mean_accepted_length),
                    speedup_text(run, ar),
                    fmt_tau(d.tau) if d else "n/a",
                    fmt_tau(d.step_ratio) if d else "n/a",
                    sig(run.images_per_s),
                    fmt_seconds(run.latency_s.p50),
                    sig(d.iteration_s * 1e3) if d else "-",
                ])
                if d is not None:
                    points.append((bench, d, run, ar))
        if len(points) >= 2 and method != BASELINE:
            explained.append(_explain(label, points))
    blocks.append(Table(
        ["method", "device", "tau", "speedup [95% CI]", "= tau (AR fwd / fwd)", "x step ratio", "images/s", "p50 s",
         "iteration ms"],
        rows,
    ))
    blocks.extend(Paragraph(text) for text in explained)
    bars = plot_speedups(group)
    if bars is not None:
        blocks.append(figure(f"{slug}-speedup", bars, "Speedup over ar per method and device"))
    return blocks


def _explain(label: str, points: Sequence[tuple[BenchFile, Decomposition, RunResult, RunResult]]) -> str:
    """Name the cause of the speed difference between the slowest and fastest file, but only
    when it lies outside the two runs' combined noise; otherwise say it is within noise."""
    from runtime.bench.stats import compare

    low = min(points, key=lambda p: p[1].speedup)
    high = max(points, key=lambda p: p[1].speedup)
    tau_factor = high[1].tau / low[1].tau
    step_factor = high[1].step_ratio / low[1].step_ratio
    span = (f"`{label}`: {fmt_speedup(low[1].speedup)} on {low[0].label} to {fmt_speedup(high[1].speedup)} on "
            f"{high[0].label}; tau differs by {tau_factor:.2f}x and the step ratio by {step_factor:.2f}x")
    samples = [image_samples(p[2]) for p in (high, low)] + [image_samples(p[3]) for p in (high, low)]
    if any(x is None for x in samples) or samples[0].shape[1] != samples[2].shape[1] \
            or samples[1].shape[1] != samples[3].shape[1]:
        return f"{span}. Not tested against noise (these files carry no per-image samples), so no cause is named."
    result = compare(samples[2], samples[0], samples[3], samples[1],
                     images_independent=(images_independent(high[2], high[3]), images_independent(low[2], low[3])))
    if result.within_noise:
        return f"{span}: {result.text()}, so the difference is not attributed."
    cause = "the step ratio (per-iteration cost on the device)" if abs(math.log(step_factor)) >= abs(
        math.log(tau_factor)
    ) else "tau (how many tokens each verification accepts)"
    return f"{span}; the speedups differ by {result.text()}, outside the noise, mainly through {cause}."


def build_report(benches: Sequence[BenchFile]) -> list[Block]:
    """The report's blocks for already-loaded files (at least one)."""
    groups = group_by_workload(benches)
    for group in groups:
        _label_devices(group)
    blocks: list[Block] = [
        Heading(1, "lantern-runtime bench report"),
        Paragraph(
            f"{len(benches)} file(s), {len(groups)} workload(s). Speedup = ar p50 latency / method p50 "
            "latency, both from the same file; tau = mean accepted length (tokens per verification step); "
            "latency is wall time to generate the whole workload once."
        ),
    ]
    reference = groups[0][0].result
    for g, group in enumerate(groups):
        letter = chr(ord("A") + g) if g < 26 else str(g + 1)
        w = group[0].result.workload
        blocks.append(Heading(2, f"Workload {letter}: {w.model}, {w.num_images} images x {w.tokens_per_image} tokens"))
        blocks.append(Paragraph(workload_summary(group[0].result)))
        if g > 0:
            diffs = workload_differences(reference, group[0].result)
            blocks.append(Paragraph(
                f"workload differs from workload A: {'; '.join(diffs)}. Not compared with workload A."
            ))
        for i, bench in enumerate(group):
            blocks.extend(_device_section(bench, f"w{g + 1}-d{i + 1}"))
        if len(group) > 1:
            blocks.extend(_cross_device_section(group, f"w{g + 1}"))
        else:
            bars = plot_speedups(group)
            if bars is not None:
                blocks.append(figure(f"w{g + 1}-speedup", bars, f"Speedup over ar per method, {group[0].label}"))
    return blocks


def _projection_mode(env: dict[str, Any]) -> str:
    device = env.get("profile", {}).get("values", {}).get("device", {})
    mode = {True: "graph mode", False: "eager steps"}.get(device.get("graph"), "mode not recorded")
    return f"{env.get('dtype') or device.get('dtype') or 'dtype not recorded'}, {mode}"


def projection_section(projections: Sequence[tuple[str, Any]]) -> list[Block]:
    """The projected speedups: a table per file, each number labelled as a projection with its
    two inputs (the tau of a trained model, the step costs of random weights of the shape)."""
    blocks: list[Block] = [
        Heading(2, "Projected speedups on real model shapes"),
        Paragraph(
            "Projections, not measurements of a trained model: projected speedup = tau x (AR step time / "
            "iteration time), where tau comes from a trained model (the named source) and the AR step and "
            "iteration times were measured on this device with random weights of the named shape. A decoding "
            "iteration has fixed shapes, so its cost does not depend on the weights' values. The interval "
            "covers the timing noise (medians of the timed iterations, bootstrapped); tau is taken as given."
        ),
    ]
    for path, p in projections:
        blocks.append(Heading(3, f"{p.device.get('backend', '?')}: {p.device.get('name', '?')}, {p.shape.name}"))
        blocks.append(Paragraph(
            f"File `{path}`. Shape: {p.shape.description} ({p.shape.weights}); batch size {p.batch_size}; "
            f"{_projection_mode(p.env)}; "
            f"{p.warmup} warm-up + {p.iterations} timed iterations per method; AR step "
            f"{sig(p.ar_step.median_s * 1e3)} ms (median)."
        ))
        rows = [[r.label, f"{r.tau:.2f}", r.tau_source, sig(r.iteration_s * 1e3), f"{r.iteration_over_ar_step:.2f}",
                 f"{r.projected_speedup.point:.2f}x [{r.projected_speedup.low:.2f}, {r.projected_speedup.high:.2f}]"]
                for r in p.runs]
        blocks.append(Table(["method", "tau", "tau from", "iteration ms", "iteration / AR step",
                             "projected speedup [95% CI]"], rows))
        if p.roof is not None:
            blocks += _floor_blocks(p)
    return blocks


def _floor_blocks(p: Any) -> list[Block]:
    """Each phase of the projection file `p` against its roofline floor."""
    roof = p.roof
    text = (f"Against the physical floor: each phase's least time on this device, max(bytes / bandwidth, FLOPs / "
            f"matmul rate), counted from the shape at the mean context ({roof['context']} positions) with "
            f"{roof['name']}'s peaks ({roof['source']}). measured / floor = 1 is the hardware's limit; the "
            "fractions are the bandwidth and matmul rate the phase achieved.")
    rows = []
    for label, floor in [("ar", p.ar_step.floor)] + [(r.label, r.floor) for r in p.runs]:
        for phase, f in (floor or {}).items():
            if phase == "iteration":
                continue
            rows.append([label, phase, sig(f["measured_s"] * 1e3), sig(f["floor_s"] * 1e3), f"{f['over_floor']:.1f}x",
                         f"{f['bandwidth_fraction']:.0%}", f"{f['rate_fraction']:.0%}"])
        if floor:
            it = floor["iteration"]
            rows.append([label, "iteration", sig(it["measured_s"] * 1e3), sig(it["floor_s"] * 1e3),
                         f"{it['over_floor']:.1f}x", "", ""])
    return [Paragraph(text), Table(["method", "phase", "measured ms", "floor ms", "measured / floor",
                                    "of bandwidth", "of matmul rate"], rows)]
