"""What the report derives from bench files: formatting, speedups and tau with intervals, the
speedup decomposition, quality estimates, summary lines and warnings, and the per-run tables."""


from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from runtime.bench.report.blocks import BenchFile, Table
from runtime.bench.schema import (
    BenchResult,
    RunResult,
    ar_baseline,
    iter_differences,
    to_dict,
)
from runtime.config.method_options import BASELINE

if TYPE_CHECKING:
    import numpy as np

    from runtime.bench.stats import Interval



# Lower is better for these quality metrics; higher for the rest (accuracy, CLIP score).
LOWER_IS_BETTER = frozenset({"fd", "fd_vs_ar", "fid", "kid", "step tvd"})


def fmt_speedup(value: float | None) -> str:
    """`2.31x`; `n/a` when there is no ar baseline."""
    return "n/a" if value is None else f"{value:.2f}x"


def fmt_tau(value: float) -> str:
    """`3.07`."""
    return f"{value:.2f}"


def sig(value: float, digits: int = 3) -> str:
    """`digits` significant digits without scientific notation for ordinary magnitudes."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def fmt_seconds(value: float) -> str:
    """Millisecond resolution for ordinary latencies, 3 significant digits below 0.1 s."""
    return f"{value:.3f}" if value >= 0.1 else sig(value, 3)


def fmt_bytes(value: int | None) -> str:
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
    return ", ".join(f"{name} {sig(v, 3)}" + (f" [{sig(lo, 3)}, {sig(hi, 3)}]" if lo is not None else "")
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


def workload_summary(result: BenchResult) -> str:
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


def env_summary(bench: BenchFile) -> str:
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


def images_independent(*runs: RunResult) -> bool:
    """Whether the runs' per-image latencies are independent draws: every run at batch size 1
    (in a batch, images share steps; `runtime.bench.stats`)."""
    return all(run.params.batch_size == 1 for run in runs)


def speedup_ci(run: RunResult, ar: RunResult | None) -> "Interval | None":
    """Mean-total speedup over `ar` with its 95 % bootstrap interval (repeats resampled, and
    images where both ran one at a time), or None without per-image samples for both."""
    from runtime.bench.stats import speedup_interval

    a, m = (image_samples(ar) if ar is not None else None), image_samples(run)
    if ar is None or a is None or m is None or a.shape[1] != m.shape[1]:
        return None
    return speedup_interval(a, m, images_independent=images_independent(ar, run))


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


def without_batch(run: RunResult) -> str:
    return " ".join(part for part in run.params.label().split() if not part.startswith("batch="))


def batch_scaling_table(runs: Sequence[RunResult]) -> Table | None:
    """Per method and batch size: images/s, p50 seconds per image, speedup over ar at that batch
    size and images/s relative to the method's smallest batch. None with one batch size."""
    sizes = sorted({r.params.batch_size for r in runs})
    if len(sizes) < 2:
        return None
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for run in runs:
        groups.setdefault((run.method, without_batch(run)), []).append(run)
    rows = []
    for (method, params), members in groups.items():
        members = sorted(members, key=lambda r: r.params.batch_size)
        base = members[0]
        for run in members:
            rows.append([method, params or "-", str(run.params.batch_size), sig(run.images_per_s),
                         sig(1e3 / run.images_per_s),
                         fmt_speedup(run.speedup_vs_ar),
                         f"{run.images_per_s / base.images_per_s:.2f}x (vs B={base.params.batch_size})",
                         fmt_bytes(run.memory.state_bytes)])
    return Table(["method", "params", "batch size", "images/s", "ms per image (p50)", "speedup over ar at B",
                  "images/s scaling", "decode state"], rows)


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


def floor_table(runs: Sequence[RunResult]) -> Table | None:
    """Each phase's measured time per call against its roofline floor (`DeviceOps.floor_s`)."""
    if not any(o.floor_s for r in runs for o in r.device_ops.values()):
        return None
    rows = []
    for run in runs:
        cells = []
        for phase in ("draft", "verify", "accept"):
            o, ph = run.device_ops.get(phase), run.phases.get(phase)
            if o is None or not o.floor_s or ph is None or not ph.count:
                cells.append("-")
                continue
            per_call = ph.seconds / ph.count
            cells.append(f"{sig(per_call * 1e3)} ms / {sig(o.floor_s * 1e3)} ms = {per_call / o.floor_s:.1f}x")
        rows.append([run.method, run.params.label(), *cells])
    return Table(["method", "params", "draft: measured / floor", "verify: measured / floor", "accept: measured / floor"],
                 rows)


MIN_REPEATS, MIN_IMAGES = 5, 12  # below these a bench's intervals are too wide to rank methods


def fastest_run(result: BenchResult) -> tuple[RunResult, float, "Interval | None"] | None:
    """The non-ar run with the largest mean-based speedup over ar at its batch size: (run, point,
    95% interval), the interval None for files without per-image timings (the point is then the
    file's `speedup_vs_ar`, which is mean-based since schema version 2). None without an ar run."""
    best: tuple[RunResult, float, Any] | None = None
    for run in result.runs:
        base = ar_baseline(result.runs, run.params.batch_size)
        if run.method == BASELINE or base is None:
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


def floor_line(result: BenchResult) -> str | None:
    """One line: each run's phases as measured time per call over their roofline floor."""
    parts = []
    for run in result.runs:
        ratios = [f"{phase} {run.phases[phase].seconds / run.phases[phase].count / o.floor_s:.1f}x"
                  for phase, o in run.device_ops.items()
                  if o.floor_s and phase in run.phases and run.phases[phase].count]
        if ratios:
            parts.append(f"{run.method} ({', '.join(ratios)})")
    if not parts:
        return None
    return f"Measured / physical floor per call: {'; '.join(parts)}."


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
        ci = speedup_ci(run, ar_baseline(result.runs, run.params.batch_size)) if run.method != BASELINE else None
        if ci is not None and ci.contains(1.0):
            out.append(f"`{run.method}` ({run.params.label()}): its speedup interval {fmt_interval(ci)} spans 1: "
                       "not distinguishable from ar")
        if run.bound_warning:
            out.append(run.bound_warning)
    return out

def file_mode(result: BenchResult) -> str:
    """`graph` or `eager`: how most of a file's runs executed their steps."""
    graphs = [r.params.graph for r in result.runs]
    return "graph" if sum(graphs) * 2 >= len(graphs) else "eager"
