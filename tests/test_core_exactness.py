"""Exactness: with relaxation off, every method reproduces AR (greedy: token for token;
sampling: in distribution)."""

import itertools
import math

import pytest
import torch

from runtime.core import MethodSpec, SamplingParams, generate
from runtime.core.sampling import apply_cfg, probabilities
from tiny_models import caption, tiny_pair

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast

EXACT = dict(tree="small_12", depth=3, top_k_draft=3, total_tokens=10, lantern_k=4,
             lantern_delta=0.0, lantern_lambda=1.0, cool_delta=1.0, cool_nu=0.0)
SPEC_METHODS = ["sd", "eagle2", "lantern", "lantern++", "cool-sd", "cool-eagle2"]
# COOL-SD with w_d < 1 at every depth: its rule is active (stricter than exact) and, with G*,
# lossless in law (relaxation.py): the annealed stages themselves under test
COOL_STRICT = dict(cool_delta=0.5, cool_nu=0.3, top_k_draft=2)  # 2 of 3 codes drafted: a rejection's residual matters


def spec(method: str, params: SamplingParams, **kw) -> MethodSpec:
    return MethodSpec(method=method, sampling=params, **{**EXACT, **kw})


def neighbours(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.stack([torch.randperm(vocab, generator=g)[: vocab - 1] for _ in range(vocab)])


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_greedy_exact_methods_equal_ar_token_for_token(model_type, cfg):
    target, drafter = tiny_pair(model_type=model_type, vocab=8, sharpness=1.0)
    params = SamplingParams(greedy=True, cfg=cfg)
    if model_type == "c2i":
        conds, masks = [0, 1, 2, 3], None
    else:
        conds, masks = caption(target, n=3)
    nb = neighbours(8)
    ar = generate(target, None, spec("ar", params), conds, cond_masks=masks, seed=3)
    for method in SPEC_METHODS:
        out = generate(target, drafter, spec(method, params), conds, cond_masks=masks, seed=3,
                       neighbours=nb)
        assert torch.equal(out.tokens, ar.tokens), method
        # drafts were accepted, so the comparison exercised the tree paths
        assert out.stats["target_forwards"] < ar.stats["target_forwards"], method


def _exact_sequence_distribution(target, label: int, params: SamplingParams) -> dict:
    """P(sequence) for every token sequence, by enumeration over teacher-forced forwards."""
    cfg = target.config
    seqs = list(itertools.product(range(cfg.vocab_size), repeat=cfg.block_size))
    idx = torch.tensor(seqs)
    cond = torch.full((len(seqs),), label)
    with torch.no_grad():
        logits, _ = target.forward_train(cond, idx)
        if params.uses_cfg:
            unc, _ = target.forward_train(torch.full_like(cond, cfg.num_classes), idx)
            logits = apply_cfg(torch.cat([logits, unc]), params.cfg)
        probs = probabilities(logits, params)  # (S, T, V)
    per_token = probs.gather(2, idx[..., None]).squeeze(-1)
    return dict(zip(seqs, per_token.prod(1).tolist()))


def _chi_square_p_value(counts: dict, expected: dict, n: int) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled; returns the p-value."""
    stat, df, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for seq, p in expected.items():
        e, o = p * n, counts.get(seq, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    # Wilson-Hilferty approximation of the chi-square upper tail
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("method", ["ar"] + SPEC_METHODS)
def test_sampling_exact_methods_match_ar_distribution(method):
    # 2x2 grid, 3 codes: 81 possible images; the exact AR distribution is enumerated.
    # Power: with n = 800 samples, a distortion of the sequence distribution by TVD 0.15
    # (e.g. a residual that forgets to subtract q) adds roughly n * 0.15^2 * 81 / 4 ~ 360 to
    # the chi-square statistic over ~40 dof, far beyond the p < 1e-3 threshold (~73); an
    # exact sampler fails this test with probability 1e-3.
    target, drafter = tiny_pair(vocab=3, grid=2, sharpness=0.05, seed=4)
    params = SamplingParams(temperature=1.0, cfg=1.5)
    expected = _exact_sequence_distribution(target, 1, params)
    n = 800
    out = generate(target, drafter if method != "ar" else None, spec(method, params), [1] * n,
                   seed=11, neighbours=neighbours(3))
    counts: dict = {}
    for row in out.tokens.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert _chi_square_p_value(counts, expected, n) > 1e-3
    if method != "ar":
        assert out.stats["mean_accepted_length"] > 1.3  # drafts were accepted


@pytest.mark.parametrize("method", ["cool-sd", "cool-eagle2"])
def test_cool_sd_below_one_is_lossless_in_law_and_greedy(method):
    """w_d < 1 everywhere runs the annealed stages (their G* residual keeps what a rejection leaves
    at the draft), and must still give AR's law, and AR's greedy tokens."""
    strict = spec(method, SamplingParams(), **COOL_STRICT)
    assert strict.relaxation_kind == "anneal"
    target, drafter = tiny_pair(vocab=3, grid=2, sharpness=0.05, seed=4)
    params = SamplingParams(temperature=1.0, cfg=1.5)
    expected = _exact_sequence_distribution(target, 1, params)
    n = 800
    out = generate(target, drafter, spec(method, params, **COOL_STRICT), [1] * n, seed=11)
    counts: dict = {}
    for row in out.tokens.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert _chi_square_p_value(counts, expected, n) > 1e-3
    assert out.stats["mean_accepted_length"] > 1.2
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    greedy = SamplingParams(greedy=True, cfg=3.0)
    ar = generate(target, None, spec("ar", greedy), [0, 1, 2, 3], seed=3)
    out = generate(target, drafter, spec(method, greedy, **COOL_STRICT), [0, 1, 2, 3], seed=3)
    assert torch.equal(out.tokens, ar.tokens)


def test_relaxed_methods_change_tokens_when_relaxation_is_on():
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    params = SamplingParams(greedy=True, cfg=1.0)
    ar = generate(target, None, spec("ar", params), [0, 1, 2, 3], seed=3)
    relaxed = generate(target, drafter, spec("lantern++", params, lantern_lambda=50.0, lantern_k=3),
                       [0, 1, 2, 3], seed=3, neighbours=neighbours(8))
    assert not torch.equal(relaxed.tokens, ar.tokens)
    assert relaxed.stats["mean_relaxation_mass"] > 0
    assert relaxed.stats["mean_accepted_length"] > generate(
        target, drafter, spec("lantern++", params), [0, 1, 2, 3], seed=3).stats["mean_accepted_length"]


@pytest.mark.parametrize("method", ["cool-sd", "cool-eagle2"])
def test_cool_sd_relaxes_where_w_is_above_one(method):
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    greedy = SamplingParams(greedy=True, cfg=1.0)
    ar = generate(target, None, spec("ar", greedy), [0, 1, 2, 3], seed=3)
    exact = generate(target, drafter, spec(method, greedy), [0, 1, 2, 3], seed=3)
    relaxed = generate(target, drafter, spec(method, greedy, cool_delta=8.0, cool_nu=0.7), [0, 1, 2, 3], seed=3)
    assert not torch.equal(relaxed.tokens, ar.tokens)
    assert relaxed.stats["mean_relaxation_mass"] > 0
    assert relaxed.stats["mean_accepted_length"] > exact.stats["mean_accepted_length"]
