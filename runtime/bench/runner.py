"""`runtime bench`: one workload, every method, the same device, ratios from the same run.

Each run (a method, possibly with a swept parameter) builds its decoder once, runs the whole
workload `warmup` times untimed (graph capture, compilation, caches), then `repeats` times
timed with the backend's device-synchronised timer, the methods' timed repeats interleaved
round-robin by default. Latency of a repeat = wall time for all images; speedup = AR p50 /
method p50 from this same process, AR at the same batch size (`--batch-size`, `--sweep
batch=1,4,8`: every method runs at every swept size, AR included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from backends.base import dtype_name
from runtime.bench import schema
from runtime.bench.environment import current_env
from runtime.core import MethodSpec
from runtime.core.opcount import phase_ops
from runtime.core.law import bound_warning
from runtime.utils.errors import UserError, did_you_mean
from runtime.config.method_options import BASELINE, METHOD_TABLE, OPTION_TYPES, Drafting, RelaxKind
from runtime.generation.loading import LoadedModel
from runtime.generation.pipeline import make_decoder, run_generation
from runtime.generation.settings import resolve_spec

if TYPE_CHECKING:
    from backends import Backend
    from runtime.core import Decoder
    from runtime.core.slots import SlotDecoder


SWEEP_KEYS = {"lambda": ("lantern_lambda", float, "lantern++"), "delta": ("lantern_delta", float, "lantern"),
              "tree": ("tree", str, "lantern++"), "k": ("lantern_k", int, None), "batch": ("batch_size", int, "*")}
TIMERS = {"cpu": "perf_counter", "cuda": "cuda_events", "hpu": "synchronize+perf_counter"}


@dataclass
class PlannedRun:
    method: str
    overrides: dict[str, Any]
    batch_size: int | None = None  # None: the command's --batch-size (or the profile's)


def parse_sweep(sweeps: Sequence[str]) -> list[tuple[str, type, str | None, list[Any]]]:
    """`lambda=1,2,4` -> [("lantern_lambda", float, "lantern++", [1.0, 2.0, 4.0])]."""
    parsed = []
    for text in sweeps:
        key, sep, values = text.partition("=")
        if not sep or key not in SWEEP_KEYS or not values:
            raise UserError(f"--sweep {text!r}: expected KEY=V1,V2 with KEY one of {', '.join(SWEEP_KEYS)}")
        field, cast, method = SWEEP_KEYS[key]
        try:
            vals = [cast(v) for v in values.split(",") if v != ""]
        except ValueError:
            raise UserError(f"--sweep {text!r}: {key} values must be {cast.__name__}s") from None
        if key == "batch" and any(v < 1 for v in vals):
            raise UserError(f"--sweep {text!r}: batch sizes must be >= 1")
        parsed.append((field, cast, method, vals))
    return parsed


def parse_method_entry(entry: str) -> PlannedRun:
    """`sjd:coupling=maximal:proactive=3x2` -> PlannedRun("sjd", {"coupling": "maximal", ...})."""
    from runtime.core.methods import METHODS

    name, *options = entry.strip().split(":")
    if name not in METHODS:
        raise UserError(f"--methods: unknown method {name!r}{did_you_mean(name, METHODS)}; choose from {', '.join(METHODS)}")
    overrides: dict[str, Any] = {}
    for opt in options:
        key, sep, value = opt.partition("=")
        key = key.replace("-", "_")
        if not sep or key not in OPTION_TYPES or not value:
            raise UserError(f"--methods {entry!r}: expected METHOD:KEY=VALUE with KEY one of "
                            f"{', '.join(sorted(OPTION_TYPES))}")
        try:
            overrides[key] = OPTION_TYPES[key](value)
        except ValueError:
            kind = {int: "an integer", float: "a number"}.get(OPTION_TYPES[key], "text")
            raise UserError(f"--methods {entry!r}: {key} must be {kind}") from None
    return PlannedRun(name, overrides)


def plan_runs(methods: Sequence[str], sweeps: Sequence[str]) -> list[PlannedRun]:
    """One run per method entry (`name` or `name:key=value:...`); a sweep replaces its
    method's single run by one run per value."""
    plan: list[PlannedRun] = []
    swept = parse_sweep(sweeps)
    for entry in methods:
        base = parse_method_entry(entry)
        method = base.method
        variants = [dict(base.overrides)]
        for field, _, target_method, values in swept:
            relaxed = METHOD_TABLE[method].relaxation != RelaxKind.NONE  # a sweep names no method: theirs
            if (target_method is None and relaxed or target_method == method
                    or target_method == "*"):
                variants = [dict(v, **{field: value}) for v in variants for value in values]
        plan.extend(PlannedRun(method, {k: x for k, x in v.items() if k != "batch_size"}, v.get("batch_size"))
                    for v in variants)
    return plan


def bench(loaded: LoadedModel, backend: Backend, profile: Any, plan: Sequence[PlannedRun], flags: dict[str, Any],
          conditions: Sequence[int], *, seed: int, warmup: int, repeats: int, quality: bool,
          command_line: Sequence[str], interleave: bool = True, batch_size: int = 1,
          progress: Callable[[str, int, int], None] | None = None,
          on_images: Callable[[int, np.ndarray], None] | None = None,
          trace_dir: Path | None = None, measure_law: bool = True) -> schema.BenchResult:
    """Run every planned method on the same workload and return a validated BenchResult.

    interleave=True (the default) warms every method up first, then times repeat r of every
    method before repeat r+1 of any, starting each round one method later: a slow spell of a
    shared machine (seen here as 30 % between two back-to-back AR repeats) then lands on all
    methods alike instead of on whichever method happened to be running. It keeps every
    method's decoder (and graphs) alive at once; interleave=False times each method's repeats
    back to back and frees its decoder before the next, for devices short of memory.
    batch_size: images per decode for runs whose plan does not set one (a `batch` sweep).
    on_images(i, images): run i's decoded images (n, H, W, 3) uint8 of its last timed repeat.
    trace_dir: where `NN.json.gz`, a gzipped torch.profiler Chrome trace of run NN, is written: one
    extra, untimed pass over the first decode batch (its first `batch_size` images) after the run's
    timed repeats, so tracing never touches a timing (a whole workload's trace runs to GBs).
    measure_law: measure what each drafting method's acceptance rule does to the law (step TVD,
    `runtime.core.law`) during its first warm-up pass, or in one extra untimed pass after its
    timed repeats when there is no warm-up; never during a timed pass.
    """
    from runtime.tools.roofline import device_roof

    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    roof = device_roof(backend, profile)  # before the runs: a CPU's is measured on an idle machine
    users = sorted({p.method for p in plan})
    specs = [resolve_spec(p.method, {**flags, **p.overrides}, profile, loaded.recommended, run_methods=users)
             for p in plan]
    batches = [p.batch_size or batch_size for p in plan]
    common = specs[0].sampling
    n = len(conditions)
    total_steps = len(specs) * (warmup + repeats)
    done = 0
    latencies: list[list[float]] = [[] for _ in specs]
    per_image: list[list[list[float]]] = [[] for _ in specs]  # [run][repeat][image]
    peaks: list[list[int]] = [[] for _ in specs]
    last: list[Any] = [None] * len(specs)
    phase_runs: list[list[dict[str, dict[str, float]]]] = [[] for _ in specs]
    state: list[int | None] = [None] * len(specs)
    law: list[dict[str, Any] | None] = [None] * len(specs)

    def one_pass(i: int, decoder: SlotDecoder, timed: bool, counted: bool = True) -> None:
        nonlocal done
        if timed:
            backend.reset_peak_memory()
        measure = measure_law and not timed and law[i] is None and specs[i].drafting != Drafting.NONE
        decoder.measure_law = measure
        try:
            out = run_generation(loaded, specs[i], conditions, seed=seed, backend=backend, decoder=decoder)
        finally:
            decoder.measure_law = False
        if measure:
            law[i] = out.stats
        if timed:
            latencies[i].append(out.total_s)
            per_image[i].append(out.image_seconds)
            peak = backend.memory_stats().get("peak_bytes")
            if peak is not None:
                peaks[i].append(int(peak))
            last[i] = out
            phase_runs[i].append(out.phases)
        if not counted:
            return
        done += 1
        if progress is not None:
            progress(_label(specs[i], batches[i]), done, total_steps)

    def law_pass(i: int, decoder: SlotDecoder) -> None:
        """The law measured in an extra untimed pass, where no warm-up pass measured it."""
        if measure_law and law[i] is None and specs[i].drafting != Drafting.NONE:
            one_pass(i, decoder, timed=False, counted=False)

    def traced_pass(i: int, decoder: SlotDecoder) -> None:
        if trace_dir is not None:
            with backend.profiler(trace_dir / f"{i:02d}.json.gz"):
                run_generation(loaded, specs[i], list(conditions)[:batches[i]], seed=seed, backend=backend,
                               decoder=decoder)

    ops: list[dict[str, schema.DeviceOps]] = [{} for _ in specs]
    if interleave:
        decoders = []
        for i, spec in enumerate(specs):
            decoders.append(make_decoder(loaded, spec, backend, batch_size=batches[i]))
            state[i] = decoders[i].state_bytes()
            for _ in range(warmup):
                one_pass(i, decoders[i], timed=False)
        for r in range(repeats):
            for j in range(len(specs)):
                i = (j + r) % len(specs)
                one_pass(i, decoders[i], timed=True)
        ops = [_device_ops(d, conditions, backend, roof) for d in decoders]
        for i, decoder in enumerate(decoders):
            law_pass(i, decoder)
            traced_pass(i, decoder)
        del decoders
    else:
        for i, spec in enumerate(specs):
            decoder = make_decoder(loaded, spec, backend, batch_size=batches[i])
            state[i] = decoder.state_bytes()
            for r in range(warmup + repeats):
                one_pass(i, decoder, timed=r >= warmup)
            ops[i] = _device_ops(decoder, conditions, backend, roof)
            law_pass(i, decoder)
            traced_pass(i, decoder)
            del decoder
    qualities = _qualities(loaded, specs, [out.images for out in last], conditions) if quality else \
        [schema.Quality.not_measured("--no-quality")] * len(specs)
    runs = [_run_result(spec, last[i], latencies[i], max(peaks[i], default=None), n, backend,
                        qualities[i], ops[i], batches[i], state[i], mean_phases(phase_runs[i]),
                        per_image[i], law[i])
            for i, spec in enumerate(specs)]
    if on_images is not None:
        for i, out in enumerate(last):
            on_images(i, out.images)
    info = backend.info()
    versions = {k: str(info[k]) for k in ("torch", "cuda", "driver", "synapseai") if info.get(k)}
    device = schema.DeviceInfo(backend=backend.name, name=str(info.get("name", backend.name)),
                               count=int(info.get("count", 1)), versions=versions,
                               roof=schema.Roof(**roof.to_dict()) if roof is not None else None)
    workload = schema.Workload(
        model=loaded.name, params=loaded.params, tokens_per_image=loaded.config.block_size,
        image_size=loaded.image_size, conditions=schema.Conditions.for_classes(conditions), num_images=n,
        seeds=[int(s) for s in last[0].seeds],
        sampling=schema.Sampling(greedy=common.greedy, temperature=common.temperature, top_k=common.top_k,
                                 top_p=common.top_p, cfg=common.cfg))
    values = profile.to_dict()  # as resolved: the graph mode and dtype the steps really ran with
    values.setdefault("device", {}).update(graph=bool(backend.graph_mode), dtype=dtype_name(backend.dtype))
    env = current_env(profile=schema.Profile(name=profile.name, values=values),
                             started_at=started, bench_seconds=time.perf_counter() - t0, warmup=warmup,
                             repeats=repeats, timer=TIMERS.get(backend.name, "perf_counter"),
                             schedule="interleaved" if interleave else "sequential",
                             command_line=command_line, dtype=dtype_name(backend.dtype),
                             checkpoints=loaded.files)
    return schema.make_bench(device, workload, env, runs)


def _label(spec: MethodSpec, batch_size: int = 1) -> str:
    """A run's progress label: its method and settings as its result will be labelled."""
    params = method_params(spec, graph=False, batch_size=batch_size).label()
    return spec.method if params == "-" else f"{spec.method} [{params}]"


def method_params(spec: MethodSpec, *, graph: bool, batch_size: int) -> schema.MethodParams:
    """The settings `spec` records (`describe`) under the result file's field names."""
    d = spec.describe()
    recorded = {k: d.get(k) for k in schema.MethodParams.model_fields if k in OPTION_TYPES}
    return schema.MethodParams(**{
        **recorded, "tree": d.get("tree", "dynamic" if spec.drafting == Drafting.DYNAMIC else None),
        "proactive": "x".join(map(str, d["proactive"])) if d.get("proactive") else None,
        "graph": graph, "batch_size": batch_size})


def _device_ops(decoder: Decoder, conditions: Sequence[Any], backend: Backend, roof: Any) -> dict[str, schema.DeviceOps]:
    """Ops per iteration of each phase (eager count, first condition), the kernels the
    compiler generated for the decoder's captured steps, and each phase's roofline floor per call
    (with a `roof`). Runs after the timed repeats."""
    from backends.base import dtype_name
    from runtime.tools.roofline import decoder_phases

    first = conditions[0]
    if not isinstance(first, (int, np.integer)):
        return {}  # caption workloads: the count needs the prepared caption features
    if decoder.config.spec.loop != "raster":
        return {}  # the published pjd loop's phases are host work around one forward: no step to count
    ops = phase_ops(decoder, torch.tensor([int(first)] * decoder.config.batch, device=backend.device), seed=0)
    floors = ({phase: w.floor_s(roof, dtype_name(decoder.config.dtype)) for phase, w in decoder_phases(decoder).items()}
              if roof is not None else {})
    return {phase: schema.DeviceOps(ops_per_iteration=float(n), kernels_per_step=decoder.kernels_per_step.get(phase),
                                    floor_s=floors.get(phase))
            for phase, n in ops.items()}


def mean_phases(per_repeat: Sequence[dict[str, dict[str, float]]]) -> dict[str, schema.Phase]:
    """Each phase's seconds and count averaged over the timed repeats (as the schema states),
    not taken from the last repeat. A phase missing from a repeat counts as 0 there."""
    names = sorted({name for phases in per_repeat for name in phases})
    k = max(len(per_repeat), 1)
    return {name: schema.Phase(seconds=sum(float(p.get(name, {}).get("seconds", 0.0)) for p in per_repeat) / k,
                               count=round(sum(int(p.get(name, {}).get("count", 0)) for p in per_repeat) / k))
            for name in names}


def _run_result(spec: MethodSpec, out: Any, latencies: list[float], peak_bytes: int | None, n: int, backend: Backend,
                quality: schema.Quality, device_ops: dict[str, schema.DeviceOps] | None = None, batch_size: int = 1,
                state_bytes: int | None = None, phases: dict[str, schema.Phase] | None = None,
                per_image: list[list[float]] | None = None, law: dict[str, Any] | None = None) -> schema.RunResult:
    params = method_params(spec, graph=bool(backend.graph_mode), batch_size=batch_size)
    if phases is None:
        phases = mean_phases([out.phases])
    st = out.stats
    run = schema.make_run(
        spec.method, latencies=latencies, num_images=n, target_forwards=st["target_forwards"], tokens=st["tokens"],
        mean_accepted_length=st["mean_accepted_length"], params=params,
        per_depth_acceptance=st["per_depth_acceptance"], mean_relaxation_mass=st["mean_relaxation_mass"],
        mean_drafted_depth=st.get("mean_drafted_depth"),
        phases=phases, peak_bytes=peak_bytes, state_bytes=state_bytes, device_ops=device_ops,
        per_image_latencies=per_image or None, image_counts=out.image_counts or None, law=law,
        quality=quality)
    warning = bound_warning(spec, run.stats.step_tvd, run.stats.step_tvd_bound, run.stats.law_steps or 0)
    return run.model_copy(update={"bound_warning": warning}) if warning else run


QUALITY_RESAMPLES = 200  # the demo's figures are cheap: 200 resamples make stable 95% intervals


def _qualities(loaded: LoadedModel, specs: Sequence[MethodSpec], images: Sequence[np.ndarray],
               conditions: Sequence[int]) -> list[schema.Quality]:
    """Each run's demo quality with 95% bootstrap intervals over images (`<metric>_lo/_hi`) and, for
    every run beside AR, its paired difference to the first AR run (`<metric>_vs_ar`, same seeds
    and classes: the relative quality a speedup claim needs)."""
    if loaded.bundle is None:
        reason = ("the bench measures the demo's classifier metrics only; use runtime sample + runtime eval "
                  "--reference for FID / IS / precision-recall")
        return [schema.Quality.not_measured(reason)] * len(specs)
    if len(conditions) < 2:
        return [schema.Quality.not_measured("a Frechet distance needs at least 2 images")] * len(specs)
    from runtime.demo.quality import demo_quality, demo_quality_vs, demo_scores

    labels = np.asarray(conditions)
    scores = [demo_scores(loaded.bundle, im, labels) for im in images]
    base = next((s for s, spec in zip(scores, specs) if spec.method == BASELINE), None)
    out = []
    for score, spec in zip(scores, specs):
        figures = demo_quality(score, reps=QUALITY_RESAMPLES)
        if base is not None and spec.method != BASELINE:
            figures.update(demo_quality_vs(score, base, reps=QUALITY_RESAMPLES))
        flat: dict[str, float] = {}
        for name, e in figures.items():
            flat[name] = e.value
            if e.lo is not None:
                flat[f"{name}_lo"], flat[f"{name}_hi"] = e.lo, e.hi
        out.append(schema.Quality.of(**flat))
    return out


