"""A relaxation clearly past the bound it is stated with is named in one warning: by `runtime run`
(stderr and result.json), `runtime bench` (the run record) and `runtime serve` (one log line,
/ready, /metrics); none within the bound."""

import json
import logging
from types import SimpleNamespace

import torch

from runtime.core import MethodSpec, SamplingParams, generate
from runtime.core.law import MIN_STEPS, bound_warning, exceeds_bound, watches_law
from runtime.serve.engine import Engine
from tiny_models import tiny_pair

LANTERN_PAPER = ["--method", "lantern", "--depth", "3", "--top-k-draft", "4", "--total-tokens", "16",
                 "--lantern-delta", "0.1", "--relax-rule", "paper"]


def spec(**kw) -> MethodSpec:
    return MethodSpec(**{"method": "lantern", "lantern_delta": 0.1, **kw})


def test_margin_both_ways():
    assert exceeds_bound(0.55, 0.1) and exceeds_bound(0.56, 0.4)
    assert not exceeds_bound(0.14, 0.1)  # within the absolute margin
    assert not exceeds_bound(0.18, 0.4) and not exceeds_bound(0.175, 1.89)
    assert not exceeds_bound(0.0, 0.0)


def test_warning_names_both_figures_and_the_setting_that_keeps_the_bound():
    text = bound_warning(spec(), 0.548, 0.1, 200)
    assert "0.548" in text and "0.100" in text and "delta 0.1" in text and "--relax-rule bounded" in text
    lam = bound_warning(spec(method="lantern++", lantern_lambda=3.0, relax_rule="bounded"), 0.9, 0.3, 200)
    assert "lambda 3" in lam and "smaller --lantern-lambda" in lam
    assert bound_warning(spec(), 0.09, 0.1, 200) is None  # within
    assert bound_warning(spec(), 0.548, 0.1, MIN_STEPS - 1) is None  # too few steps for a verdict
    assert bound_warning(spec(), None, None, 0) is None  # not measured


def test_which_runs_watch_their_law():
    assert watches_law(spec()) and watches_law(spec(method="lantern++", lantern_lambda=2.0))
    assert not watches_law(spec(lantern_delta=0.0))  # exact
    assert not watches_law(spec(method="ar"))
    assert not watches_law(spec(sampling=SamplingParams(greedy=True)))


def test_measuring_the_law_leaves_the_tokens_alone():
    target, drafter = tiny_pair(model_type="c2i", vocab=8, sharpness=1.0)
    g = torch.Generator().manual_seed(1)
    nb = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(8)])
    s = MethodSpec(method="lantern", lantern_delta=0.2, lantern_k=4, depth=3, top_k_draft=3, total_tokens=10)
    plain = generate(target, drafter, s, [0, 1, 2], seed=4, neighbours=nb)
    from runtime.core import Decoder

    decoder = Decoder(target, drafter, s, neighbours=nb, batch_size=3)
    decoder.measure_law, decoder.law_every = True, 2
    watched = generate(target, drafter, s, [0, 1, 2], seed=4, neighbours=nb, decoder=decoder)
    assert torch.equal(plain.tokens, watched.tokens)
    assert watched.stats["law_steps"] > 0 and plain.stats["step_tvd"] is None


def test_run_warns_past_the_bound_and_records_it(tmp_path, run_cli):
    out = tmp_path / "paper"
    res = run_cli("run", "--device", "cpu", *LANTERN_PAPER, "--num-images", "2", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    result = json.loads((out / "result.json").read_text())
    tvd, stated = result["stats"]["step_tvd"], result["stats"]["step_tvd_bound"]
    assert exceeds_bound(tvd, stated), (tvd, stated)  # the demo's paper rule on EAGLE-2 trees: about 0.55
    assert result["bound_warning"] and f"{tvd:.3f}" in result["bound_warning"]
    warned = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "--relax-rule bounded" in warned[0]


def test_run_within_the_bound_is_silent(tmp_path, run_cli):
    out = tmp_path / "bounded"
    bounded = [a if a != "paper" else "bounded" for a in LANTERN_PAPER]
    res = run_cli("run", "--device", "cpu", *bounded, "--num-images", "4", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["stats"]["law_steps"] >= MIN_STEPS and result["stats"]["step_tvd"] is not None
    assert result["bound_warning"] is None and "warning:" not in res.stderr


class _Decoder:
    def __init__(self, s: MethodSpec) -> None:
        self.config = SimpleNamespace(spec=s, batch=1)


def test_serve_engine_warns_once_per_method(caplog):
    engine = Engine({"lantern": _Decoder(spec())}, torch.device("cpu"))
    image = SimpleNamespace(law_tvd=0.55 * 10, law_bound=0.1 * 10, law_steps=10)
    with caplog.at_level(logging.WARNING, logger="runtime.serve"):
        engine._watch_law(image)  # 10 steps: no verdict yet
        assert not engine.stats.bound_warnings
        for _ in range(3):
            engine._watch_law(image)
    warned = [r for r in caplog.records if "past its stated bound" in r.getMessage()]
    assert len(warned) == 1 and "lantern" in engine.stats.bound_warnings
    assert engine.stats.step_tvd("lantern") == (0.55, 0.1, 40)


def test_serve_engine_within_the_bound_is_silent(caplog):
    engine = Engine({"lantern": _Decoder(spec(relax_rule="bounded"))}, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="runtime.serve"):
        for _ in range(4):
            engine._watch_law(SimpleNamespace(law_tvd=0.08 * 10, law_bound=0.1 * 10, law_steps=10))
    assert not engine.stats.bound_warnings and not caplog.records
