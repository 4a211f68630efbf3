"""The bench result file: a versioned, validated JSON record of one `runtime bench` run.

One file holds one device and one workload (model, conditions, seeds, sampling) run with several
methods and parameter settings; `docs/bench_schema.md` describes every field and the formulas a
report derives from them. The classes are pydantic models (`extra="forbid"`, finite numbers only)
declaring each field's type and bounds; model validators check what a report trusts across fields:
one seed (and class) per image; per run, `stats.tokens == num_images * tokens_per_image` (forward
counts are comparable), `min(all) <= p10 <= p50 <= p90 <= max(all)`, `images_per_s == num_images /
mean(all)` and `speedup_vs_ar == mean(ar.latency_s.all) / mean(latency_s.all)` (`ar`: the file's first
`ar` run at the run's `params.batch_size`; `null` without one): the one speedup definition, whose
95% interval the report bootstraps from `latency_s.per_image`. A violation is one `UserError` line
naming the file and the field's JSON path: `results/x.json: runs[2].latency_s.p50 must be > 0 (got -1.0)`.

Version 1 files derived both figures from the median (`p50`) repeat instead; they are validated by
that rule and upgraded on load (both figures recomputed from `latency_s.all`), so every reader sees
the mean-based definition.

Built in code, a model has every field set and `to_dict` writes them all; read from a file, it keeps
the file's fields (older files lack later ones), so `to_dict(load_bench(f))` is `f`'s JSON.
`docs/result.schema.json` is `json_schema()`: `python -m runtime.bench --json-schema > FILE`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, ClassVar, Iterable, Literal, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError, model_serializer
from pydantic import ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from runtime.utils.atomic import atomic_write_text
from runtime.utils.errors import UserError
from runtime.config.method_options import BASELINE, OPTIONS_BY_NAME
from runtime.config.validation import (METHOD_PATTERN as _METHOD_PATTERN, SHA256_PATTERN as _SHA256_PATTERN, Bool,
                                Count, NonNegative, Number, Positive, PositiveInt, Text, Unit, describe, join_path as _join)

SCHEMA_VERSION = 2  # 1: images_per_s and speedup_vs_ar from p50 (upgraded on load)
Backend = Literal["cpu", "cuda", "hpu"]
Schedule = Literal["interleaved", "sequential"]
DeviceOpsPhase = Literal["draft", "verify", "accept"]
# Relative tolerance for derived fields (speedup, images/s): the writer computes them exactly,
# this only absorbs rounding by hand-made or third-party writers.
DERIVED_RTOL = 1e-3

FROM_FILE = "file"  # validation context of data read from a file


def _fail(field: str, problem: str) -> PydanticCustomError:
    """A violated invariant at `field`, a JSON path relative to the checking model ("" = itself)."""
    return PydanticCustomError("schema", "{problem}", {"field": field, "problem": problem})


def _iso_time(text: str) -> str:
    try:
        datetime.fromisoformat(text)
    except ValueError:
        raise _fail("", f"must be an ISO-8601 time (got {text!r})") from None
    return text


class _Model(BaseModel):
    """No unknown keys, no NaN/inf. Built in code, a model has every field set (defaults filled,
    and `_code_defaults` for fields every file states but code may omit), so `to_dict` writes
    them all; read from a file (`FROM_FILE` context) it keeps only the file's fields."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _code_defaults: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any, info: ValidationInfo) -> Any:
        if info.context == FROM_FILE or not isinstance(data, dict):
            return data
        defaults = {name: f.get_default(call_default_factory=True)
                    for name, f in cls.model_fields.items() if not f.is_required()}
        return {**defaults, **cls._code_defaults, **data}


class _Sparse(_Model):
    """Serialised without its null fields: in files they are absent, not null."""

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class Roof(_Model):
    """The device's peaks that phase floors are computed with (`runtime.tools.roofline`): memory bandwidth
    (bytes/s), dense matmul rate per dtype (FLOP/s), and where the figures come from."""

    name: Text
    bandwidth_bytes_per_s: Positive
    matmul_flops_per_s: dict[Text, Positive]
    source: Text


class DeviceInfo(_Model):
    """The hardware: backend, device name, devices (ranks) used, the stack below torch (`versions`),
    and its peaks (`roof`; absent in older files and for a device without figures)."""

    backend: Backend
    name: Text
    count: PositiveInt
    versions: dict[str, Text]
    roof: Roof | None = None


class Sampling(_Model):
    """Sampling shared by every method: `top_k == 0`, `top_p == 1.0` and `cfg == 1.0` mean off;
    `greedy` (argmax) overrides temperature/top-k/top-p."""

    greedy: Bool
    temperature: NonNegative
    top_k: Count
    top_p: Positive
    cfg: NonNegative


class Conditions(_Sparse):
    """`kind == "classes"`: `classes[i]` is image i's class id (c2i). `kind == "prompts"`:
    `prompts_sha256` is `prompts_digest` of the ordered prompts (t2i); the prompts stay out of the
    file, the digest tells two workloads apart. The other kind's field is absent."""

    kind: Literal["classes", "prompts"]
    classes: list[Count] | None = None
    prompts_sha256: Annotated[str, Strict(), Field(pattern=_SHA256_PATTERN)] | None = None

    @model_validator(mode="after")
    def _holds_its_kind(self) -> Conditions:
        mine, other = ("classes", "prompts_sha256") if self.kind == "classes" else ("prompts_sha256", "classes")
        if getattr(self, mine) is None:
            raise _fail(mine, "is missing")
        if getattr(self, other) is not None:
            raise _fail(other, f"must be absent when kind is {self.kind!r}")
        return self

    @classmethod
    def for_classes(cls, classes: Sequence[int]) -> Conditions:
        return cls(kind="classes", classes=[int(c) for c in classes])

    @classmethod
    def for_prompts(cls, prompts: Sequence[str]) -> Conditions:
        return cls(kind="prompts", prompts_sha256=prompts_digest(prompts))


class Workload(_Model):
    """What is generated, identical across devices for a fair comparison: the target's parameter
    count `params`, `seeds[i]` image i's seed, `tokens_per_image` = (image_size / 16) ** 2 for VQ-16."""

    model: Text
    params: PositiveInt
    tokens_per_image: PositiveInt
    image_size: PositiveInt
    conditions: Conditions
    num_images: PositiveInt
    seeds: list[Annotated[int, Strict()]]
    sampling: Sampling

    @model_validator(mode="after")
    def _one_per_image(self) -> Workload:
        n, classes = self.num_images, self.conditions.classes
        if len(self.seeds) != n:
            raise _fail("seeds", f"must hold one seed per image ({n}), got {len(self.seeds)}")
        if classes is not None and len(classes) != n:
            raise _fail("conditions.classes", f"must hold one class per image ({n}), got {len(classes)}")
        return self


class Profile(_Model):
    """The hardware profile used: its name and every setting after resolution (JSON values)."""

    name: Text
    values: dict[str, Any]


class Env(_Model):
    """Where and how the bench ran: `started_at` ISO-8601 UTC; `bench_seconds` the whole bench's
    wall time (warm-up included); `warmup`/`repeats` per method; `timer` the clock (`cuda-event`,
    `hpu-synchronize+perf_counter`, `perf_counter`); `schedule` the order of the timed repeats."""

    torch: Text
    python: Text
    platform: Text
    git_commit: Text | None
    command_line: list[Text]
    started_at: Annotated[Text, AfterValidator(_iso_time)]
    bench_seconds: NonNegative
    warmup: Count
    repeats: PositiveInt
    timer: Text
    schedule: Schedule = "sequential"  # absent in the first version-1 files: back-to-back repeats
    profile: Profile
    # what the figures depend on (absent in older files): torch's intra-op threads, the dtype of
    # the steps, versions of the packages computing them, sha256 of every weights file read
    threads: PositiveInt | None = None
    dtype: Literal["fp32", "bf16", "fp16"] | None = None
    packages: dict[str, Text] = {}
    checkpoints: dict[str, Annotated[str, Strict(), Field(pattern=_SHA256_PATTERN)]] = {}


class MethodParams(_Model):
    """A method's settings, `None` where it has none (every field for ar; code may omit any). A file
    states the fields up to `graph`; the later ones (sjd, dynamic depth, batching) are absent in
    older files."""

    tree: Text | None
    lantern_k: PositiveInt | None
    lantern_lambda: NonNegative | None
    lantern_delta: NonNegative | None
    depth: PositiveInt | None
    top_k_draft: PositiveInt | None
    total_tokens: PositiveInt | None
    graph: Bool
    window: PositiveInt | None = None
    init: Text | None = None
    coupling: Text | None = None
    proactive: Text | None = None
    accept: Text | None = None
    ddd_threshold: Number | None = None
    ddd_check_every: PositiveInt | None = None
    ddd_min_depth: PositiveInt | None = None
    dynamic_depth: NonNegative | None = None
    batch_size: PositiveInt = 1
    relax_rule: Literal["paper", "bounded"] | None = None
    group_window: PositiveInt | None = None
    group_gap: NonNegative | None = None
    group_dist: NonNegative | None = None
    pjd_window: PositiveInt | None = None
    pjd_rows: PositiveInt | None = None
    residual: Literal["rule", "tv-optimal"] | None = None
    cool_delta: NonNegative | None = None
    cool_nu: NonNegative | None = None
    cool_mu: Number | None = None
    _code_defaults: ClassVar[dict[str, Any]] = {
        **dict.fromkeys(("tree", "lantern_k", "lantern_lambda", "lantern_delta", "depth", "top_k_draft",
                         "total_tokens")), "graph": False}

    def label(self) -> str:
        """Short `key=value` text of the set fields, e.g. `tree=t7 k=1000 lambda=2 graph`."""
        values = {**self.__dict__, "batch_size": self.batch_size if self.batch_size > 1 else None}
        parts = [f"{short}={_short(values[name])}" for name, short in _LABELS.items() if values[name] is not None]
        return " ".join(parts + ["graph"] * self.graph) or "-"


# a run's label: each set field under its option's short name (`runtime.config.method_options`), in field order
_LABELS = {name: "batch" if name == "batch_size" else OPTIONS_BY_NAME[name].short
           for name in MethodParams.model_fields if name != "graph"}


class RunStats(_Model):
    """Counts for one repeat over the whole workload: tau (`mean_accepted_length`, bonus token
    included), target forwards (prefill included), image tokens, acceptance per draft depth,
    relaxation mass per accepted token (`None` for exact methods), drafted depth per step."""

    mean_accepted_length: NonNegative
    target_forwards: PositiveInt
    tokens: PositiveInt
    per_depth_acceptance: list[Unit]
    mean_relaxation_mass: NonNegative | None
    mean_drafted_depth: NonNegative | None = None
    # per image, workload order: [tokens accepted, target forwards] (tau's interval over images)
    image_counts: list[tuple[Count, PositiveInt]] | None = None
    # what the acceptance rule does to the law (absent in older files and where not measured):
    # mean total variation between a step's output distribution and the target's, at the
    # first drafted position of `law_steps` iterations of an untimed pass, and the relaxation's
    # stated bound at the same steps (0 for exact methods); see runtime.core.law
    step_tvd: Unit | None = None
    step_tvd_bound: NonNegative | None = None
    law_steps: Count | None = None

    @model_validator(mode="after")
    def _counts_add_up(self) -> RunStats:
        if self.image_counts is not None and sum(f for _, f in self.image_counts) != self.target_forwards:
            raise _fail("image_counts", f"the images' target forwards must sum to target_forwards "
                        f"({self.target_forwards})")
        return self

    @property
    def step_compression(self) -> float:
        """Image tokens per target forward."""
        return self.tokens / self.target_forwards


class Latency(_Sparse):
    """Seconds to generate the whole workload once: `all[r]` is repeat r; p10/p50/p90 of `all`.
    `per_image[r][i]`: image i's share of repeat r (the gap since the image completed before it,
    plus an equal share of the batched VQ decode), so row r sums to `all[r]`; absent in older files."""

    p10: Positive
    p50: Positive
    p90: Positive
    all: Annotated[list[Positive], Field(min_length=1)]
    per_image: list[Annotated[list[Positive], Field(min_length=1)]] | None = None

    @property
    def mean(self) -> float:
        """Mean seconds per repeat: what images/s and speedups derive from."""
        return math.fsum(self.all) / len(self.all)

    @model_validator(mode="after")
    def _ordered(self) -> Latency:
        slack = 1e-9 * max(self.all)
        if not (min(self.all) - slack <= self.p10 <= self.p50 + slack
                and self.p50 <= self.p90 + slack and self.p90 <= max(self.all) + slack):
            raise _fail("", "must satisfy min(all) <= p10 <= p50 <= p90 <= max(all); compute it with make_latency(all)")
        rows = self.per_image
        if rows is not None and (len(rows) != len(self.all) or len({len(r) for r in rows}) != 1
                                 or any(abs(sum(r) - t) > 1e-6 * t for r, t in zip(rows, self.all))):
            raise _fail("per_image", "must hold one row per repeat, one entry per image, each row summing to "
                        "that repeat's time in `all`")
        return self


class Phase(_Model):
    """Mean seconds per repeat spent in one phase (draft, verify, accept, vq_decode, ...) and how
    many times the phase ran per repeat."""

    seconds: NonNegative
    count: Count


class Memory(_Model):
    """Peak device memory in the measured repeats (bytes, 1 MB = 1e6 B; `None` if unread) and the
    decoder's decode state (KV caches, p/q buffers; grows with the batch size; absent in older files)."""

    peak_bytes: Count | None
    state_bytes: Count | None = None


class Quality(_Sparse):
    """Image quality of a run: named metrics, or why none were measured. Flat in files:
    `{"measured": true, "class_accuracy": 0.91, "fd": 12.3}` or `{"measured": false, "reason": "..."}`."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Number] = Field(init=False)
    measured: Bool
    reason: Text | None = None

    @model_validator(mode="after")
    def _metrics_or_reason(self) -> Quality:
        if self.measured and not self.metrics:
            raise _fail("", "must name at least one metric when measured is true")
        if self.measured == (self.reason is not None):
            raise _fail("reason", "must be absent when measured is true" if self.measured else "is missing")
        if not self.measured and self.metrics:
            raise _fail(next(iter(self.metrics)), "must be absent when measured is false")
        return self

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.__pydantic_extra__ or {})

    @classmethod
    def of(cls, **metrics: float) -> Quality:
        return cls(measured=True, **{k: float(v) for k, v in metrics.items()})

    @classmethod
    def not_measured(cls, reason: str) -> Quality:
        return cls(measured=False, reason=reason)


class DeviceOps(_Model):
    """The device work of one phase: non-view aten ops per iteration, counted eagerly
    (`runtime.core.opcount`), and the kernels the graph compiler generated for the phase's captured
    step (`None` when the step is not compiled, e.g. eager or plain CUDA-graph mode)."""

    ops_per_iteration: NonNegative
    kernels_per_step: Count | None
    # the phase's roofline floor per call: the least time the device's peaks allow for the bytes it
    # must move and the FLOPs it must run, at the mean context of an image (absent in older files)
    floor_s: NonNegative | None = None


class RunResult(_Model):
    """One method (with one parameter setting) run over the workload; `device_ops` maps a phase
    (draft / verify / accept) to its device work (absent in older files)."""

    method: Annotated[str, Strict(), Field(pattern=_METHOD_PATTERN)]
    params: MethodParams
    stats: RunStats
    latency_s: Latency
    images_per_s: Positive
    speedup_vs_ar: Positive | None
    phases: dict[str, Phase]
    memory: Memory
    quality: Quality
    device_ops: dict[DeviceOpsPhase, DeviceOps] = {}
    # set when the measured step TVD is clearly past the relaxation's stated bound (`runtime.core.law`)
    bound_warning: str | None = None


class BenchResult(_Model):
    """A whole bench file: one device, one workload, several runs."""

    schema_version: Literal[1, 2]
    device: DeviceInfo
    workload: Workload
    env: Env
    runs: Annotated[list[RunResult], Field(min_length=1)]
    _code_defaults: ClassVar[dict[str, Any]] = {"schema_version": SCHEMA_VERSION}

    @model_validator(mode="after")
    def _consistent(self) -> BenchResult:
        w = self.workload
        expected_tokens = w.num_images * w.tokens_per_image
        legacy = self.schema_version == 1
        basis = "latency_s.p50" if legacy else "the mean of latency_s.all"
        for i, (run, speedup) in enumerate(zip(self.runs, speedup_vs_ar(self.runs, legacy=legacy))):
            at, batch = f"runs[{i}]", run.params.batch_size
            if run.stats.tokens != expected_tokens:
                raise _fail(f"{at}.stats.tokens", "must equal workload.num_images x workload.tokens_per_image "
                            f"({w.num_images} x {w.tokens_per_image} = {expected_tokens}), got {run.stats.tokens}")
            for name, rows in (("latency_s.per_image", run.latency_s.per_image and run.latency_s.per_image[0]),
                               ("stats.image_counts", run.stats.image_counts)):
                if rows is not None and len(rows) != w.num_images:
                    raise _fail(f"{at}.{name}", f"must have one entry per image ({w.num_images}), got {len(rows)}")
            ips = w.num_images / (run.latency_s.p50 if legacy else run.latency_s.mean)
            if not math.isclose(run.images_per_s, ips, rel_tol=DERIVED_RTOL):
                raise _fail(f"{at}.images_per_s", f"must equal workload.num_images / {basis} "
                            f"({ips:.6g}), got {run.images_per_s:.6g}")
            if (speedup is None) != (run.speedup_vs_ar is None):
                raise _fail(f"{at}.speedup_vs_ar", f"must be null: the file has no 'ar' run at batch size {batch} to "
                            "compare with" if speedup is None else
                            f"must be a number (the file has an 'ar' run at batch size {batch})")
            if speedup is not None and not math.isclose(run.speedup_vs_ar, speedup, rel_tol=DERIVED_RTOL):
                raise _fail(f"{at}.speedup_vs_ar", f"must equal {basis} of the ar run at its batch size / its "
                            f"{basis} ({speedup:.6g}), got {run.speedup_vs_ar:.6g}")
        return self


# -- builders --------------------------------------------------------------------------------


def prompts_digest(prompts: Sequence[str]) -> str:
    """sha256 hex of the ordered prompts joined by newlines (the t2i workload identity)."""
    return hashlib.sha256("\n".join(prompts).encode("utf-8")).hexdigest()


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(p10, p50, p90) of `values` with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentiles of an empty list")
    data = [float(v) for v in values] * (2 if len(values) == 1 else 1)  # quantiles needs two points
    deciles = statistics.quantiles(data, n=10, method="inclusive")
    return deciles[0], deciles[4], deciles[8]


def make_latency(seconds_per_repeat: Sequence[float], per_image: Sequence[Sequence[float]] | None = None) -> Latency:
    """Latency summary from the per-repeat wall times (seconds), with each image's share of each
    repeat (rows summing to the repeat's time) where recorded."""
    p10, p50, p90 = percentiles(seconds_per_repeat)
    return Latency(p10=p10, p50=p50, p90=p90, all=[float(s) for s in seconds_per_repeat],
                   per_image=None if per_image is None else [[float(x) for x in row] for row in per_image])


def make_run(method: str, *, latencies: Sequence[float], num_images: int, target_forwards: int, tokens: int,
             mean_accepted_length: float, params: MethodParams | None = None, per_depth_acceptance: Sequence[float] = (),
             mean_relaxation_mass: float | None = None, mean_drafted_depth: float | None = None,
             phases: dict[str, Phase] | None = None, peak_bytes: int | None = None, state_bytes: int | None = None,
             quality: Quality | None = None, device_ops: dict[str, DeviceOps] | None = None,
             per_image_latencies: Sequence[Sequence[float]] | None = None,
             image_counts: Sequence[Sequence[int]] | None = None,
             law: dict[str, Any] | None = None) -> RunResult:
    """A run from raw measurements; `speedup_vs_ar` is left `None` (`make_bench` fills it).
    `latencies`: wall seconds per repeat for all `num_images` images; counts are per repeat;
    `per_image_latencies` (repeats, images) and `image_counts` (images, 2) where recorded; `law`:
    the decoder statistics of a pass that measured the law (step_tvd, step_tvd_bound, law_steps)."""
    latency = make_latency(latencies, per_image_latencies)
    stats = RunStats(mean_accepted_length=float(mean_accepted_length), target_forwards=int(target_forwards),
                     tokens=int(tokens), per_depth_acceptance=[float(a) for a in per_depth_acceptance],
                     mean_relaxation_mass=_float_or_none(mean_relaxation_mass),
                     mean_drafted_depth=_float_or_none(mean_drafted_depth),
                     image_counts=None if image_counts is None else [(int(a), int(f)) for a, f in image_counts])
    if law is not None and law.get("law_steps"):
        stats = stats.model_copy(update=dict(step_tvd=min(1.0, float(law["step_tvd"])),
                                             step_tvd_bound=float(law["step_tvd_bound"]),
                                             law_steps=int(law["law_steps"])))
    return RunResult(method=method, params=params if params is not None else MethodParams(), stats=stats,
                     latency_s=latency, images_per_s=num_images / latency.mean, speedup_vs_ar=None,
                     phases=dict(phases or {}), memory=Memory(peak_bytes=peak_bytes, state_bytes=state_bytes),
                     quality=quality if quality is not None else Quality.not_measured("quality was not requested"),
                     device_ops=dict(device_ops or {}))


def _float_or_none(value: float | None) -> float | None:
    return None if value is None else float(value)


def ar_baseline(runs: Sequence[RunResult], batch_size: int | None = None) -> RunResult | None:
    """The run speedups are measured against: the first `ar` run (at `batch_size`, when given), or None."""
    return next((run for run in runs if run.method == BASELINE
                 and (batch_size is None or run.params.batch_size == batch_size)), None)


def speedup_vs_ar(runs: Sequence[RunResult], *, legacy: bool = False) -> list[float | None]:
    """`mean(ar.latency_s.all) / mean(run.latency_s.all)` per run, `ar` being the first ar run at the
    run's batch size (1.0 for the baseline itself); None where there is no ar run at that size.
    legacy: version 1's ratio of the p50s."""
    def t(run: RunResult) -> float:
        return run.latency_s.p50 if legacy else run.latency_s.mean

    baselines = [ar_baseline(runs, run.params.batch_size) for run in runs]
    return [None if ar is None else t(ar) / t(run) for ar, run in zip(baselines, runs)]


def _upgrade(result: BenchResult) -> BenchResult:
    """A version 1 result with images/s and speedups re-derived by version 2's rule (mean-based)."""
    for run, speedup in zip(result.runs, speedup_vs_ar(result.runs)):
        run.images_per_s = result.workload.num_images / run.latency_s.mean
        run.speedup_vs_ar = speedup
    result.schema_version = SCHEMA_VERSION
    return result


def make_bench(device: DeviceInfo, workload: Workload, env: Env, runs: Sequence[RunResult]) -> BenchResult:
    """A validated BenchResult with `speedup_vs_ar` filled in from `runs`' latencies; `UserError`
    naming the field if the pieces are inconsistent (e.g. a run's token count disagrees with the workload)."""
    runs = list(runs)
    for run, speedup in zip(runs, speedup_vs_ar(runs)):
        run.speedup_vs_ar = speedup
    try:
        result = BenchResult(device=device, workload=workload, env=env, runs=runs)
    except ValidationError as err:
        raise UserError(f"<bench>: {describe(err)}") from None
    validate(result)
    return result


# -- files and errors ------------------------------------------------------------------------


def to_dict(result: BenchResult) -> dict[str, Any]:
    """The JSON object for `result` (field order as documented; a file's absent fields stay absent)."""
    return result.model_dump(exclude_unset=True, mode="json")


def to_env_dict(env: Env) -> dict[str, Any]:
    return env.model_dump(exclude_unset=True)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a result file (`docs/result.schema.json`). It states each field's type and
    bounds; the cross-field invariants (module docstring) are beyond JSON Schema."""
    return BenchResult.model_json_schema()


def from_dict(data: Any, source: str = "<bench>") -> BenchResult:
    """Parse and validate a decoded JSON value; `UserError` is `"<source>: <field> <problem>"`."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: the top level must be a JSON object (a `runtime bench` result)")
    if "schema_version" not in data:
        raise UserError(f"{source}: schema_version is missing; is this a `runtime bench` result file?")
    version = data["schema_version"]
    if version not in (1, SCHEMA_VERSION) or isinstance(version, bool):
        raise UserError(f"{source}: schema_version {json.dumps(version)} is not supported (this lantern-runtime "
                        f"reads versions 1 and {SCHEMA_VERSION}); re-run `runtime bench` or use a matching lantern-runtime")
    try:
        result = BenchResult.model_validate(data, context=FROM_FILE)
    except ValidationError as err:
        raise UserError(f"{source}: {describe(err)}") from None
    return _upgrade(result) if version == 1 else result


# Messages by pydantic error type, formatted with the error's context and `input`.
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

