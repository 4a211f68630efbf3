"""The bench result file: a versioned, validated JSON record of one `runtime bench` run.

One file holds one device and one workload (model, conditions, seeds, sampling) run with several
methods (`ar`, `sd`, `eagle2`, `lantern`, `lantern++`, `sjd`, and sweeps of their parameters). Every
number a report prints is either stored here or derived from stored numbers by a formula named
in `docs/bench_schema.md`.

Invariants the validator enforces (so a report can trust them):
- `schema_version == SCHEMA_VERSION`;
- `workload.seeds` (and `workload.conditions.classes` for class-conditional runs) hold one entry
  per image;
- per run, `stats.tokens == workload.num_images * workload.tokens_per_image`: every method
  generates the same tokens' worth of work, so forward counts are comparable;
- `latency_s.p10 <= p50 <= p90`, all within `[min(all), max(all)]`;
- `images_per_s == num_images / latency_s.p50`;
- `speedup_vs_ar == ar.latency_s.p50 / run.latency_s.p50` where `ar` is the file's first `ar` run
  at the run's batch size (`params.batch_size`), and `null` where the file has no `ar` run at
  that batch size.

The builders (`make_run`, `make_latency`, `make_bench`, `current_env`) construct objects that pass
validation; `load_bench`/`save_bench` read and atomically write files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from runtime.atomic import atomic_write_text
from runtime.errors import UserError

SCHEMA_VERSION = 1
BACKENDS = ("cpu", "cuda", "hpu")
AR_METHOD = "ar"
# Relative tolerance for derived fields (speedup, images/s): the writer computes them exactly,
# this only absorbs rounding by hand-made or third-party writers.
DERIVED_RTOL = 1e-3
_METHOD_RE = re.compile(r"^[a-z0-9][a-z0-9+_.-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


# --------------------------------------------------------------------------------------------
# Dataclasses
# --------------------------------------------------------------------------------------------


@dataclass
class DeviceInfo:
    """The hardware the bench ran on.

    `backend` is one of `BACKENDS`; `name` the device's marketing name (`NVIDIA H100 80GB HBM3`,
    `GAUDI2`, the CPU model); `count` the number of devices used (ranks); `versions` the software
    stack below torch, e.g. `{"torch": "2.7.1", "cuda": "12.8", "driver": "570.86"}` or
    `{"torch": "2.6.0+hpu...", "synapse": "1.21.0"}`.
    """

    backend: str
    name: str
    count: int
    versions: dict[str, str]


@dataclass
class Sampling:
    """Sampling settings shared by every method in the file.

    `top_k == 0` and `top_p == 1.0` mean no filtering; `cfg == 1.0` means no classifier-free
    guidance. `greedy` overrides temperature/top-k/top-p (argmax decoding).
    """

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    cfg: float


@dataclass
class Conditions:
    """What the images are conditioned on.

    `kind == "classes"`: `classes[i]` is image i's class id (c2i). `kind == "prompts"`:
    `prompts_sha256` is `prompts_digest(prompts)` of the ordered prompt list (t2i); the prompts
    themselves stay out of the file, the digest is enough to tell two workloads apart.
    """

    kind: str
    classes: list[int] | None = None
    prompts_sha256: str | None = None

    @classmethod
    def for_classes(cls, classes: Sequence[int]) -> "Conditions":
        return cls(kind="classes", classes=[int(c) for c in classes])

    @classmethod
    def for_prompts(cls, prompts: Sequence[str]) -> "Conditions":
        return cls(kind="prompts", prompts_sha256=prompts_digest(prompts))


@dataclass
class Workload:
    """What is generated: identical across devices for a fair comparison.

    `params` is the target model's parameter count; `seeds[i]` is image i's sampling seed
    (`len(seeds) == num_images`); `tokens_per_image` is (image_size / 16) ** 2 for VQ-16.
    """

    model: str
    params: int
    tokens_per_image: int
    image_size: int
    conditions: Conditions
    num_images: int
    seeds: list[int]
    sampling: Sampling


@dataclass
class Profile:
    """The hardware profile used: its name and every setting after resolution (JSON values)."""

    name: str
    values: dict[str, Any]


@dataclass
class Env:
    """Where and how the bench ran.

    `started_at` is ISO-8601 UTC; `bench_seconds` the wall time of the whole bench (all methods,
    warm-up included); `warmup`/`repeats` per method; `timer` names the clock used, e.g.
    `cuda-event`, `hpu-synchronize+perf_counter`, `perf_counter`.
    """

    torch: str
    python: str
    platform: str
    git_commit: str | None
    profile: Profile
    command_line: list[str]
    started_at: str
    bench_seconds: float
    warmup: int
    repeats: int
    timer: str
    schedule: str = "sequential"
    # what the figures depend on (absent in files written before they were recorded): torch's
    # intra-op threads, the dtype the steps ran in, versions of the packages that compute them
    # (torch, numpy, lantern-runtime, a backend package), and sha256 of every checkpoint file
    threads: int | None = None
    dtype: str | None = None
    packages: dict[str, str] = field(default_factory=dict)
    checkpoints: dict[str, str] = field(default_factory=dict)


SCHEDULES = ("interleaved", "sequential")


@dataclass
class MethodParams:
    """A method's settings; `None` where the method has no such setting (e.g. every field for ar).

    `tree`: tree shape name (static tree) or `dynamic`; `lantern_k`: proximity-set size;
    `lantern_lambda`: LANTERN++ multiplicative bound; `lantern_delta`: LANTERN total-variation
    bound; `depth`/`top_k_draft`/`total_tokens`: draft tree depth, per-node top-k and verified
    tokens (EAGLE-2); `graph`: whether CUDA/HPU graphs or compilation were used.
    """

    tree: str | None = None
    lantern_k: int | None = None
    lantern_lambda: float | None = None
    lantern_delta: float | None = None
    depth: int | None = None
    top_k_draft: int | None = None
    total_tokens: int | None = None
    graph: bool = False
    # sjd (Jacobi window) settings: window length, prior, coupling, proactive tree "KxD",
    # acceptance rule (exact / grouped)
    window: int | None = None
    init: str | None = None
    coupling: str | None = None
    proactive: str | None = None
    accept: str | None = None
    # dynamic depth: ddd's heuristic threshold / check interval / first check, and the static
    # tree's path-probability cut (`lantern++ --dynamic-depth`); absent in older files
    ddd_threshold: float | None = None
    ddd_check_every: int | None = None
    ddd_min_depth: int | None = None
    dynamic_depth: float | None = None
    # images decoded together (files written before batching lack it: 1)
    batch_size: int = 1

    def label(self) -> str:
        """Short `key=value` text of the set fields, e.g. `tree=t7 k=1000 lambda=2 graph`."""
        names = (
            ("tree", self.tree),
            ("k", self.lantern_k),
            ("lambda", self.lantern_lambda),
            ("delta", self.lantern_delta),
            ("depth", self.depth),
            ("topk", self.top_k_draft),
            ("total", self.total_tokens),
            ("window", self.window),
            ("init", self.init),
            ("coupling", self.coupling),
            ("proactive", self.proactive),
            ("accept", self.accept),
            ("ddd", self.ddd_threshold),
            ("check", self.ddd_check_every),
            ("min", self.ddd_min_depth),
            ("dyn", self.dynamic_depth),
            ("batch", self.batch_size if self.batch_size > 1 else None),
        )
        parts = [f"{name}={_short(value)}" for name, value in names if value is not None]
        if self.graph:
            parts.append("graph")
        return " ".join(parts) if parts else "-"


@dataclass
class RunStats:
    """Counts for one repeat over the whole workload (all images).

    `mean_accepted_length` (tau): tokens committed per verification step, bonus token included
    (1.0 for ar). `target_forwards`: target-model forwards, prefill included. `tokens`: image
    tokens generated (`num_images * tokens_per_image`). `per_depth_acceptance[d]`: fraction of
    verification steps that accepted a draft token at depth d+1 (empty for ar).
    `mean_relaxation_mass`: LANTERN/LANTERN++ mean probability mass added by relaxation per
    accepted token (`None` for exact methods). `mean_drafted_depth`: tree levels drafted per
    verification step (fixed for static trees and EAGLE-2; decided per step by ddd and
    `--dynamic-depth`); `None` in files written before it was recorded. With a depth decided
    per step, `per_depth_acceptance[d]` is over the steps that drafted depth d+1 and accepted
    down to depth d.
    """

    mean_accepted_length: float
    target_forwards: int
    tokens: int
    per_depth_acceptance: list[float] = field(default_factory=list)
    mean_relaxation_mass: float | None = None
    mean_drafted_depth: float | None = None
    # per image, workload order: [tokens accepted, target forwards] (tau's interval over
    # images); None in files written before it was recorded
    image_counts: list[list[int]] | None = None

    @property
    def step_compression(self) -> float:
        """Image tokens per target forward."""
        return self.tokens / self.target_forwards


@dataclass
class Latency:
    """Seconds to generate the whole workload once: `all[r]` is repeat r; p10/p50/p90 of `all`.
    `per_image[r][i]`: image i's share of repeat r (the gap since the image completed before it,
    plus an equal share of the batched VQ decode), so row r sums to `all[r]`; None in files
    written before it was recorded."""

    p10: float
    p50: float
    p90: float
    all: list[float]
    per_image: list[list[float]] | None = None


@dataclass
class Phase:
    """Mean seconds per repeat spent in one phase (draft, verify, accept, vq_decode, ...) and
    how many times the phase ran per repeat."""

    seconds: float
    count: int


@dataclass
class Memory:
    """Peak device memory during the measured repeats (bytes, 1 MB = 1e6 B); `None` if unread.
    `state_bytes`: the decoder's decode state (KV caches, p/q buffers), which grows with the
    batch size; `None` in files written before it was recorded."""

    peak_bytes: int | None
    state_bytes: int | None = None


@dataclass
class Quality:
    """Image quality of a run: named metrics, or why none were measured.

    Serialised flat: `{"measured": true, "class_accuracy": 0.91, "fd": 12.3}` or
    `{"measured": false, "reason": "no local FID weights configured"}`.
    """

    measured: bool
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str | None = None

    @classmethod
    def of(cls, **metrics: float) -> "Quality":
        return cls(measured=True, metrics={k: float(v) for k, v in metrics.items()})

    @classmethod
    def not_measured(cls, reason: str) -> "Quality":
        return cls(measured=False, reason=reason)


@dataclass
class DeviceOps:
    """The device work of one phase: non-view aten ops per iteration, counted eagerly
    (`runtime.core.opcount`), and the kernels the graph compiler generated for the phase's
    captured step (`None` when the step is not compiled, e.g. eager or plain CUDA-graph mode)."""

    ops_per_iteration: float
    kernels_per_step: int | None


@dataclass
class RunResult:
    """One method (with one parameter setting) run over the workload."""

    method: str
    params: MethodParams
    stats: RunStats
    latency_s: Latency
    images_per_s: float
    speedup_vs_ar: float | None
    phases: dict[str, Phase]
    memory: Memory
    quality: Quality
    # phase (draft / verify / accept) -> its device work; empty in files written before it
    device_ops: dict[str, DeviceOps] = field(default_factory=dict)


@dataclass
class BenchResult:
    """A whole bench file: one device, one workload, several runs."""

    device: DeviceInfo
    workload: Workload
    env: Env
    runs: list[RunResult]
    schema_version: int = SCHEMA_VERSION


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def prompts_digest(prompts: Sequence[str]) -> str:
    """sha256 hex of the ordered prompts joined by newlines (the t2i workload identity)."""
    return hashlib.sha256("\n".join(prompts).encode("utf-8")).hexdigest()


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(p10, p50, p90) of `values` with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentiles of an empty list")
    ordered = sorted(float(v) for v in values)

    def at(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return at(0.10), at(0.50), at(0.90)


def make_latency(seconds_per_repeat: Sequence[float],
                 per_image: Sequence[Sequence[float]] | None = None) -> Latency:
    """Latency summary from the per-repeat wall times (seconds), and each image's share of
    each repeat (rows summing to the repeat's time) where recorded."""
    p10, p50, p90 = percentiles(seconds_per_repeat)
    return Latency(p10=p10, p50=p50, p90=p90, all=[float(s) for s in seconds_per_repeat],
                   per_image=None if per_image is None else [[float(x) for x in row] for row in per_image])


def make_run(
    method: str,
    *,
    latencies: Sequence[float],
    num_images: int,
    target_forwards: int,
    tokens: int,
    mean_accepted_length: float,
    params: MethodParams | None = None,
    per_depth_acceptance: Sequence[float] = (),
    mean_relaxation_mass: float | None = None,
    mean_drafted_depth: float | None = None,
    phases: dict[str, Phase] | None = None,
    peak_bytes: int | None = None,
    state_bytes: int | None = None,
    quality: Quality | None = None,
    device_ops: dict[str, DeviceOps] | None = None,
    per_image_latencies: Sequence[Sequence[float]] | None = None,
    image_counts: Sequence[Sequence[int]] | None = None,
) -> RunResult:
    """A run from raw measurements; `speedup_vs_ar` is left `None` (`make_bench` fills it).

    `latencies`: wall seconds per repeat for all `num_images` images; counts are per repeat.
    """
    latency = make_latency(latencies, per_image_latencies)
    return RunResult(
        method=method,
        params=params if params is not None else MethodParams(),
        stats=RunStats(
            mean_accepted_length=float(mean_accepted_length),
            target_forwards=int(target_forwards),
            tokens=int(tokens),
            per_depth_acceptance=[float(a) for a in per_depth_acceptance],
            mean_relaxation_mass=None if mean_relaxation_mass is None else float(mean_relaxation_mass),
            mean_drafted_depth=None if mean_drafted_depth is None else float(mean_drafted_depth),
            image_counts=None if image_counts is None else [[int(a), int(f)] for a, f in image_counts],
        ),
        latency_s=latency,
        images_per_s=num_images / latency.p50,
        speedup_vs_ar=None,
        phases=dict(phases or {}),
        memory=Memory(peak_bytes=peak_bytes, state_bytes=state_bytes),
        quality=quality if quality is not None else Quality.not_measured("quality was not requested"),
        device_ops=dict(device_ops or {}),
    )


def ar_baseline(runs: Sequence[RunResult], batch_size: int | None = None) -> RunResult | None:
    """The run speedups are measured against: the first `ar` run (at `batch_size`, when given),
    or None."""
    return next((run for run in runs if run.method == AR_METHOD
                 and (batch_size is None or run.params.batch_size == batch_size)), None)


def speedup_vs_ar(runs: Sequence[RunResult]) -> list[float | None]:
    """`ar.latency_s.p50 / run.latency_s.p50` per run, `ar` being the first ar run at the run's
    batch size (1.0 for the baseline itself); None where there is no ar run at that size."""
    out: list[float | None] = []
    for run in runs:
        baseline = ar_baseline(runs, run.params.batch_size)
        out.append(None if baseline is None else baseline.latency_s.p50 / run.latency_s.p50)
    return out


def make_bench(device: DeviceInfo, workload: Workload, env: Env, runs: Sequence[RunResult]) -> BenchResult:
    """A validated BenchResult with `speedup_vs_ar` filled in from `runs`' latencies.

    Raises `UserError` naming the field if the pieces are inconsistent (e.g. a run's token count
    disagrees with the workload).
    """
    runs = list(runs)
    for run, speedup in zip(runs, speedup_vs_ar(runs)):
        run.speedup_vs_ar = speedup
    result = BenchResult(device=device, workload=workload, env=env, runs=runs)
    validate(result)
    return result


def git_commit(cwd: str | os.PathLike[str] | None = None) -> str | None:
    """HEAD's commit hash (suffixed `-dirty` when the tree has changes), or None outside git."""
    here = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit or None


def current_env(
    *,
    profile: Profile,
    started_at: datetime,
    bench_seconds: float,
    warmup: int,
    repeats: int,
    timer: str,
    schedule: str = "interleaved",
    command_line: Sequence[str] | None = None,
    dtype: str | None = None,
    checkpoints: Sequence[str | os.PathLike[str]] = (),
) -> Env:
    """Env for this process: torch/python/platform/git commit, threads and package versions read
    here, checkpoint files hashed here, the rest passed in."""
    import torch

    return Env(
        torch=str(torch.__version__),
        python=platform.python_version(),
        platform=platform.platform(),
        git_commit=git_commit(),
        profile=profile,
        command_line=list(command_line if command_line is not None else sys.argv),
        started_at=started_at.astimezone(timezone.utc).isoformat(timespec="seconds"),
        bench_seconds=float(bench_seconds),
        warmup=int(warmup),
        repeats=int(repeats),
        timer=timer,
        schedule=schedule,
        threads=torch.get_num_threads(),
        dtype=dtype,
        packages=package_versions(),
        checkpoints={str(f): file_sha256(f) for f in checkpoints},
    )


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a bench's numbers depend on (those present)."""
    from importlib import metadata

    names = ("torch", "numpy", "lantern-runtime", "triton", "habana-torch-plugin", "intel-extension-for-pytorch")
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Serialisation
# --------------------------------------------------------------------------------------------


def to_dict(result: BenchResult) -> dict[str, Any]:
    """The JSON object for `result` (field order as documented)."""
    w = result.workload
    conditions: dict[str, Any] = {"kind": w.conditions.kind}
    if w.conditions.classes is not None:
        conditions["classes"] = list(w.conditions.classes)
    if w.conditions.prompts_sha256 is not None:
        conditions["prompts_sha256"] = w.conditions.prompts_sha256
    return {
        "schema_version": result.schema_version,
        "device": {
            "backend": result.device.backend,
            "name": result.device.name,
            "count": result.device.count,
            "versions": dict(result.device.versions),
        },
        "workload": {
            "model": w.model,
            "params": w.params,
            "tokens_per_image": w.tokens_per_image,
            "image_size": w.image_size,
            "conditions": conditions,
            "num_images": w.num_images,
            "seeds": list(w.seeds),
            "sampling": vars(w.sampling).copy(),
        },
        "env": to_env_dict(result.env),
        "runs": [_run_to_dict(run) for run in result.runs],
    }


def to_env_dict(env: Env) -> dict[str, Any]:
    return {**{k: v for k, v in vars(env).items() if k != "profile"},
            "profile": {"name": env.profile.name, "values": env.profile.values}}


def _run_to_dict(run: RunResult) -> dict[str, Any]:
    quality: dict[str, Any] = {"measured": run.quality.measured}
    if run.quality.measured:
        quality.update(run.quality.metrics)
    else:
        quality["reason"] = run.quality.reason
    return {
        "method": run.method,
        "params": vars(run.params).copy(),
        "stats": {
            "mean_accepted_length": run.stats.mean_accepted_length,
            "target_forwards": run.stats.target_forwards,
            "tokens": run.stats.tokens,
            "per_depth_acceptance": list(run.stats.per_depth_acceptance),
            "mean_relaxation_mass": run.stats.mean_relaxation_mass,
            "mean_drafted_depth": run.stats.mean_drafted_depth,
            **({} if run.stats.image_counts is None else {"image_counts": run.stats.image_counts}),
        },
        "latency_s": {
            "p10": run.latency_s.p10,
            "p50": run.latency_s.p50,
            "p90": run.latency_s.p90,
            "all": list(run.latency_s.all),
            **({} if run.latency_s.per_image is None else {"per_image": run.latency_s.per_image}),
        },
        "images_per_s": run.images_per_s,
        "speedup_vs_ar": run.speedup_vs_ar,
        "phases": {name: {"seconds": p.seconds, "count": p.count} for name, p in run.phases.items()},
        "memory": {"peak_bytes": run.memory.peak_bytes, "state_bytes": run.memory.state_bytes},
        "quality": quality,
        "device_ops": {name: {"ops_per_iteration": o.ops_per_iteration, "kernels_per_step": o.kernels_per_step}
                       for name, o in run.device_ops.items()},
    }


def from_dict(data: Any, source: str = "<bench>") -> BenchResult:
    """Parse and validate a decoded JSON value; `UserError` is `"<source>: <field> <problem>"`."""
    try:
        return _parse_bench(data)
    except _SchemaError as err:
        raise UserError(f"{source}: {err}") from None


def validate(result: BenchResult, source: str = "<bench>") -> None:
    """Raise `UserError` naming the first invalid field of `result`."""
    try:
        data = json.loads(json.dumps(to_dict(result), allow_nan=False))
    except (TypeError, ValueError) as err:
        raise UserError(f"{source}: not JSON-serialisable ({err}); use plain numbers and strings") from None
    from_dict(data, source)


def load_bench(path: str | os.PathLike[str]) -> BenchResult:
    """Read and validate a bench file; any problem is one `UserError` line naming file and field."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{name}: no such file; pass a result written by `runtime bench --out`") from None
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise UserError(f"{name}: cannot read ({reason})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise UserError(f"{name}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    except ValueError as err:
        raise UserError(f"{name}: not valid JSON ({err})") from None
    return from_dict(data, name)


def save_bench(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    """Validate `result` and write it to `path` atomically (temp file + rename); returns the path."""
    target = Path(path)
    validate(result, str(target))
    text = json.dumps(to_dict(result), indent=2, allow_nan=False) + "\n"
    atomic_write_text(target, text, fsync=True)
    return target


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


# --------------------------------------------------------------------------------------------
# Validation: every helper names the field by its JSON path (`runs[2].latency_s.p50`).
# --------------------------------------------------------------------------------------------


class _SchemaError(ValueError):
    """`<json path> <problem>`; turned into a UserError with the file name by `from_dict`."""


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _get(obj: dict[str, Any], key: str, path: str) -> tuple[Any, str]:
    where = _join(path, key)
    if key not in obj:
        raise _SchemaError(f"{where} is missing")
    return obj[key], where


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _SchemaError(f"{path} must be an object")
    return value


def _list(value: Any, path: str, *, non_empty: bool = False) -> list[Any]:
    if not isinstance(value, list):
        raise _SchemaError(f"{path} must be a list")
    if non_empty and not value:
        raise _SchemaError(f"{path} must not be empty")
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise _SchemaError(f"{path} must be a non-empty string")
    return value


def _one_of(value: Any, path: str, *, choices: Sequence[str]) -> str:
    if value not in choices:
        raise _SchemaError(f"{path} must be one of {', '.join(choices)} (got {value!r})")
    return value


def _boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _SchemaError(f"{path} must be true or false")
    return value


def _number(value: Any, path: str, *, positive: bool = False, non_negative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _SchemaError(f"{path} must be a number")
    if positive and value <= 0:
        raise _SchemaError(f"{path} must be > 0 (got {value})")
    if non_negative and value < 0:
        raise _SchemaError(f"{path} must be >= 0 (got {value})")
    return float(value)


def _integer(value: Any, path: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _SchemaError(f"{path} must be an integer")
    if minimum is not None and value < minimum:
        raise _SchemaError(f"{path} must be >= {minimum} (got {value})")
    return value


def _optional(parse: Callable[..., Any], value: Any, path: str, **kwargs: Any) -> Any:
    return None if value is None else parse(value, path, **kwargs)


def _field(obj: dict[str, Any], key: str, path: str, parse: Callable[..., Any], **kwargs: Any) -> Any:
    value, where = _get(obj, key, path)
    return parse(value, where, **kwargs)


def _optional_field(obj: dict[str, Any], key: str, path: str, parse: Callable[..., Any], **kwargs: Any) -> Any:
    value, where = _get(obj, key, path)
    return _optional(parse, value, where, **kwargs)


def _matrix(value: Any, path: str) -> list[list[float]]:
    """A non-empty list of equal-length, non-empty lists of seconds > 0."""
    rows = [_list(row, _join(path, r), non_empty=True) for r, row in enumerate(_list(value, path, non_empty=True))]
    if len({len(row) for row in rows}) != 1:
        raise _SchemaError(f"{path}: every row must have one entry per image")
    return [[_number(x, _join(_join(path, r), i), positive=True) for i, x in enumerate(row)] for r, row in enumerate(rows)]


def _pairs(value: Any, path: str) -> list[list[int]]:
    """[tokens accepted, target forwards] per image: integers, forwards >= 1."""
    out = []
    for i, pair in enumerate(_list(value, path, non_empty=True)):
        pair = _list(pair, _join(path, i))
        if len(pair) != 2:
            raise _SchemaError(f"{_join(path, i)} must be [tokens accepted, target forwards]")
        out.append([_integer(pair[0], _join(_join(path, i), 0), minimum=0),
                    _integer(pair[1], _join(_join(path, i), 1), minimum=1)])
    return out


def _parse_bench(data: Any) -> BenchResult:
    if not isinstance(data, dict):
        raise _SchemaError("the top level must be a JSON object (a `runtime bench` result)")
    if "schema_version" not in data:
        raise _SchemaError("schema_version is missing; is this a `runtime bench` result file?")
    version = data["schema_version"]
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise _SchemaError(
            f"schema_version {json.dumps(version)} is not supported (this lantern-runtime reads "
            f"version {SCHEMA_VERSION}); re-run `runtime bench` or use a matching lantern-runtime"
        )
    device = _parse_device(_field(data, "device", "", _object), "device")
    workload = _parse_workload(_field(data, "workload", "", _object), "workload")
    env = _parse_env(_field(data, "env", "", _object), "env")
    runs_raw = _field(data, "runs", "", _list, non_empty=True)
    runs = [_parse_run(_object(item, f"runs[{i}]"), f"runs[{i}]") for i, item in enumerate(runs_raw)]
    result = BenchResult(device=device, workload=workload, env=env, runs=runs, schema_version=version)
    _check_consistency(result)
    return result


def _parse_device(obj: dict[str, Any], path: str) -> DeviceInfo:
    backend = _field(obj, "backend", path, _one_of, choices=BACKENDS)
    versions_obj = _field(obj, "versions", path, _object)
    versions = {k: _string(v, _join(_join(path, "versions"), k)) for k, v in versions_obj.items()}
    return DeviceInfo(
        backend=backend,
        name=_field(obj, "name", path, _string),
        count=_field(obj, "count", path, _integer, minimum=1),
        versions=versions,
    )


def _parse_workload(obj: dict[str, Any], path: str) -> Workload:
    num_images = _field(obj, "num_images", path, _integer, minimum=1)
    seeds_path = _join(path, "seeds")
    seeds = [_integer(s, _join(seeds_path, i)) for i, s in enumerate(_field(obj, "seeds", path, _list))]
    if len(seeds) != num_images:
        raise _SchemaError(f"{seeds_path} must hold one seed per image ({num_images}), got {len(seeds)}")
    cond_path = _join(path, "conditions")
    cond_obj = _field(obj, "conditions", path, _object)
    kind = _field(cond_obj, "kind", cond_path, _string)
    if kind == "classes":
        classes_path = _join(cond_path, "classes")
        classes = [
            _integer(c, _join(classes_path, i), minimum=0)
            for i, c in enumerate(_field(cond_obj, "classes", cond_path, _list))
        ]
        if len(classes) != num_images:
            raise _SchemaError(f"{classes_path} must hold one class per image ({num_images}), got {len(classes)}")
        conditions = Conditions(kind=kind, classes=classes)
    elif kind == "prompts":
        digest = _field(cond_obj, "prompts_sha256", cond_path, _string)
        if not _SHA256_RE.match(digest):
            raise _SchemaError(f"{cond_path}.prompts_sha256 must be 64 lowercase hex digits")
        conditions = Conditions(kind=kind, prompts_sha256=digest)
    else:
        raise _SchemaError(f"{cond_path}.kind must be 'classes' or 'prompts' (got {kind!r})")
    s_path = _join(path, "sampling")
    s_obj = _field(obj, "sampling", path, _object)
    sampling = Sampling(
        greedy=_field(s_obj, "greedy", s_path, _boolean),
        temperature=_field(s_obj, "temperature", s_path, _number, non_negative=True),
        top_k=_field(s_obj, "top_k", s_path, _integer, minimum=0),
        top_p=_field(s_obj, "top_p", s_path, _number, positive=True),
        cfg=_field(s_obj, "cfg", s_path, _number, non_negative=True),
    )
    return Workload(
        model=_field(obj, "model", path, _string),
        params=_field(obj, "params", path, _integer, minimum=1),
        tokens_per_image=_field(obj, "tokens_per_image", path, _integer, minimum=1),
        image_size=_field(obj, "image_size", path, _integer, minimum=1),
        conditions=conditions,
        num_images=num_images,
        seeds=seeds,
        sampling=sampling,
    )


def _parse_env(obj: dict[str, Any], path: str) -> Env:
    p_path = _join(path, "profile")
    p_obj = _field(obj, "profile", path, _object)
    profile = Profile(name=_field(p_obj, "name", p_path, _string), values=_field(p_obj, "values", p_path, _object))
    cmd_path = _join(path, "command_line")
    command_line = [_string(a, _join(cmd_path, i)) for i, a in enumerate(_field(obj, "command_line", path, _list))]
    started_at = _field(obj, "started_at", path, _string)
    try:
        datetime.fromisoformat(started_at)
    except ValueError:
        raise _SchemaError(f"{path}.started_at must be an ISO-8601 time (got {started_at!r})") from None
    return Env(
        torch=_field(obj, "torch", path, _string),
        python=_field(obj, "python", path, _string),
        platform=_field(obj, "platform", path, _string),
        git_commit=_optional_field(obj, "git_commit", path, _string),
        profile=profile,
        command_line=command_line,
        started_at=started_at,
        bench_seconds=_field(obj, "bench_seconds", path, _number, non_negative=True),
        warmup=_field(obj, "warmup", path, _integer, minimum=0),
        repeats=_field(obj, "repeats", path, _integer, minimum=1),
        timer=_field(obj, "timer", path, _string),
        schedule=_one_of(obj.get("schedule", "sequential"), _join(path, "schedule"), choices=SCHEDULES),
        threads=_optional(_integer, obj.get("threads"), _join(path, "threads"), minimum=1),
        dtype=_optional(_one_of, obj.get("dtype"), _join(path, "dtype"), choices=("fp32", "bf16", "fp16")),
        packages=_strings(obj.get("packages", {}), _join(path, "packages")),
        checkpoints=_strings(obj.get("checkpoints", {}), _join(path, "checkpoints")),
    )


def _strings(value: Any, path: str) -> dict[str, str]:
    return {k: _string(v, _join(path, k)) for k, v in _object(value, path).items()}


def _parse_run(obj: dict[str, Any], path: str) -> RunResult:
    method = _field(obj, "method", path, _string)
    if not _METHOD_RE.match(method):
        raise _SchemaError(f"{path}.method must be a lowercase method name such as 'ar' or 'lantern++'")
    pr_path = _join(path, "params")
    pr = _field(obj, "params", path, _object)
    params = MethodParams(
        tree=_optional_field(pr, "tree", pr_path, _string),
        lantern_k=_optional_field(pr, "lantern_k", pr_path, _integer, minimum=1),
        lantern_lambda=_optional_field(pr, "lantern_lambda", pr_path, _number, non_negative=True),
        lantern_delta=_optional_field(pr, "lantern_delta", pr_path, _number, non_negative=True),
        depth=_optional_field(pr, "depth", pr_path, _integer, minimum=1),
        top_k_draft=_optional_field(pr, "top_k_draft", pr_path, _integer, minimum=1),
        total_tokens=_optional_field(pr, "total_tokens", pr_path, _integer, minimum=1),
        graph=_field(pr, "graph", pr_path, _boolean),
        # added with sjd: files written before may lack them
        window=_optional(_integer, pr.get("window"), _join(pr_path, "window"), minimum=1),
        **{key: _optional(_string, pr.get(key), _join(pr_path, key)) for key in ("init", "coupling", "proactive", "accept")},
        # added with dynamic depth
        ddd_threshold=_optional(_number, pr.get("ddd_threshold"), _join(pr_path, "ddd_threshold")),
        ddd_check_every=_optional(_integer, pr.get("ddd_check_every"), _join(pr_path, "ddd_check_every"), minimum=1),
        ddd_min_depth=_optional(_integer, pr.get("ddd_min_depth"), _join(pr_path, "ddd_min_depth"), minimum=1),
        dynamic_depth=_optional(_number, pr.get("dynamic_depth"), _join(pr_path, "dynamic_depth"), non_negative=True),
        # added with batching: files written before decoded one image at a time
        batch_size=_integer(pr.get("batch_size", 1), _join(pr_path, "batch_size"), minimum=1),
    )
    st_path = _join(path, "stats")
    st = _field(obj, "stats", path, _object)
    pda_path = _join(st_path, "per_depth_acceptance")
    per_depth = [
        _number(a, _join(pda_path, i), non_negative=True)
        for i, a in enumerate(_field(st, "per_depth_acceptance", st_path, _list))
    ]
    for i, rate in enumerate(per_depth):
        if rate > 1.0:
            raise _SchemaError(f"{_join(pda_path, i)} must be a fraction in [0, 1] (got {rate})")
    stats = RunStats(
        mean_accepted_length=_field(st, "mean_accepted_length", st_path, _number, non_negative=True),
        target_forwards=_field(st, "target_forwards", st_path, _integer, minimum=1),
        tokens=_field(st, "tokens", st_path, _integer, minimum=1),
        per_depth_acceptance=per_depth,
        mean_relaxation_mass=_optional_field(st, "mean_relaxation_mass", st_path, _number, non_negative=True),
        mean_drafted_depth=_optional(_number, st.get("mean_drafted_depth"), _join(st_path, "mean_drafted_depth"),
                                     non_negative=True),
        image_counts=_optional(_pairs, st.get("image_counts"), _join(st_path, "image_counts")),
    )
    if stats.image_counts is not None and sum(f for _, f in stats.image_counts) != stats.target_forwards:
        raise _SchemaError(f"{_join(st_path, 'image_counts')}: the images' target forwards must sum to "
                           f"target_forwards ({stats.target_forwards})")
    lat_path = _join(path, "latency_s")
    lat = _field(obj, "latency_s", path, _object)
    all_path = _join(lat_path, "all")
    latency = Latency(
        p10=_field(lat, "p10", lat_path, _number, positive=True),
        p50=_field(lat, "p50", lat_path, _number, positive=True),
        p90=_field(lat, "p90", lat_path, _number, positive=True),
        all=[
            _number(s, _join(all_path, i), positive=True)
            for i, s in enumerate(_field(lat, "all", lat_path, _list, non_empty=True))
        ],
        per_image=_optional(_matrix, lat.get("per_image"), _join(lat_path, "per_image")),
    )
    if latency.per_image is not None:
        rows = latency.per_image
        if len(rows) != len(latency.all) or any(abs(sum(row) - t) > 1e-6 * t for row, t in zip(rows, latency.all)):
            raise _SchemaError(f"{_join(lat_path, 'per_image')}: one row per repeat, summing to that repeat's "
                               "time in `all`")
    slack = 1e-9 * max(latency.all)
    if not (
        min(latency.all) - slack <= latency.p10 <= latency.p50 + slack
        and latency.p50 <= latency.p90 + slack
        and latency.p90 <= max(latency.all) + slack
    ):
        raise _SchemaError(
            f"{lat_path} must satisfy min(all) <= p10 <= p50 <= p90 <= max(all); "
            "compute it with make_latency(all)"
        )
    ph_path = _join(path, "phases")
    phases: dict[str, Phase] = {}
    for name, value in _field(obj, "phases", path, _object).items():
        one = _object(value, _join(ph_path, name))
        phases[name] = Phase(
            seconds=_field(one, "seconds", _join(ph_path, name), _number, non_negative=True),
            count=_field(one, "count", _join(ph_path, name), _integer, minimum=0),
        )
    mem_path = _join(path, "memory")
    mem = _field(obj, "memory", path, _object)
    memory = Memory(
        peak_bytes=_optional_field(mem, "peak_bytes", mem_path, _integer, minimum=0),
        state_bytes=_optional(_integer, mem.get("state_bytes"), _join(mem_path, "state_bytes"), minimum=0),
    )
    return RunResult(
        method=method,
        params=params,
        stats=stats,
        latency_s=latency,
        images_per_s=_field(obj, "images_per_s", path, _number, positive=True),
        speedup_vs_ar=_optional_field(obj, "speedup_vs_ar", path, _number, positive=True),
        phases=phases,
        memory=memory,
        quality=_parse_quality(_field(obj, "quality", path, _object), _join(path, "quality")),
        device_ops=_parse_device_ops(obj.get("device_ops", {}), _join(path, "device_ops")),
    )


DEVICE_OPS_PHASES = ("draft", "verify", "accept")


def _parse_device_ops(value: Any, path: str) -> dict[str, DeviceOps]:
    out: dict[str, DeviceOps] = {}
    for name, entry in _object(value, path).items():
        one_path = _join(path, name)
        if name not in DEVICE_OPS_PHASES:
            raise _SchemaError(f"{one_path}: unknown phase (expected one of {', '.join(DEVICE_OPS_PHASES)})")
        one = _object(entry, one_path)
        out[name] = DeviceOps(
            ops_per_iteration=_field(one, "ops_per_iteration", one_path, _number, non_negative=True),
            kernels_per_step=_optional_field(one, "kernels_per_step", one_path, _integer, minimum=0),
        )
    return out


def _parse_quality(obj: dict[str, Any], path: str) -> Quality:
    measured = _field(obj, "measured", path, _boolean)
    if not measured:
        return Quality.not_measured(_field(obj, "reason", path, _string))
    metrics = {k: _number(v, _join(path, k)) for k, v in obj.items() if k != "measured"}
    if not metrics:
        raise _SchemaError(f"{path} must name at least one metric when measured is true")
    return Quality(measured=True, metrics=metrics)


def _check_consistency(result: BenchResult) -> None:
    w = result.workload
    expected_tokens = w.num_images * w.tokens_per_image
    speedups = speedup_vs_ar(result.runs)
    for i, (run, expected_speedup) in enumerate(zip(result.runs, speedups)):
        path = f"runs[{i}]"
        if run.stats.tokens != expected_tokens:
            raise _SchemaError(
                f"{path}.stats.tokens must equal workload.num_images x workload.tokens_per_image "
                f"({w.num_images} x {w.tokens_per_image} = {expected_tokens}), got {run.stats.tokens}"
            )
        per_image, counts = run.latency_s.per_image, run.stats.image_counts
        for name, rows in (("latency_s.per_image", per_image and per_image[0]), ("stats.image_counts", counts)):
            if rows is not None and len(rows) != w.num_images:
                raise _SchemaError(f"{path}.{name} must have one entry per image ({w.num_images}), got {len(rows)}")
        expected_ips = w.num_images / run.latency_s.p50
        if not math.isclose(run.images_per_s, expected_ips, rel_tol=DERIVED_RTOL):
            raise _SchemaError(
                f"{path}.images_per_s must equal workload.num_images / latency_s.p50 "
                f"({expected_ips:.6g}), got {run.images_per_s:.6g}"
            )
        if expected_speedup is None:
            if run.speedup_vs_ar is not None:
                raise _SchemaError(f"{path}.speedup_vs_ar must be null: the file has no 'ar' run at batch size "
                                   f"{run.params.batch_size} to compare with")
        elif run.speedup_vs_ar is None:
            raise _SchemaError(f"{path}.speedup_vs_ar must be a number (the file has an 'ar' run at batch size "
                               f"{run.params.batch_size})")
        elif not math.isclose(run.speedup_vs_ar, expected_speedup, rel_tol=DERIVED_RTOL):
            raise _SchemaError(
                f"{path}.speedup_vs_ar must equal latency_s.p50 of the ar run at its batch size / its latency_s.p50 "
                f"({expected_speedup:.6g}), got {run.speedup_vs_ar:.6g}"
            )


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    text = str(value)
    if text.endswith(".toml") and ("/" in text or "\\" in text):  # a tree file: its name says enough
        return Path(text).name[: -len(".toml")]
    return text


def iter_differences(a: Any, b: Any, path: str = "") -> Iterable[tuple[str, Any, Any]]:
    """(json path, a value, b value) for every leaf where two JSON values differ (lists compared
    whole, so `seeds` differs as one field)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            yield from iter_differences(a.get(key), b.get(key), _join(path, key))
    elif a != b:
        yield path, a, b
