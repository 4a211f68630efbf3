"""Parallel Jacobi decoding (pjd), lossless form: greedy equals AR token for token, sampling keeps
AR's law, batch and graph invariance, and the settings it does not take refused."""

from __future__ import annotations

import pytest
import torch

from backends import get_backend
from runtime.core import Decoder, MethodSpec, SamplingParams, generate
from runtime.utils.errors import UserError
from test_core_exactness import _chi_square_p_value, _exact_sequence_distribution
from tiny_models import caption, tiny_pair


def pjd(params: SamplingParams, **kw) -> MethodSpec:
    return MethodSpec("pjd", sampling=params, **{"pjd_window": 3, "pjd_rows": 3, **kw})


@pytest.mark.parametrize("model_type,cfg", [("c2i", 1.0), ("c2i", 3.0), ("t2i", 1.0), ("t2i", 3.0)])
def test_greedy_pjd_equals_ar_token_for_token(model_type, cfg):
    target, _ = tiny_pair(model_type=model_type, vocab=8, sharpness=1.0)
    params = SamplingParams(greedy=True, cfg=cfg)
    conds, masks = ([0, 1, 2, 3], None) if model_type == "c2i" else caption(target, n=3)
    ar = generate(target, None, MethodSpec("ar", sampling=params), conds, cond_masks=masks, seed=3)
    for rows, window in ((1, 4), (2, 2), (3, 3), (4, 8)):
        out = generate(target, None, pjd(params, pjd_rows=rows, pjd_window=window), conds, cond_masks=masks, seed=3)
        assert torch.equal(out.tokens, ar.tokens), (rows, window)
        assert out.stats["target_forwards"] < ar.stats["target_forwards"], (rows, window)


@pytest.mark.parametrize("rows,init", [(2, "uniform"), (3, "repeat-v")])
def test_sampling_pjd_matches_ar_distribution(rows, init):
    # 2x2 grid, 3 codes: 81 possible images enumerated exactly (test_core_exactness has the
    # power of this test); window 2 and the lookahead rows make the canvas feed the frontier
    target, _ = tiny_pair(vocab=3, grid=2, sharpness=0.05, seed=4)
    params = SamplingParams(temperature=1.0, cfg=1.5)
    expected = _exact_sequence_distribution(target, 1, params)
    n = 800
    out = generate(target, None, pjd(params, pjd_window=2, pjd_rows=rows, init=init), [1] * n, seed=11)
    counts: dict = {}
    for row in out.tokens.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert _chi_square_p_value(counts, expected, n) > 1e-3
    assert out.stats["mean_accepted_length"] > 1.2  # drafts were accepted


@pytest.mark.parametrize("greedy", [True, False])
def test_pjd_tokens_do_not_depend_on_the_batch_size(greedy):
    # a 6x6 grid: the lookahead rows sit in the image rows below the frontier
    target, _ = tiny_pair(vocab=8, grid=6, sharpness=1.0)
    spec = pjd(SamplingParams(greedy=greedy, cfg=2.0), pjd_window=3, pjd_rows=3)
    conds = [0, 1, 2, 3, 1, 0]
    one = generate(target, None, spec, conds, seed=5, batch_size=1)
    three = generate(target, None, spec, conds, seed=5, batch_size=3)
    assert torch.equal(three.tokens, one.tokens)
    for key in ("target_forwards", "tokens", "mean_accepted_length"):
        assert three.stats[key] == one.stats[key], key
    assert len({tuple(t.tolist()) for t in one.tokens}) > 2


@pytest.mark.slow
def test_pjd_steps_compile_whole_and_match_eager():
    target, _ = tiny_pair(vocab=8, sharpness=1.0)
    spec = pjd(SamplingParams(cfg=2.0))
    eager = generate(target, None, spec, [0, 1], seed=1)
    backend = get_backend("cpu", graph_mode=True)
    graph = generate(target, None, spec, [0, 1], seed=1, decoder=Decoder(target, None, spec, backend=backend))
    assert torch.equal(graph.tokens, eager.tokens)
    assert graph.stats["target_forwards"] == eager.stats["target_forwards"]
    assert dict(backend.capture_count) == {f"pjd.{s}": 1 for s in ("draft", "verify", "accept")}


@pytest.mark.parametrize("kw,match", [
    (dict(pjd_rows=0), "--pjd-rows must be an integer in"),
    (dict(pjd_rows=17), "--pjd-rows must be an integer in"),
    (dict(pjd_window=1), "--pjd-window must be an integer in"),
    (dict(accept="grouped"), r"--method pjd takes --accept exact or published \(got 'grouped'\)"),
    (dict(coupling="maximal"), "sjd only"),
    (dict(proactive=(2, 1)), "sjd only"),
])
def test_pjd_refuses_bad_values(kw, match):
    with pytest.raises(UserError, match=match):
        MethodSpec("pjd", **kw)


def test_pjd_options_are_refused_for_other_methods():
    with pytest.raises(UserError):
        from runtime.generation.settings import resolve_spec
        resolve_spec("sjd", {"pjd_rows": 3}, None, {})
