"""Hardware comparison report from bench result files: `report.md` + self-contained `report.html`.

The report is built once as a list of blocks (headings, paragraphs, tables, figures) and rendered
twice: markdown (figures as `plots/*.png` next to it) and HTML (figures embedded as base64 PNG, no
external references). Numbers come straight from the files; the only derived quantities are

    speedup     = mean(ar.latency_s.all) / mean(run.latency_s.all)   (ar from the same file)
                = tau x step ratio, exactly, where
    tau         = ar.stats.target_forwards / run.stats.target_forwards
    step ratio  = AR step time / iteration time
    AR step     = mean(ar.latency_s.all) / ar.stats.target_forwards     (seconds per AR forward)
    iteration   = mean(run.latency_s.all) / run.stats.target_forwards   (seconds per draft+verify step)

This is the one speedup the report, the bench's console table, the plots and the CSVs show: the
ratio of mean workload times (`speedup_vs_ar` in the file), with its 95% bootstrap interval over
repeats and images where the file records per-image latencies.

so a speedup that differs between devices is split into what acceptance bought (tau, a property
of the algorithm and the workload) and what an iteration costs relative to an AR step on that
device (the step ratio, a property of the hardware and kernels).

Files are grouped by workload; only files with identical workloads share a section and a
cross-device table. Every other group is reported separately with the differing fields named.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, Union

from runtime.bench.schema import (
    BenchResult,
    RunResult,
    ar_baseline,
    iter_differences,
    load_bench,
    to_dict,
)
from runtime.errors import UserError

if TYPE_CHECKING:
    import numpy as np

    from runtime.bench.stats import Interval

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
PLOTS_DIR = "plots"
TABLES_DIR = "tables"  # every table as CSV
# Lower is better for these quality metrics; higher for the rest (accuracy, CLIP score).
LOWER_IS_BETTER = frozenset({"fd", "fd_vs_ar", "fid", "kid", "step tvd"})


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Paragraph:
    text: str


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    """A rendered plot: `name` is its file stem under `plots/`, `png` and `svg` the image bytes."""

    name: str
    png: bytes
    caption: str
    svg: bytes = b""


Rendered = tuple[bytes, bytes]  # (png, svg) of one plot


def _figure(name: str, rendered: Rendered, caption: str) -> Figure:
    return Figure(name, rendered[0], caption, rendered[1])


Block = Union[Heading, Paragraph, Table, Figure]


@dataclass
class BenchFile:
    """A loaded bench file and how the report names it."""

    path: str
    result: BenchResult
    label: str = ""


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def fmt_speedup(value: float | None) -> str:
    """`2.31x`; `n/a` when there is no ar baseline."""
    return "n/a" if value is None else f"{value:.2f}x"


def fmt_tau(value: float) -> str:
    """`3.07`."""
    return f"{value:.2f}"


def _sig(value: float, digits: int = 3) -> str:
    """`digits` significant digits without scientific notation for ordinary magnitudes."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def _seconds(value: float) -> str:
    """Millisecond resolution for ordinary latencies, 3 significant digits below 0.1 s."""
    return f"{value:.3f}" if value >= 0.1 else _sig(value, 3)


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e6:.0f} MB" if value < 1e9 else f"{value / 1e9:.2f} GB"


QUALITY_NOTE = (
    "Quality: `class_accuracy` and `fd` are the demo classifier's (its accuracy on the class each image "
    "was generated for, and the Frechet distance of its features to real demo images), not FID; "
    "`*_vs_ar` is a run's paired difference to ar on the same seeds and classes; [lo, hi] are 95% "
    "bootstrap intervals over images. FID / IS / precision-recall come from `runtime eval --reference` "
    "(docs/quality.md).")


def quality_estimates(run: RunResult) -> dict[str, tuple[float, float | None, float | None]]:
    """A run's quality figures as {name: (value, lo, hi)}: `<name>_lo` / `<name>_hi` are the 95%
    bootstrap interval the bench stores beside `<name>` (None where absent, e.g. older files)."""
    metrics = run.quality.metrics if run.quality.measured else {}
    return {name: (value, metrics.get(f"{name}_lo"), metrics.get(f"{name}_hi")) for name, value in metrics.items()
            if not name.endswith(("_lo", "_hi"))}


def quality_text(run: RunResult, *, own_only: bool = False) -> str:
    """`name value [lo, hi]` for each quality figure; `own_only`: the run's own figures, not
    its differences to ar (`*_vs_ar`, which the summary line gives for the fastest run)."""
    if not run.quality.measured:
        return f"not measured: {run.quality.reason}"
    return ", ".join(f"{name} {_sig(v, 3)}" + (f" [{_sig(lo, 3)}, {_sig(hi, 3)}]" if lo is not None else "")
                     for name, (v, lo, hi) in quality_estimates(run).items()
                     if not (own_only and name.endswith("_vs_ar")))


def run_label(run: RunResult) -> str:
    """`method` or `method [params]`: the key a run is matched by across devices."""
    params = run.params.label()
    return run.method if params == "-" else f"{run.method} [{params}]"


def device_label(result: BenchResult) -> str:
    d = result.device
    return f"{d.backend}: {d.name} x{d.count}"


def _compact(value: Any) -> str:
    if isinstance(value, list) and len(value) > 6:
        return f"[{len(value)} items: {', '.join(json.dumps(v) for v in value[:3])}, ...]"
    return json.dumps(value)


def workload_differences(a: BenchResult, b: BenchResult) -> list[str]:
    """`field a vs b` for every workload field that differs (empty when the workloads are equal)."""
    wa, wb = to_dict(a)["workload"], to_dict(b)["workload"]
    return [f"{path} {_compact(x)} vs {_compact(y)}" for path, x, y in iter_differences(wa, wb)]


def _workload_summary(result: BenchResult) -> str:
    w = result.workload
    s = w.sampling
    if w.conditions.kind == "classes":
        assert w.conditions.classes is not None
        cond = f"classes {_compact(w.conditions.classes)}"
    else:
        cond = f"prompts sha256 {w.conditions.prompts_sha256[:12] if w.conditions.prompts_sha256 else '?'}"
    sampling = "greedy" if s.greedy else f"temperature {s.temperature:g}, top_k {s.top_k}, top_p {s.top_p:g}"
    return (
        f"model {w.model} ({w.params / 1e6:.1f}M params), {w.image_size}px = {w.tokens_per_image} tokens/image, "
        f"{w.num_images} images, {cond}, seeds {_compact(w.seeds)}, {sampling}, cfg {s.cfg:g}"
    )


def _env_summary(bench: BenchFile) -> str:
    e = bench.result.env
    versions = ", ".join(f"{k} {v}" for k, v in bench.result.device.versions.items())
    commit = e.git_commit[:12] if e.git_commit else "unknown"
    setup = [f"{e.threads} intra-op thread(s)" if e.threads else None, e.dtype, file_mode(bench.result)]
    packages = ", ".join(f"{k} {v}" for k, v in e.packages.items() if k != "torch")
    weights = ", ".join(f"`{Path(f).name}` {h[:12]}" for f, h in e.checkpoints.items())
    return (
        f"File `{bench.path}`. {versions or 'torch ' + e.torch}; python {e.python}; "
        f"{'; '.join(x for x in setup if x)}; {packages + '; ' if packages else ''}profile "
        f"`{e.profile.name}`; timer {e.timer}; {e.warmup} warm-up + {e.repeats} measured repeats per "
        f"method, {e.schedule}; started {e.started_at}; bench took {e.bench_seconds:.0f} s; commit {commit}."
        + (f" Weights (sha256): {weights}." if weights else " Weights: not hashed in this file.")
    )


# --------------------------------------------------------------------------------------------
# Decomposition
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decomposition:
    """`speedup == tau * step_ratio` (exactly, by construction)."""

    speedup: float
    tau: float
    ar_step_s: float
    iteration_s: float

    @property
    def step_ratio(self) -> float:
        return self.ar_step_s / self.iteration_s


def decompose(run: RunResult, ar: RunResult) -> Decomposition:
    """Split `run`'s speedup over `ar` into forward-count reduction and per-step cost ratio."""
    ar_step = ar.latency_s.mean / ar.stats.target_forwards
    iteration = run.latency_s.mean / run.stats.target_forwards
    return Decomposition(
        speedup=ar.latency_s.mean / run.latency_s.mean,
        tau=ar.stats.target_forwards / run.stats.target_forwards,
        ar_step_s=ar_step,
        iteration_s=iteration,
    )


def loop_efficiency(run: RunResult) -> float | None:
    """speedup / (tau x AR step / verify time) = verify time / iteration time.

    The share of an iteration spent in the target's verify forward: 1.0 means drafting,
    acceptance and the host loop cost nothing; the rest is loop overhead. None without a
    recorded verify phase. An iteration here is one forward of the decoder (verify or
    prefill) over its whole batch, counted by the phase timer; at batch size 1 that is the
    run's target forward count.
    """
    verify = run.phases.get("verify")
    if verify is None or verify.count == 0:
        return None
    prefill = run.phases.get("prefill")
    forwards = verify.count + (prefill.count if prefill is not None else 0)
    iteration = run.latency_s.mean / forwards
    return (verify.seconds / verify.count) / iteration


def image_samples(run: RunResult) -> "np.ndarray | None":
    """Latencies (repeats, images) of a run, or None in files written before they were recorded."""
    import numpy as np

    per = getattr(run.latency_s, "per_image", None)
    return np.asarray(per, dtype=float) if per else None


def speedup_ci(run: RunResult, ar: RunResult | None) -> "Interval | None":
    """Mean-total speedup over `ar` with its 95 % bootstrap interval (repeats and images
    resampled), or None without per-image samples for both."""
    from runtime.bench.stats import speedup_interval

    a, m = (image_samples(ar) if ar is not None else None), image_samples(run)
    if a is None or m is None or a.shape[1] != m.shape[1]:
        return None
    return speedup_interval(a, m)


def tau_ci(run: RunResult) -> "Interval | None":
    """tau with its 95 % interval over images, or None without per-image counts."""
    from runtime.bench.stats import tau_interval

    counts = getattr(run.stats, "image_counts", None)
    if not counts:
        return None
    return tau_interval([c[0] for c in counts], [c[1] for c in counts])


def fmt_interval(interval: "Interval | None", unit: str = "x") -> str:
    return "-" if interval is None else interval.text("{:.2f}", unit)


def speedup_text(run: RunResult, ar: RunResult | None) -> str:
    """The run's speedup over `ar` (mean-based) with its 95% interval where per-image latencies
    exist; "1 (baseline)" for ar itself; "n/a" without an ar run."""
    if ar is None or run.speedup_vs_ar is None:
        return "n/a"
    if run is ar:
        return "1 (baseline)"
    ci = speedup_ci(run, ar)
    return fmt_interval(ci) if ci is not None else fmt_speedup(run.speedup_vs_ar)


def _ops_cell(run: RunResult, phase: str) -> str:
    o = run.device_ops.get(phase)
    if o is None:
        return "-"
    kernels = "" if o.kernels_per_step is None else f" / {o.kernels_per_step}"
    return f"{o.ops_per_iteration:.0f}{kernels}"


def _without_batch(run: RunResult) -> str:
    return " ".join(part for part in run.params.label().split() if not part.startswith("batch="))


def batch_scaling_table(runs: Sequence[RunResult]) -> Table | None:
    """Per method and batch size: images/s, p50 seconds per image, speedup over ar at that batch
    size and images/s relative to the method's smallest batch. None with one batch size."""
    sizes = sorted({r.params.batch_size for r in runs})
    if len(sizes) < 2:
        return None
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for run in runs:
        groups.setdefault((run.method, _without_batch(run)), []).append(run)
    rows = []
    for (method, params), members in groups.items():
        members = sorted(members, key=lambda r: r.params.batch_size)
        base = members[0]
        for run in members:
            rows.append([method, params or "-", str(run.params.batch_size), _sig(run.images_per_s),
                         _sig(1e3 / run.images_per_s),
                         fmt_speedup(run.speedup_vs_ar),
                         f"{run.images_per_s / base.images_per_s:.2f}x (vs B={base.params.batch_size})",
                         _bytes(run.memory.state_bytes)])
    return Table(["method", "params", "batch size", "images/s", "ms per image (p50)", "speedup over ar at B",
                  "images/s scaling", "decode state"], rows)


def plot_batch_scaling(runs: Sequence[RunResult]) -> Rendered | None:
    """images/s against batch size, one line per method (and its non-batch settings)."""
    if len({r.params.batch_size for r in runs}) < 2:
        return None
    fig = _new_figure(5.0, 3.4)
    ax = fig.subplots()
    groups: dict[str, list[RunResult]] = {}
    for run in runs:
        params = _without_batch(run)
        groups.setdefault(run.method if params in ("", "-") else f"{run.method} [{params}]", []).append(run)
    for label, members in groups.items():
        members = sorted(members, key=lambda r: r.params.batch_size)
        ax.plot([r.params.batch_size for r in members], [r.images_per_s for r in members], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (images per decode)")
    ax.set_ylabel("images/s (p50)")
    ax.legend(fontsize=7)
    return _png(fig)


def depth_table(runs: Sequence[RunResult]) -> Table | None:
    """Per drafted run: mean drafted depth, tau and the acceptance rate at each depth. None when
    no run drafted (or the files predate the drafted depth)."""
    drafted = [r for r in runs if r.stats.per_depth_acceptance]
    if not drafted:
        return None
    rows = []
    for run in drafted:
        depth = run.stats.mean_drafted_depth
        rates = " ".join(f"{a:.2f}" for a in run.stats.per_depth_acceptance)
        rows.append([run.method, run.params.label(), "-" if depth is None else f"{depth:.2f}",
                     fmt_tau(run.stats.mean_accepted_length), rates])
    return Table(["method", "params", "mean drafted depth", "tau", "acceptance at depth 1, 2, ..."], rows)


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


def device_budget_table(runs: Sequence[RunResult]) -> Table | None:
    """Ops per iteration (and compiler kernels per step) per phase, and the loop efficiency."""
    if not any(r.device_ops for r in runs):
        return None
    rows = []
    for run in runs:
        ops = run.device_ops
        verify = ops.get("verify")
        side = sum(ops[p].ops_per_iteration for p in ("draft", "accept") if p in ops)
        share = f"{100 * side / verify.ops_per_iteration:.0f}%" if verify and verify.ops_per_iteration else "-"
        eff = loop_efficiency(run)
        rows.append([run.method, run.params.label(), _ops_cell(run, "draft"), _ops_cell(run, "verify"),
                     _ops_cell(run, "accept"), share, "-" if eff is None else f"{eff:.2f}"])
    return Table(["method", "params", "draft ops / kernels", "verify ops / kernels", "accept ops / kernels",
                  "(draft + accept) / verify ops", "loop efficiency"], rows)


# --------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg canvas; no pyplot global state)
# --------------------------------------------------------------------------------------------


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
            if run.speedup_vs_ar is not None and run.method != "ar" and run_label(run) not in labels:
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
            errors[0].append(point - ci.low if ci else 0.0)
            errors[1].append(ci.high - point if ci else 0.0)
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
    runs = [r for r in bench.result.runs if r.speedup_vs_ar is not None and r.method != "ar"]
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
    ar_index = next((i for i, r in enumerate(runs) if r.method == "ar"), None)
    ar_grid = read_grid(bench.path, ar_index) if ar_index is not None else None
    if ar_grid is None:
        return []
    blocks: list[Block] = []
    for i, run in enumerate(runs):
        grid = read_grid(bench.path, i) if i != ar_index else None
        if grid is not None:
            blocks.append(_figure(f"{slug}-images-{i:02d}", plot_image_pair(ar_grid, grid),
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
    elif run.method == "ar":
        out["step tvd"] = (0.0, None, None)
    return out


def _yerr(estimates) -> list[list[float]] | None:
    """matplotlib's asymmetric error bars for (value, lo, hi) points; None when none has an interval."""
    if all(lo is None for _, lo, _ in estimates):
        return None
    return [[v - lo if lo is not None else 0.0 for v, lo, _ in estimates],
            [hi - v if hi is not None else 0.0 for v, _, hi in estimates]]


def plot_speed_quality(bench: BenchFile) -> Rendered | None:
    """One panel per quality metric (and the measured step TVD): speedup (x) against the metric (y), one line per swept
    method and other setting (its points ordered by the swept parameter), ar as a reference
    point; vertical bars are the figures' 95% bootstrap intervals over images. None without a
    sweep that has speedups and quality."""
    swept = sweep_methods(bench.result)
    runs = [r for r in bench.result.runs if r.method in swept or r.method == "ar"]
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
            if r.method == "ar" and metric in values[id(r)]:
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


# --------------------------------------------------------------------------------------------
# Report structure
# --------------------------------------------------------------------------------------------


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


def file_mode(result: BenchResult) -> str:
    """`graph` or `eager`: how most of a file's runs executed their steps."""
    graphs = [r.params.graph for r in result.runs]
    return "graph" if sum(graphs) * 2 >= len(graphs) else "eager"


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


MIN_REPEATS, MIN_IMAGES = 5, 12  # below these a bench's intervals are too wide to rank methods


def fastest_run(result: BenchResult) -> tuple[RunResult, float, "Interval | None"] | None:
    """The non-ar run with the largest mean-based speedup over ar at its batch size: (run, point,
    95% interval), the interval None for files without per-image timings (the point is then the
    file's `speedup_vs_ar`, which is mean-based since schema version 2). None without an ar run."""
    best: tuple[RunResult, float, Any] | None = None
    for run in result.runs:
        base = ar_baseline(result.runs, run.params.batch_size)
        if run.method == "ar" or base is None:
            continue
        ci = speedup_ci(run, base)
        point = ci.point if ci is not None else run.speedup_vs_ar
        if point is not None and (best is None or point > best[1]):
            best = (run, point, ci)
    return best


def fastest_text(result: BenchResult) -> str:
    """`fastest `M` (params): 1.61x [1.25, 2.04], tau 2.42`, or '-' without an ar run."""
    best = fastest_run(result)
    if best is None:
        return "-"
    run, point, ci = best
    value = fmt_interval(ci) if ci is not None else f"{fmt_speedup(point)} (no interval: no per-image timings)"
    return f"fastest `{run.method}` ({run.params.label()}): {value}, tau {fmt_tau(run.stats.mean_accepted_length)}"


def summary_line(result: BenchResult) -> str | None:
    """The fastest method over ar by the mean-based speedup, with its 95% interval, tau and, where
    measured, its paired quality difference to ar; None without per-image timings or an ar run."""
    best = fastest_run(result)
    if best is None or best[2] is None:
        return None
    run, _, ci = best
    text = (f"Summary: fastest `{run.method}` ({run.params.label()}): {fmt_interval(ci)} over ar "
            f"(mean-based, 95% interval), tau {fmt_tau(run.stats.mean_accepted_length)}")
    q = quality_estimates(run)
    deltas = [f"{name} {v:+.3g}" + (f" [{lo:+.3g}, {hi:+.3g}]" if lo is not None else "")
              for name, (v, lo, hi) in q.items() if name.endswith("_vs_ar")]
    return text + (f"; quality vs ar: {', '.join(deltas)}." if deltas else "; quality not measured against ar.")


def bench_warnings(result: BenchResult) -> list[str]:
    """Plain warnings about a bench too small or too noisy to rank its methods."""
    out = []
    if result.env.repeats < MIN_REPEATS:
        out.append(f"only {result.env.repeats} timed repeats (fewer than {MIN_REPEATS}): intervals are wide")
    if result.workload.num_images < MIN_IMAGES:
        out.append(f"only {result.workload.num_images} images (fewer than {MIN_IMAGES}): tau and quality vary "
                   "with the images drawn")
    for run in result.runs:
        ci = speedup_ci(run, ar_baseline(result.runs, run.params.batch_size)) if run.method != "ar" else None
        if ci is not None and ci.contains(1.0):
            out.append(f"`{run.method}` ({run.params.label()}): its speedup interval {fmt_interval(ci)} spans 1: "
                       "not distinguishable from ar")
    return out


def _device_section(bench: BenchFile, slug: str) -> list[Block]:
    result = bench.result
    blocks: list[Block] = [Heading(3, bench.label), Paragraph(_env_summary(bench))]
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
            _sig(run.images_per_s),
            _seconds(run.latency_s.p50),
            _seconds(run.latency_s.p90),
            _bytes(run.memory.peak_bytes),
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
            _sig(d.ar_step_s * 1e3),
            _sig(d.iteration_s * 1e3),
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
            blocks.append(_figure(f"{slug}-batch", curve, f"Throughput against batch size, {bench.label}"))
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
                            [[r.method, r.params.label(), _sig(r.stats.step_tvd),
                              _sig(r.stats.step_tvd_bound or 0.0), str(r.stats.law_steps)] for r in measured]))
    relaxed = [r for r in result.runs if r.stats.mean_relaxation_mass]
    if relaxed:
        blocks.append(Paragraph(
            "Lossy runs: the mean, per accepted draft, of the relaxation mass moved onto drafts "
            "(LANTERN / LANTERN++: the total-variation shift each relaxed stage may cause) or of the "
            "per-position TVD bound summed over committed positions (`sjd` with `accept=grouped`)."
        ))
        blocks.append(Table(["method", "params", "relaxation / TVD bound per accepted draft"],
                            [[r.method, r.params.label(), _sig(r.stats.mean_relaxation_mass)] for r in relaxed]))
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
            blocks.append(_figure(f"{slug}-depth", curve, f"Acceptance by draft depth, {bench.label}"))
    budget = device_budget_table(result.runs)
    if budget is not None:
        blocks.append(Paragraph(
            "Device budget: non-view aten ops dispatched per iteration in each phase (counted eagerly; "
            "the kernels a GPU would launch without fusion) / kernels the graph compiler generated for "
            "the phase's captured step. Loop efficiency = speedup / (tau x AR step / verify time) = "
            "verify time / iteration time: 1.00 would mean drafting, acceptance and the host loop are free."
        ))
        blocks.append(budget)
    latency = plot_latency(bench)
    if latency is not None:
        blocks.append(_figure(f"{slug}-latency", latency, f"Seconds per image, every timed repeat, {bench.label}"))
    versus = plot_speedup_vs_tau(bench)
    if versus is not None:
        blocks.append(_figure(f"{slug}-tau", versus, f"Speedup against tau, {bench.label}"))
    sweep = plot_sweep(bench)
    if sweep is not None:
        blocks.append(_figure(f"{slug}-sweep", sweep, f"Speedup along the swept parameter, {bench.label}"))
    blocks.extend(image_comparisons(bench, slug))
    phases = plot_phases(bench)
    if phases is not None:
        blocks.append(_figure(f"{slug}-phases", phases, f"Phase breakdown per method, {bench.label}"))
    swept = sweep_methods(result)
    if swept:
        curve = plot_speed_quality(bench)
        if curve is not None:
            blocks.append(_figure(f"{slug}-speed-quality", curve, f"Speed vs quality, {bench.label}"))
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
                    _sig(run.images_per_s),
                    _seconds(run.latency_s.p50),
                    _sig(d.iteration_s * 1e3) if d else "-",
                ])
                if d is not None:
                    points.append((bench, d, run, ar))
        if len(points) >= 2 and method != "ar":
            explained.append(_explain(label, points))
    blocks.append(Table(
        ["method", "device", "tau", "speedup [95% CI]", "= tau (AR fwd / fwd)", "x step ratio", "images/s", "p50 s",
         "iteration ms"],
        rows,
    ))
    blocks.extend(Paragraph(text) for text in explained)
    bars = plot_speedups(group)
    if bars is not None:
        blocks.append(_figure(f"{slug}-speedup", bars, "Speedup over ar per method and device"))
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
    result = compare(samples[2], samples[0], samples[3], samples[1])
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
        blocks.append(Paragraph(_workload_summary(group[0].result)))
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
                blocks.append(_figure(f"w{g + 1}-speedup", bars, f"Speedup over ar per method, {group[0].label}"))
    return blocks


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: Sequence[Block]) -> str:
    """Markdown with figures linked as `plots/<name>.png`."""
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Table):
            lines = ["| " + " | ".join(_md_cell(h) for h in block.headers) + " |"]
            lines.append("|" + "|".join("---" for _ in block.headers) + "|")
            lines.extend("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows)
            out.append("\n".join(lines))
        else:
            out.append(f"![{block.caption}]({PLOTS_DIR}/{block.name}.png)")
    return "\n\n".join(out) + "\n"


_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}"
    "th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f3f3f3}"
    "img{max-width:100%}code{background:#f3f3f3;padding:0 3px}figcaption{font-size:0.85em;color:#555}"
    # a table wider than the page scrolls inside its own box; long words and code spans wrap
    ".wide{overflow-x:auto}p,h1,h2,h3,figcaption{overflow-wrap:anywhere}"
)


def _inline(text: str) -> str:
    """HTML-escape and turn `code` spans into <code>."""
    parts = html.escape(text, quote=False).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def render_html(blocks: Sequence[Block]) -> str:
    """One self-contained HTML page: inline CSS, figures as `data:image/png;base64` URIs."""
    title = next((b.text for b in blocks if isinstance(b, Heading)), "bench report")
    out = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>',
        f"<style>{_CSS}</style></head><body>",
    ]
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            out.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline(h)}</th>" for h in block.headers)
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in block.rows)
            out.append(f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>')
        else:
            data = base64.b64encode(block.png).decode("ascii")
            out.append(
                f'<figure><img alt="{html.escape(block.caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline(block.caption)}</figcaption></figure>"
            )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def load_benches(paths: Sequence[str | os.PathLike[str]]) -> list[BenchFile]:
    """Load and validate every file first; the first bad one raises its one-line UserError."""
    if not paths:
        raise UserError("no bench files given; pass one or more files written by `runtime bench --out`")
    return [BenchFile(path=str(p), result=load_bench(p)) for p in paths]


def split_files(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[BenchFile], list[tuple[str, Any]]]:
    """(bench files, projection files as (path, parsed model)), every file validated first."""
    from runtime.bench.projection import is_projection, validate_projection

    if not paths:
        raise UserError("no bench files given; pass one or more files written by `runtime bench --out`")
    benches, projections = [], []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None  # load_bench names the problem
        if is_projection(data):
            projections.append((str(p), validate_projection(data, str(p))))
        else:
            benches.append(BenchFile(path=str(p), result=load_bench(p)))
    return benches, projections


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
            f"{_sig(p.ar_step.median_s * 1e3)} ms (median)."
        ))
        rows = [[r.label, f"{r.tau:.2f}", r.tau_source, _sig(r.iteration_s * 1e3), f"{r.iteration_over_ar_step:.2f}",
                 f"{r.projected_speedup.point:.2f}x [{r.projected_speedup.low:.2f}, {r.projected_speedup.high:.2f}]"]
                for r in p.runs]
        blocks.append(Table(["method", "tau", "tau from", "iteration ms", "iteration / AR step",
                             "projected speedup [95% CI]"], rows))
    return blocks


def results_index(paths: Sequence[str | os.PathLike[str]], index: str | os.PathLike[str]) -> str:
    """A markdown index of result files (`results/README.md`): one row per bench file, linked
    relative to `index`, with its device, workload, fastest method (mean-based speedup with its
    interval, tau), commit and command; projection files are listed as projections."""
    benches, projections = split_files(paths)
    base = Path(index).absolute().parent
    rows = []
    for bench in sorted(benches, key=lambda b: b.result.env.started_at, reverse=True):
        r, e = bench.result, bench.result.env
        link = os.path.relpath(Path(bench.path).absolute(), base)
        best = fastest_text(r)
        commit = (e.git_commit or "unknown")[:7]
        rows.append([f"[{Path(bench.path).name}]({link})", e.started_at[:10], device_label(r),
                     f"{r.workload.model}, {r.workload.num_images} images x {e.repeats} repeats", best, commit,
                     "`" + " ".join(e.command_line).replace("|", "\\|") + "`"])
    lines = ["# Results", "",
             "Generated by `runtime report FILE... --index results/README.md` from the result files here; "
             "newest first. Speedups are the ratio of mean workload times with their 95% bootstrap interval; "
             "each file's full report: `runtime report FILE --out DIR`.", "",
             "| file | date | device | workload | fastest over ar [95% CI], tau | commit | command |",
             "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    folders = sorted(f.parent.name for f in base.glob("*/README.md"))
    if folders:
        lines += ["", "Result folders with their own notes: " + ", ".join(f"[{f}/]({f}/README.md)" for f in folders)
                  + "."]
    if projections:
        lines += ["", "Projections (step costs measured on a model shape with random weights, times a measured tau):", ""]
        lines += [f"- [{Path(p).name}]({os.path.relpath(Path(p).absolute(), base)})" for p, _ in projections]
    return "\n".join(lines) + "\n"


def write_report(paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Validate `paths`, render everything in a temporary directory, then move `report.md`,
    `report.html` and `plots/` into `out_dir`. Nothing is written when any input is bad."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory; choose a directory path")
    benches, projections = split_files(paths)
    blocks = build_report(benches) if benches else [Heading(1, "lantern-runtime bench report")]
    if projections:
        blocks += projection_section(projections)
    markdown = render_markdown(blocks)
    page = render_html(blocks)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out}: cannot create directory ({err.strerror}); choose a writable path") from None
    staging = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
    try:
        (staging / PLOTS_DIR).mkdir()
        for block in blocks:
            if isinstance(block, Figure):
                (staging / PLOTS_DIR / f"{block.name}.png").write_bytes(block.png)
                if block.svg:
                    (staging / PLOTS_DIR / f"{block.name}.svg").write_bytes(block.svg)
        (staging / TABLES_DIR).mkdir()
        for name, table in table_files(blocks):
            (staging / TABLES_DIR / name).write_text(table_csv(table), encoding="utf-8")
        (staging / REPORT_MD).write_text(markdown, encoding="utf-8")
        (staging / REPORT_HTML).write_text(page, encoding="utf-8")
        old_plots = out / PLOTS_DIR
        if old_plots.exists():
            os.replace(old_plots, staging / "old-plots")
        os.replace(staging / PLOTS_DIR, old_plots)
        old_tables = out / TABLES_DIR
        if old_tables.exists():
            os.replace(old_tables, staging / "old-tables")
        os.replace(staging / TABLES_DIR, old_tables)
        os.replace(staging / REPORT_MD, out / REPORT_MD)
        os.replace(staging / REPORT_HTML, out / REPORT_HTML)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / REPORT_MD, out / REPORT_HTML, out / PLOTS_DIR, out / TABLES_DIR]


def table_files(blocks: Sequence[Block]) -> list[tuple[str, Table]]:
    """(file name, table) for every table: `NN-<heading slug>.csv`, NN counting in page order."""
    import re

    out, heading = [], "report"
    for block in blocks:
        if isinstance(block, Heading):
            heading = re.sub(r"[^a-z0-9]+", "-", block.text.lower()).strip("-")[:48] or "section"
        elif isinstance(block, Table):
            out.append((f"{len(out) + 1:02d}-{heading}.csv", block))
    return out


_INTERVAL_CELL = re.compile(r"^(-?[\d.]+)x? \[(-?[\d.]+), (-?[\d.]+)\]$")
_NUMBER_CELL = re.compile(r"^(-?[\d.]+)x$")


def table_csv(table: Table) -> str:
    """The table as CSV with numbers as numbers: a column holding "1.54x [1.26, 1.81]" cells becomes
    three, `<header>` / `<header> low` / `<header> high`; a "1.54x" cell is 1.54; markdown code
    marks are dropped; other cells are kept as text."""
    import csv

    cells = [[cell.replace("`", "") for cell in row] for row in table.rows]
    split = [any(_INTERVAL_CELL.match(row[j]) for row in cells) for j in range(len(table.headers))]
    headers: list[str] = []
    for j, name in enumerate(table.headers):
        base = name.replace(" [95% CI]", "")
        headers.extend([base, f"{base} low", f"{base} high"] if split[j] else [name])
    rows = []
    for row in cells:
        out: list[str] = []
        for j, cell in enumerate(row):
            interval, number = _INTERVAL_CELL.match(cell), _NUMBER_CELL.match(cell)
            if split[j]:
                out.extend(interval.groups() if interval else [number.group(1) if number else cell, "", ""])
            else:
                out.append(number.group(1) if number else cell)
        rows.append(out)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(headers)
    writer.writerows(rows)
    return buffer.getvalue()
