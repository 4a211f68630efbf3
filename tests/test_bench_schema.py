"""The bench result schema: builders produce valid files, files round-trip, and every malformed
input is rejected with one line naming the file and the field."""

from __future__ import annotations

import copy
import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import pytest

from runtime.bench.environment import current_env
from runtime.bench.schema import (
    SCHEMA_VERSION,
    BenchResult,
    Conditions,
    DeviceInfo,
    Env,
    MethodParams,
    Phase,
    Profile,
    Quality,
    Sampling,
    Workload,
    ar_baseline,
    load_bench,
    make_bench,
    make_run,
    percentiles,
    prompts_digest,
    save_bench,
    speedup_vs_ar,
    json_schema,
    to_dict,
)
from runtime.utils.errors import UserError

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast

NUM_IMAGES = 4
TOKENS = 16


def bench(with_ar: bool = True) -> BenchResult:
    """A small, fully valid bench: ar, eagle2 and lantern++ on a 4-image, 16-token workload."""
    workload = Workload(
        model="GPT-demo", params=1_234_567, tokens_per_image=TOKENS, image_size=64,
        conditions=Conditions.for_classes([0, 1, 2, 3]), num_images=NUM_IMAGES, seeds=[10, 11, 12, 13],
        sampling=Sampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, cfg=1.0),
    )
    env = Env(
        torch="2.13.0+cpu", python="3.11.9", platform="Linux-x86_64", git_commit="abc123",
        profile=Profile(name="cpu", values={"dtype": "fp32", "graph": False}), command_line=["runtime", "bench"],
        started_at="2026-01-02T03:04:05+00:00", bench_seconds=12.5, warmup=1, repeats=3, timer="perf_counter",
        schedule="interleaved",
    )
    tokens = NUM_IMAGES * TOKENS
    runs = [
        make_run("ar", latencies=[2.0, 2.2, 2.1], num_images=NUM_IMAGES, target_forwards=tokens, tokens=tokens,
                 mean_accepted_length=1.0, phases={"verify": Phase(seconds=1.9, count=tokens)}, peak_bytes=10_000_000,
                 quality=Quality.of(class_accuracy=0.75, fd=20.0)),
        make_run("eagle2", latencies=[1.0, 1.1, 1.05], num_images=NUM_IMAGES, target_forwards=24, tokens=tokens,
                 mean_accepted_length=2.6, params=MethodParams(depth=4, top_k_draft=8, total_tokens=30),
                 per_depth_acceptance=[0.8, 0.5, 0.3, 0.1]),
        make_run("lantern++", latencies=[0.7, 0.75, 0.8], num_images=NUM_IMAGES, target_forwards=20, tokens=tokens,
                 mean_accepted_length=3.1, params=MethodParams(tree="t7", lantern_k=100, lantern_lambda=2.0),
                 mean_relaxation_mass=0.12, quality=Quality.not_measured("no FD reference statistics")),
    ]
    if not with_ar:
        runs = runs[1:]
    device = DeviceInfo(backend="cpu", name="Test CPU", count=1, versions={"torch": "2.13.0+cpu"})
    return make_bench(device, workload, env, runs)


def test_builders_fill_derived_fields() -> None:
    result = bench()
    ar, eagle, lantern = result.runs
    assert ar.latency_s.p50 == 2.1 and eagle.latency_s.p50 == 1.05
    assert ar.speedup_vs_ar == 1.0
    assert lantern.speedup_vs_ar == pytest.approx(2.1 / 0.75)
    assert eagle.images_per_s == pytest.approx(NUM_IMAGES / 1.05)
    assert lantern.stats.step_compression == pytest.approx(64 / 20)


def test_speedup_is_null_without_an_ar_run() -> None:
    result = bench(with_ar=False)
    assert [r.speedup_vs_ar for r in result.runs] == [None, None]
    assert speedup_vs_ar(result.runs) == [None, None]


def test_speedups_compare_with_ar_at_the_same_batch_size(tmp_path: Path) -> None:
    result = bench()
    ar, eagle, lantern = result.runs
    ar4 = make_run("ar", latencies=[1.0], num_images=NUM_IMAGES, target_forwards=64, tokens=64,
                   mean_accepted_length=1.0, params=MethodParams(batch_size=4))
    lantern4 = make_run("lantern++", latencies=[0.5], num_images=NUM_IMAGES, target_forwards=20, tokens=64,
                        mean_accepted_length=3.1, params=MethodParams(tree="t7", batch_size=4))
    eagle8 = make_run("eagle2", latencies=[0.4], num_images=NUM_IMAGES, target_forwards=24, tokens=64,
                      mean_accepted_length=2.6, params=MethodParams(batch_size=8))
    batched = make_bench(result.device, result.workload, result.env, [ar, lantern, ar4, lantern4, eagle8])
    assert [r.speedup_vs_ar for r in batched.runs[:4]] == pytest.approx([1.0, 2.1 / 0.75, 1.0, 2.0])
    assert batched.runs[4].speedup_vs_ar is None  # no ar at batch size 8
    path = save_bench(batched, tmp_path / "b.json")
    assert load_bench(path) == batched
    # files written before batching have no batch_size: read as 1
    data = to_dict(bench())
    for run in data["runs"]:
        del run["params"]["batch_size"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert {r.params.batch_size for r in load_bench(tmp_path / "old.json").runs} == {1}


def test_percentiles_interpolate_linearly() -> None:
    assert percentiles([5.0]) == (5.0, 5.0, 5.0)
    assert percentiles([4.0, 1.0, 3.0, 2.0, 5.0]) == pytest.approx((1.4, 3.0, 4.6))


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    original = bench()
    path = save_bench(original, tmp_path / "sub" / "cpu.json")
    loaded = load_bench(path)
    assert loaded == original
    assert json.loads(path.read_text()) == to_dict(original)
    assert [p.name for p in path.parent.iterdir()] == ["cpu.json"]  # no temp file left behind


def test_files_without_a_schedule_read_as_sequential(tmp_path: Path) -> None:
    """`env.schedule` came after version 1's first files: its absence means back-to-back repeats."""
    data = to_dict(bench())
    assert data["env"]["schedule"] == "interleaved"
    del data["env"]["schedule"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_bench(path).env.schedule == "sequential"


def test_prompt_conditions_round_trip(tmp_path: Path) -> None:
    original = bench()
    original.workload.conditions = Conditions.for_prompts(["a red car", "a cat"])
    assert original.workload.conditions.prompts_sha256 == prompts_digest(["a red car", "a cat"])
    assert load_bench(save_bench(original, tmp_path / "t2i.json")) == original


def test_current_env_reads_this_process() -> None:
    started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    env = current_env(profile=Profile(name="cpu", values={}), started_at=started, bench_seconds=1.0, warmup=0, repeats=1,
                      timer="perf_counter", command_line=["runtime", "bench", "--device", "cpu"])
    assert env.started_at == "2026-01-02T03:04:05+00:00"
    assert env.python.count(".") == 2 and env.torch


def mutate(fn: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(data: dict[str, Any]) -> dict[str, Any]:
        data = copy.deepcopy(data)
        fn(data)
        return data

    return apply


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Set a dotted path (list indices as integers) to `value`."""

    def fn(data: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = data
        for key in parents:
            node = node[key]
        node[last] = value

    return mutate(fn)


def _delete(path: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def fn(data: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = data
        for key in parents:
            node = node[key]
        del node[last]

    return mutate(fn)


MALFORMED = [
    (_set("runs.2.latency_s.p50", "fast"), "runs[2].latency_s.p50 must be a number"),
    (_set("runs.2.latency_s.p50", None), "runs[2].latency_s.p50 must be a number"),
    (_delete("runs.1.stats.target_forwards"), "runs[1].stats.target_forwards is missing"),
    (_delete("device"), "device is missing"),
    (_set("device.backend", "tpu"), "device.backend must be one of cpu, cuda, hpu"),
    (_set("device.count", 0), "device.count must be >= 1"),
    (_set("runs.0.stats.tokens", True), "runs[0].stats.tokens must be an integer"),
    (_set("runs", []), "runs must not be empty"),
    (_set("runs.1", "eagle2"), "runs[1] must be an object"),
    (_set("workload.seeds", [1, 2]), "workload.seeds must hold one seed per image (4), got 2"),
    (_set("workload.conditions.kind", "video"), "workload.conditions.kind must be one of classes, prompts (got 'video')"),
    (_set("workload.sampling.greedy", "yes"), "workload.sampling.greedy must be true or false"),
    (_set("env.started_at", "yesterday"), "env.started_at must be an ISO-8601 time"),
    (_set("env.schedule", "random"), "env.schedule must be one of interleaved, sequential"),
    (_set("runs.1.stats.tokens", 63), "runs[1].stats.tokens must equal workload.num_images x workload.tokens_per_image"),
    (_set("runs.1.stats.per_depth_acceptance", [0.5, 1.5]), "runs[1].stats.per_depth_acceptance[1] must be <= 1 (got 1.5)"),
    (_set("runs.1.latency_s.p10", 1.09), "runs[1].latency_s must satisfy min(all) <= p10 <= p50 <= p90 <= max(all)"),
    (_set("runs.1.images_per_s", 10.0), "runs[1].images_per_s must equal workload.num_images / the mean of latency_s.all"),
    (_set("runs.2.speedup_vs_ar", 3.5), "runs[2].speedup_vs_ar must equal the mean of latency_s.all of the ar run at its batch size / its the mean of latency_s.all"),
    (_set("runs.2.speedup_vs_ar", None), "runs[2].speedup_vs_ar must be a number (the file has an 'ar' run at batch size 1)"),
    (_set("runs.0.method", "sd"), "runs[0].speedup_vs_ar must be null: the file has no 'ar' run at batch size 1"),
    (_delete("runs.2.quality.reason"), "runs[2].quality.reason is missing"),
    (_set("runs.0.quality", {"measured": True}), "runs[0].quality must name at least one metric"),
    (_set("runs.0.quality.fd", "low"), "runs[0].quality.fd must be a number"),
    (_set("runs.0.phases.verify.count", -1), "runs[0].phases.verify.count must be >= 0"),
    (_set("runs.0.memory.peak_bytes", 1.5), "runs[0].memory.peak_bytes must be an integer"),
    (_set("runs.1.params.graph", None), "runs[1].params.graph must be true or false"),
    (_set("runs.1.method", "Eagle 2"), "runs[1].method must be a lowercase method name"),
    (_delete("schema_version"), "schema_version is missing"),
    (_set("schema_version", 3), "schema_version 3 is not supported (this lantern-runtime reads versions 1 and 2)"),
    (_set("schema_version", "1"), 'schema_version "1" is not supported'),
    (_set("runs.2.latency_s.all", [0.7, -0.75, 0.8]), "runs[2].latency_s.all[1] must be > 0 (got -0.75)"),
    (_set("runs.1.params.bogus", 1), "runs[1].params.bogus is not a known field; remove it"),
    (_set("env.profile.colour", "red"), "env.profile.colour is not a known field; remove it"),
    (_delete("runs.1.params.tree"), "runs[1].params.tree is missing"),
    (_set("runs.0.device_ops", {"decode": {"ops_per_iteration": 1.0, "kernels_per_step": None}}),
     "runs[0].device_ops.decode must be one of draft, verify, accept (got 'decode')"),
    (_set("workload.conditions.prompts_sha256", "abc"), "workload.conditions.prompts_sha256 must be 64 lowercase hex"),
    (_set("runs.0.quality.reason", "why"), "runs[0].quality.reason must be absent when measured is true"),
    (_set("workload.sampling.top_k", 1.0), "workload.sampling.top_k must be an integer"),
]


@pytest.mark.parametrize(("corrupt", "message"), MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_field_is_named_with_the_file(tmp_path: Path, corrupt: Callable[..., Any], message: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps(corrupt(to_dict(bench()))))
    with pytest.raises(UserError) as err:
        load_bench(path)
    text = str(err.value)
    assert text.startswith(f"{path}: "), text
    assert message in text, text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"schema_version": 1, "device": ', "not valid JSON (line 1, column 33: Expecting value)"),
        ('{"schema_version": NaN}', "not valid JSON (NaN is not a number JSON allows)"),
        ("[1, 2]", "the top level must be a JSON object"),
        (b"\xff\xfe\x00", "cannot read"),
    ],
)
def test_unparseable_files_are_one_line(tmp_path: Path, content: str | bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(UserError) as err:
        load_bench(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


def test_missing_and_unreadable_paths(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"nope\.json: no such file"):
        load_bench(tmp_path / "nope.json")
    with pytest.raises(UserError, match="cannot read"):
        load_bench(tmp_path)  # a directory


def test_make_bench_rejects_inconsistent_pieces() -> None:
    good = bench()
    bad_run = make_run("sd", latencies=[1.0], num_images=NUM_IMAGES, target_forwards=10, tokens=7,
                       mean_accepted_length=2.0)
    with pytest.raises(UserError, match=r"runs\[3\]\.stats\.tokens must equal"):
        make_bench(good.device, good.workload, good.env, [*good.runs, bad_run])


def test_save_refuses_invalid_results_and_keeps_the_old_file(tmp_path: Path) -> None:
    path = save_bench(bench(), tmp_path / "r.json")
    before = path.read_bytes()
    broken = bench()
    broken.runs[1].latency_s.p50 = float("nan")
    with pytest.raises(UserError, match=r"r\.json: (runs\[1\]\.latency_s\.p50 must be a number|not JSON)"):
        save_bench(broken, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_schema_version_constant() -> None:
    assert SCHEMA_VERSION == 2
    assert to_dict(bench())["schema_version"] == 2


def test_phases_are_the_mean_over_the_timed_repeats_not_the_last() -> None:
    from runtime.bench.runner import mean_phases

    repeats = [{"verify": {"seconds": 10.0, "count": 100}, "draft": {"seconds": 2.0, "count": 100}},
               {"verify": {"seconds": 14.0, "count": 100}, "draft": {"seconds": 4.0, "count": 100}},
               {"verify": {"seconds": 18.0, "count": 100}}]  # no draft phase in this repeat
    phases = mean_phases(repeats)
    assert phases["verify"].seconds == pytest.approx(14.0) and phases["verify"].count == 100
    assert phases["draft"].seconds == pytest.approx(2.0) and phases["draft"].count == 67


COMMITTED = sorted(p for p in (Path(__file__).resolve().parents[1] / "results").rglob("*.json")
                   if "schema_version" in (data := json.loads(p.read_text()))
                   and data.get("kind") not in ("projection", "sample"))
PROJECTIONS = sorted(p for p in (Path(__file__).resolve().parents[1] / "results").rglob("*.json")
                     if json.loads(p.read_text()).get("kind") == "projection")


@pytest.mark.parametrize("path", PROJECTIONS, ids=[p.name for p in PROJECTIONS])
def test_every_committed_projection_file_validates(path: Path) -> None:
    from runtime.bench.projection import validate_projection

    assert validate_projection(json.loads(path.read_text()), str(path)).runs


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_every_committed_result_file_round_trips(path: Path) -> None:
    """Loading keeps a file's layout: older files' absent fields stay absent, written the same bytes.
    A version 1 file comes back as version 2: images/s and speedups re-derived from the mean repeat."""
    data = json.loads(path.read_text())
    if data["schema_version"] == 1:
        data["schema_version"] = 2
        n = data["workload"]["num_images"]
        for run in data["runs"]:
            run["images_per_s"] = n / (math.fsum(run["latency_s"]["all"]) / len(run["latency_s"]["all"]))
        runs = load_bench(path).runs
        for run, loaded in zip(data["runs"], runs):
            base = ar_baseline(runs, loaded.params.batch_size)
            run["speedup_vs_ar"] = None if base is None else base.latency_s.mean / loaded.latency_s.mean
        assert to_dict(load_bench(path)) == data
        return
    assert to_dict(load_bench(path)) == data
    assert json.dumps(to_dict(load_bench(path)), indent=2) + "\n" == path.read_text()


def test_a_wrong_field_deep_in_a_committed_file_is_named_by_its_path(tmp_path: Path) -> None:
    data = json.loads(COMMITTED[0].read_text())
    data["runs"][2]["latency_s"]["p50"] = -1.0
    path = tmp_path / "x.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as err:
        load_bench(path)
    assert str(err.value) == f"{path}: runs[2].latency_s.p50 must be > 0 (got -1.0)"


def test_the_committed_json_schema_is_the_one_the_code_emits() -> None:
    """Regenerate with `python -m runtime.bench --json-schema > docs/result.schema.json`."""
    committed = Path(__file__).resolve().parents[1] / "docs" / "result.schema.json"
    assert json.loads(committed.read_text()) == json_schema()


def test_the_recorded_params_are_the_declared_method_options():
    """A result file's params are the method options as declared (runtime.config.method_options): a
    declared option missing from MethodParams would be dropped from every file without a word.
    ddd's most expansions is recorded as `depth` (EAGLE-2's depth, which it is); `graph` and
    `batch_size` are the run's, not the method's."""
    from runtime.bench.schema import MethodParams
    from runtime.core import MethodSpec, SamplingParams
    from runtime.config.method_options import METHOD_OPTIONS, SAMPLING_KEYS

    declared = {o.name for o in METHOD_OPTIONS if o.readers is not None}
    recorded = set(MethodParams.model_fields)
    assert declared - recorded == {"ddd_max_depth"}
    assert recorded - declared == {"graph", "batch_size"}
    # and what a spec describes is recorded: every key of describe() has a field (or is the
    # sampling, the method's name or sjd's derived relaxation kind)
    specs = [MethodSpec(m, SamplingParams()) for m in ("ar", "sd", "eagle2", "ddd", "lantern", "lantern++", "pjd")]
    specs += [MethodSpec("sjd", SamplingParams(), accept="grouped"), MethodSpec("sjd", SamplingParams(), lantern_lambda=3.0,
                                                                           relax="lambda")]
    for spec in specs:
        extra = set(spec.describe()) - recorded - set(SAMPLING_KEYS) - {"method", "relax"}
        assert not extra, (spec.method, extra)
