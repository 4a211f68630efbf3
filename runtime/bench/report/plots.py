"""The report's figures (matplotlib, rendered to PNG and SVG bytes)."""


from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Sequence

from runtime.bench.report.blocks import BenchFile, Block, Paragraph, Rendered, figure
from runtime.bench.report.numbers import (
    LOWER_IS_BETTER,
    image_samples,
    quality_estimates,
    run_label,
    speedup_ci,
    without_batch,
)
from runtime.bench.schema import (
    BenchResult,
    RunResult,
    ar_baseline,
)
from runtime.config.method_options import BASELINE

if TYPE_CHECKING:
    import numpy as np




def plot_batch_scaling(runs: Sequence[RunResult]) -> Rendered | None:
    """images/s against batch size, one line per method (and its non-batch settings)."""
    if len({r.params.batch_size for r in runs}) < 2:
        return None
    fig = _new_figure(5.0, 3.4)
    ax = fig.subplots()
    groups: dict[str, list[RunResult]] = {}
    for run in runs:
        params = without_batch(run)
        groups.setdefault(run.method if params in ("", "-") else f"{run.method} [{params}]", []).append(run)
    for label, members in groups.items():
        members = sorted(members, key=lambda r: r.params.batch_size)
        ax.plot([r.params.batch_size for r in members], [r.images_per_s for r in members], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (images per decode)")
    ax.set_ylabel("images/s (p50)")
    ax.legend(fontsize=7)
    return _png(fig)


def plot_depth_acceptance(runs: Sequence[RunResult]) -> Rendered | None:
    """Acceptance rate against draft depth, one line per drafted run (a marker where its mean
    drafted depth lies)."""
    drafted = [r for r in runs if r.stats.per_depth_acceptance]
    if not drafted:
        return None
    fig = _new_figure(6.0, 3.6)
    ax = fig.subplots()
    for run in drafted:
        rates = run.stats.per_depth_acceptance
        line, = ax.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3,
                        label=f"{run.method} [{run.params.label()}]")
        depth = run.stats.mean_drafted_depth
        if depth is not None and depth < len(rates):
            ax.axvline(depth, color=line.get_color(), linewidth=0.8, linestyle=":")
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance rate (given the depth above was accepted)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


def _png(fig: Any) -> Rendered:
    """The figure as PNG (embedded in the HTML, linked from the markdown) and SVG (for papers)."""
    png, svg = io.BytesIO(), io.BytesIO()
    fig.savefig(png, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(svg, format="svg", bbox_inches="tight", metadata={"Date": None})
    return png.getvalue(), svg.getvalue()


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure as MplFigure

    return MplFigure(figsize=(width, height), layout="constrained")


def plot_speedups(benches: Sequence[BenchFile]) -> Rendered | None:
    """Horizontal bars of speedup over ar, one panel per device (same run order in each), with
    the 95 % interval as an error bar where the file has per-image samples. None when no file
    has an ar baseline."""
    labels: list[str] = []
    for bench in benches:
        for run in bench.result.runs:
            if run.speedup_vs_ar is not None and run.method != BASELINE and run_label(run) not in labels:
                labels.append(run_label(run))
    if not labels:
        return None
    fig = _new_figure(7.0, 0.9 + 0.28 * len(labels) * len(benches))
    axes = fig.subplots(len(benches), 1, squeeze=False, sharex=True)[:, 0]
    for ax, bench in zip(axes, benches):
        runs = {run_label(r): r for r in bench.result.runs if r.speedup_vs_ar is not None}
        values, errors = [], [[], []]
        for label in labels:
            run = runs.get(label)
            ci = speedup_ci(run, ar_baseline(bench.result.runs, run.params.batch_size)) if run else None
            point = (ci.point if ci else run.speedup_vs_ar) if run else 0.0
            values.append(point)
            errors[0].append(max(0.0, point - ci.low) if ci else 0.0)
            errors[1].append(max(0.0, ci.high - point) if ci else 0.0)
        ys = list(range(len(labels)))
        ax.barh(ys, values, 0.6, xerr=errors if any(errors[0]) else None, capsize=2, color="#4c72b0")
        for y, v, up in zip(ys, values, errors[1]):
            if v:
                ax.text(v + up, y, f" {v:.2f}x", va="center", fontsize=7)
        ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_yticks(ys, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(bench.label, fontsize=9, loc="left")
    axes[-1].set_xlabel("speedup over ar (bars: mean with 95 % interval where recorded, else p50)")
    axes[-1].set_xlim(0, max(1.2, 1.18 * max(axes[-1].get_xlim()[1], 1.0)))
    return _png(fig)


def plot_speedup_vs_tau(bench: BenchFile) -> Rendered | None:
    """Speedup against tau, one point per run: the gap to the dashed line speedup = tau is what
    the iteration costs beyond an AR step. None without an ar baseline or a drafted run."""
    runs = [r for r in bench.result.runs if r.speedup_vs_ar is not None and r.method != BASELINE]
    if not runs:
        return None
    fig = _new_figure(6.0, 3.8)
    ax = fig.subplots()
    methods = list(dict.fromkeys(r.method for r in runs))
    for method in methods:
        mine = [r for r in runs if r.method == method]
        ax.scatter([r.stats.mean_accepted_length for r in mine], [r.speedup_vs_ar for r in mine], s=18, label=method)
    top = max(max(r.stats.mean_accepted_length for r in runs), max(r.speedup_vs_ar for r in runs)) * 1.05
    ax.plot([1, top], [1, top], color="grey", linestyle="--", linewidth=0.8, label="speedup = tau (free iterations)")
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_xlabel("tau (tokens per target forward)")
    ax.set_ylabel("speedup over ar (p50)")
    ax.legend(fontsize=7)
    return _png(fig)


def plot_latency(bench: BenchFile) -> Rendered | None:
    """Per run, the distribution of per-image seconds over every repeat (box) with the points;
    from the per-repeat totals / images where the file has no per-image samples."""
    runs = bench.result.runs
    if not runs:
        return None
    import numpy as np

    data = []
    for run in runs:
        per = image_samples(run)
        data.append(per.ravel() if per is not None
                    else np.asarray(run.latency_s.all) / bench.result.workload.num_images)
    fig = _new_figure(7.0, 0.9 + 0.28 * len(runs))
    ax = fig.subplots()
    try:
        ax.boxplot(data, orientation="horizontal", widths=0.5, showfliers=False)
    except TypeError:  # matplotlib < 3.10 names it vert
        ax.boxplot(data, vert=False, widths=0.5, showfliers=False)
    rng = np.random.default_rng(0)
    for i, values in enumerate(data, start=1):
        ax.scatter(values, i + rng.uniform(-0.15, 0.15, len(values)), s=4, alpha=0.5, color="#4c72b0")
    ax.set_yticks(range(1, len(runs) + 1), [run_label(r) for r in runs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per image (every image of every timed repeat)")
    return _png(fig)


def plot_image_pair(left: "np.ndarray", right: "np.ndarray") -> Rendered:
    """Two image grids side by side at their own resolution (PNG only: they are rasters), with a
    white gutter; the caption names which is which."""
    import numpy as np
    from PIL import Image

    h = max(left.shape[0], right.shape[0])
    canvas = np.full((h, left.shape[1] + 12 + right.shape[1], 3), 255, dtype=np.uint8)
    canvas[:left.shape[0], :left.shape[1]] = left
    canvas[:right.shape[0], left.shape[1] + 12:] = right
    buffer = io.BytesIO()
    Image.fromarray(canvas).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue(), b""


def image_comparisons(bench: BenchFile, slug: str) -> list[Block]:
    """AR's images beside each method's (same seeds), from the grids the bench kept; none where
    it kept none (files written before, or moved without their `.grids` folder)."""
    from runtime.bench.grids import read_grid

    runs = bench.result.runs
    ar_index = next((i for i, r in enumerate(runs) if r.method == BASELINE), None)
    ar_grid = read_grid(bench.path, ar_index) if ar_index is not None else None
    if ar_grid is None:
        return []
    blocks: list[Block] = []
    for i, run in enumerate(runs):
        grid = read_grid(bench.path, i) if i != ar_index else None
        if grid is not None:
            blocks.append(figure(f"{slug}-images-{i:02d}", plot_image_pair(ar_grid, grid),
                                  f"Images of ar (left) and {run_label(run)} (right), same seeds, {bench.label}"))
    if blocks:
        blocks.insert(0, Paragraph("Images: each method beside ar, from the same seeds (the last timed repeat)."))
    return blocks


def plot_phases(bench: BenchFile) -> Rendered | None:
    """Stacked bars of seconds per repeat by phase, one bar per run; the part of p50 latency no
    phase covers is stacked as `other`. None when no run recorded phases."""
    runs = [r for r in bench.result.runs if r.phases]
    if not runs:
        return None
    names: list[str] = []
    for run in runs:
        names.extend(n for n in run.phases if n not in names)
    fig = _new_figure(max(5.0, 0.8 * len(runs) + 2.5), 3.6)
    ax = fig.subplots()
    bottoms = [0.0] * len(runs)
    for name in names + ["other"]:
        if name == "other":
            values = [max(0.0, r.latency_s.mean - sum(p.seconds for p in r.phases.values())) for r in runs]
        else:
            values = [r.phases[name].seconds if name in r.phases else 0.0 for r in runs]
        if name == "other" and not any(values):
            continue
        ax.bar(range(len(runs)), values, 0.6, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xticks(range(len(runs)), [run_label(r) for r in runs], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds per repeat")
    ax.legend(fontsize=8)
    return _png(fig)


def sweep_methods(result: BenchResult) -> list[str]:
    """Methods with more than one run (a parameter sweep), in file order."""
    counts: dict[str, int] = {}
    for run in result.runs:
        counts[run.method] = counts.get(run.method, 0) + 1
    return [m for m, n in counts.items() if n > 1]


def _varying_params(runs: Sequence[RunResult]) -> list[str]:
    """Per run, `key=value` of only the parameters that differ between `runs` (a sweep's axis)."""
    if len(runs) < 2:
        return ["" for _ in runs]
    splits = [dict(part.split("=", 1) if "=" in part else (part, "on") for part in r.params.label().split()
                   if part != "-") for r in runs]
    keys = [k for k in dict.fromkeys(k for split in splits for k in split)
            if len({split.get(k) for split in splits}) > 1]
    return [" ".join(f"{k}={split.get(k, '-')}" for k in keys) for split in splits]


def _number_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def sweep_lines(runs: Sequence[RunResult]) -> tuple[str, list[tuple[str, list[tuple[float, RunResult]]]]] | None:
    """A sweep as lines: (x parameter, [(line label, [(x, run), ...] sorted by x)]). The x axis is
    the numeric parameter with the most values; every other varying parameter (a tree, say)
    makes its own line, so two swept settings never zigzag on one line. None when no numeric
    parameter varies."""
    splits = [dict(part.split("=", 1) for part in r.params.label().split() if "=" in part) for r in runs]
    varying = [k for k in dict.fromkeys(k for sp in splits for k in sp) if len({sp.get(k) for sp in splits}) > 1]
    numeric = [k for k in varying if all(_number_or_none(sp.get(k, "x")) is not None for sp in splits)]
    if not numeric:
        return None
    axis = max(numeric, key=lambda k: len({sp[k] for sp in splits}))
    lines: dict[str, list[tuple[float, RunResult]]] = {}
    for run, sp in zip(runs, splits):
        rest = " ".join(f"{k}={sp.get(k, '-')}" for k in varying if k != axis)
        lines.setdefault(f"{run.method} {rest}".strip(), []).append((float(sp[axis]), run))
    return axis, [(label, sorted(points, key=lambda p: p[0])) for label, points in lines.items()]


def plot_sweep(bench: BenchFile) -> Rendered | None:
    """Speedup against the swept numeric parameter (lambda, delta, k, batch), one line per
    method and other setting. None without such a sweep."""
    runs = [r for r in bench.result.runs if r.method in sweep_methods(bench.result) and r.speedup_vs_ar is not None]
    found = sweep_lines(runs) if runs else None
    if found is None:
        return None
    axis, lines = found
    fig = _new_figure(6.5, 3.8)
    ax = fig.subplots()
    for label, points in lines:
        ax.plot([x for x, _ in points], [r.speedup_vs_ar for _, r in points], marker="o", markersize=4, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel(axis)
    ax.set_ylabel("speedup over ar (p50)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


def _quality_values(run: RunResult) -> dict[str, tuple[float, float | None, float | None]]:
    """A run's quality figures (value, lo, hi) and, where measured, its step TVD (`step tvd`, 0 for ar)."""
    out = quality_estimates(run)
    if run.stats.step_tvd is not None:
        out["step tvd"] = (run.stats.step_tvd, None, None)
    elif run.method == BASELINE:
        out["step tvd"] = (0.0, None, None)
    return out


def _yerr(estimates) -> list[list[float]] | None:
    """matplotlib's asymmetric error bars for (value, lo, hi) points; None when none has an interval.

    A bootstrap interval need not hold its point estimate (FD's resampled values are biased
    upward at small samples: 23.2 with [25.4, 57.2] over 12 images), and matplotlib refuses a
    negative bar: such an end is drawn at the point (the interval itself is in the tables)."""
    if all(lo is None for _, lo, _ in estimates):
        return None
    return [[max(0.0, v - lo) if lo is not None else 0.0 for v, lo, _ in estimates],
            [max(0.0, hi - v) if hi is not None else 0.0 for v, _, hi in estimates]]


def plot_speed_quality(bench: BenchFile) -> Rendered | None:
    """One panel per quality metric (and the measured step TVD): speedup (x) against the metric (y), one line per swept
    method and other setting (its points ordered by the swept parameter), ar as a reference
    point; vertical bars are the figures' 95% bootstrap intervals over images. None without a
    sweep that has speedups and quality."""
    swept = sweep_methods(bench.result)
    runs = [r for r in bench.result.runs if r.method in swept or r.method == BASELINE]
    values = {id(r): _quality_values(r) for r in runs}
    runs = [r for r in runs if values[id(r)] and r.speedup_vs_ar is not None]
    if not any(r.method in swept for r in runs):
        return None
    metrics: list[str] = []
    for run in runs:
        metrics.extend(m for m in values[id(run)] if m not in metrics)
    fig = _new_figure(4.2 * len(metrics) + 1.5, 3.6)
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    swept_runs = [r for r in runs if r.method in swept]
    found = sweep_lines(swept_runs)
    lines = found[1] if found else [(m, [(0.0, r) for r in swept_runs if r.method == m]) for m in swept]
    for ax, metric in zip(axes, metrics):
        for r in runs:
            if r.method == BASELINE and metric in values[id(r)]:
                v, lo, hi = values[id(r)][metric]
                ax.errorbar([r.speedup_vs_ar], [v], yerr=_yerr([(v, lo, hi)]), marker="s", color="black",
                            label="ar", capsize=2)
        for label, points in lines:
            mine = [(r.speedup_vs_ar, values[id(r)][metric]) for _, r in points if metric in values[id(r)]]
            if mine:
                xs, est = zip(*mine)
                ax.errorbar(xs, [e[0] for e in est], yerr=_yerr(est), marker="o", markersize=4, label=label,
                            capsize=2)
        better = "lower is better" if metric in LOWER_IS_BETTER else "higher is better"
        ax.set_xlabel("speedup over ar")
        ax.set_ylabel(f"{metric} ({better})")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)
