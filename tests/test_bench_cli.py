"""`runtime bench` writes a valid result file that `runtime report` renders with its numbers."""

import json

import pytest
from runtime.bench.schema import load_bench
from runtime.models.configs import DrafterConfig
from runtime.models.drafter import Drafter
from runtime.models.loading import save_drafter_folder
from tiny_models import save_tiny_official


@pytest.fixture(scope="module")
def tiny_official(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench_ckpt")
    dcfg = DrafterConfig.for_target(save_tiny_official(d).config)
    save_drafter_folder(d / "drafter", dcfg, Drafter(dcfg))
    return d


def test_bench_then_report(tiny_official, tmp_path, run_cli):
    d = tiny_official
    out = tmp_path / "bench.json"
    res = run_cli("bench", "--gpt-model", "GPT-tiny", "--gpt-ckpt", str(d / "gpt.pt"), "--vq-ckpt", str(d / "vq.pt"),
                  "--image-size", "64", "--drafter", str(d / "drafter"), "--device", "cpu", "--methods",
                  "ar,sd,lantern++", "--sweep", "lambda=1,2", "--lantern-k", "8", "--tree", "small_12",
                  "--num-images", "2", "--repeats", "2", "--warmup", "1", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    assert "Measured / physical floor per call: ar (verify" in " ".join(res.stdout.split())
    result = load_bench(out)
    assert [r.method for r in result.runs] == ["ar", "sd", "lantern++", "lantern++"]
    assert [r.params.lantern_lambda for r in result.runs[2:]] == [1.0, 2.0]
    # the rule is recorded, and the law measured in the warm-up pass (exact methods: TV 0)
    assert [r.params.relax_rule for r in result.runs] == [None, None, "paper", "paper"]
    assert result.runs[0].stats.step_tvd is None
    for run in result.runs[1:3]:
        assert run.stats.step_tvd == pytest.approx(0.0, abs=1e-5) and run.stats.law_steps > 0
    assert result.runs[3].stats.step_tvd_bound > 0
    # the run records the bound verdict on its own measured law (`runtime.core.law.bound_warning`)
    from runtime.core import MethodSpec
    from runtime.core.law import bound_warning

    st = result.runs[3].stats
    assert result.runs[3].bound_warning == bound_warning(MethodSpec(method="lantern++", lantern_lambda=2.0),
                                                         st.step_tvd, st.step_tvd_bound, st.law_steps)
    ar = result.runs[0]
    for run in result.runs:
        assert run.speedup_vs_ar == pytest.approx(ar.latency_s.mean / run.latency_s.mean)
        assert len(run.latency_s.all) == 2 and run.stats.tokens == 2 * 16
        assert {"prefill", "verify", "accept", "decode"} <= set(run.phases)
    assert result.env.warmup == 1 and result.env.repeats == 2 and "--sweep" in result.env.command_line

    rep = tmp_path / "report"
    res = run_cli("report", str(out), "--out", str(rep))
    assert res.exit_code == 0, res.stderr
    md = (rep / "report.md").read_text()
    html = (rep / "report.html").read_text()
    assert "data:image/png;base64" in html
    for run in result.runs[1:]:  # every speedup appears with two decimals, from the JSON's latencies
        assert f"{ar.latency_s.mean / run.latency_s.mean:.2f}x" in md
    assert "What each acceptance rule does to the law" in md
    raw = json.loads(out.read_text())
    assert raw["schema_version"] == 2
    # each phase's roofline floor, with the CPU's measured peaks it was computed from
    assert result.device.roof is not None and result.device.roof.source.startswith("measured")
    for run in result.runs:
        assert all(o.floor_s > 0 for o in run.device_ops.values()) and set(run.device_ops) >= {"verify", "accept"}
    assert "verify: measured / floor" in md


@pytest.mark.parametrize("flag, schedule", [(None, "interleaved"), ("--no-interleave", "sequential")])
def test_bench_schedules_timed_repeats(tiny_official, tmp_path, run_cli, monkeypatch, flag, schedule):
    """Interleaved: all warm-ups, then round r times every method, starting one method later each
    round. Sequential: each method's warm-up and repeats back to back."""
    import runtime.bench.runner as runner

    calls = []
    real = runner.run_generation

    def recording(loaded, spec, *args, **kwargs):
        calls.append(spec.method if spec.method != "lantern++" else f"l{spec.lantern_lambda:g}")
        return real(loaded, spec, *args, **kwargs)

    monkeypatch.setattr(runner, "run_generation", recording)
    d = tiny_official
    out = tmp_path / "bench.json"
    res = run_cli("bench", "--gpt-model", "GPT-tiny", "--gpt-ckpt", str(d / "gpt.pt"), "--vq-ckpt", str(d / "vq.pt"),
                  "--image-size", "64", "--drafter", str(d / "drafter"), "--device", "cpu", "--no-graph",
                  "--methods", "ar,lantern++", "--sweep", "lambda=1,2", "--lantern-k", "8", "--tree", "chain2",
                  "--num-images", "1", "--repeats", "3", "--warmup", "1", "--no-quality", "--out", str(out),
                  *([flag] if flag else []))
    assert res.exit_code == 0, res.stderr
    if schedule == "interleaved":
        assert calls == ["ar", "l1", "l2", "ar", "l1", "l2", "l1", "l2", "ar", "l2", "ar", "l1"]
    else:
        assert calls == ["ar"] * 4 + ["l1"] * 4 + ["l2"] * 4
    result = load_bench(out)
    assert result.env.schedule == schedule
    assert all(len(r.latency_s.all) == 3 for r in result.runs)


@pytest.mark.parametrize("args, message", [
    (["--methods", "ar,bogus"], "unknown method 'bogus'"),
    (["--sweep", "gamma=1,2"], "--sweep 'gamma=1,2'"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--sweep", "batch=0,2"], "batch sizes must be >= 1"),
    (["--sweep", "batch=1,2", "--batch-size", "2"], "give one"),
])
def test_bench_refuses_bad_arguments(tiny_official, tmp_path, run_cli, args, message):
    d = tiny_official
    out = tmp_path / "bench.json"
    res = run_cli("bench", "--gpt-model", "GPT-tiny", "--gpt-ckpt", str(d / "gpt.pt"), "--vq-ckpt", str(d / "vq.pt"),
                  "--image-size", "64", "--device", "cpu", "--out", str(out), *args)
    assert res.exit_code == 2 and message in res.stderr
    assert not out.exists()


def test_bench_sweeps_batch_size_against_ar_at_the_same_size(tiny_official, tmp_path, run_cli):
    d = tiny_official
    out = tmp_path / "bench.json"
    res = run_cli("bench", "--gpt-model", "GPT-tiny", "--gpt-ckpt", str(d / "gpt.pt"), "--vq-ckpt", str(d / "vq.pt"),
                  "--image-size", "64", "--drafter", str(d / "drafter"), "--device", "cpu", "--no-graph",
                  "--methods", "ar,lantern++", "--sweep", "batch=1,2", "--lantern-k", "8", "--tree", "chain2",
                  "--num-images", "3", "--repeats", "1", "--warmup", "0", "--no-quality", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    result = load_bench(out)
    assert [(r.method, r.params.batch_size) for r in result.runs] == [("ar", 1), ("ar", 2), ("lantern++", 1),
                                                                     ("lantern++", 2)]
    ar = {r.params.batch_size: r for r in result.runs if r.method == "ar"}
    for run in result.runs:
        assert run.speedup_vs_ar == pytest.approx(ar[run.params.batch_size].latency_s.mean / run.latency_s.mean)
        assert run.stats.tokens == 3 * 16  # a padded last batch adds no tokens
    assert ar[2].memory.state_bytes == pytest.approx(2 * ar[1].memory.state_bytes, rel=0.01)
    res = run_cli("report", str(out), "--out", str(tmp_path / "report"))
    assert res.exit_code == 0, res.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    assert "images/s scaling" in md and "batch=2" in md
