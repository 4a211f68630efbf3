"""Training-free drafting (sjd): lossless against AR, grouped acceptance within its bound, and
the flags that do nothing refused."""

from __future__ import annotations

import pytest
import torch

from runtime.core import MethodSpec, SamplingParams, generate
from runtime.core.acceptance import GroupRule, accept_grouped
from runtime.core.jacobi import proactive_tree
from runtime.core.rng import CounterRNG
from runtime.core.tree import chain_tree, static_buffers
from runtime.utils.errors import UserError
from test_core_exactness import _chi_square_p_value, _exact_sequence_distribution, neighbours
from tiny_models import caption, tiny_pair


def sjd(params: SamplingParams, **kw) -> MethodSpec:
    return MethodSpec("sjd", sampling=params, **{"window": 4, **kw})


@pytest.mark.parametrize("model_type,cfg", [("c2i", 1.0), ("c2i", 3.0), ("t2i", 3.0)])
def test_greedy_sjd_equals_ar_token_for_token(model_type, cfg):
    target, _ = tiny_pair(model_type=model_type, vocab=8, sharpness=1.0)
    params = SamplingParams(greedy=True, cfg=cfg)
    conds, masks = ([0, 1, 2, 3], None) if model_type == "c2i" else caption(target, n=3)
    ar = generate(target, None, MethodSpec("ar", sampling=params), conds, cond_masks=masks, seed=3)
    for init in ("uniform", "repeat-h", "repeat-v"):
        for window in (3, 8):
            out = generate(target, None, sjd(params, init=init, window=window), conds, cond_masks=masks, seed=3)
            assert torch.equal(out.tokens, ar.tokens), (init, window)
            assert out.stats["target_forwards"] < ar.stats["target_forwards"], (init, window)


VARIANTS = [
    dict(init="uniform", coupling="none"),
    dict(init="repeat-v", coupling="maximal"),
    dict(init="repeat-h", coupling="gumbel"),
    dict(init="uniform", coupling="maximal", proactive=(2, 1)),
    dict(init="repeat-v", coupling="gumbel", proactive=(2, 2)),
    dict(init="repeat-h", coupling="none", proactive=(3, 1)),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(str(x) for x in v.values()))
def test_sampling_sjd_matches_ar_distribution(variant):
    # 2x2 grid, 3 codes: 81 possible images, enumerated exactly (see test_core_exactness for
    # the power of this test); window 3 covers the image, so the second iteration redrafts a
    # stale tail whenever the first rejected early.
    target, _ = tiny_pair(vocab=3, grid=2, sharpness=0.05, seed=4)
    params = SamplingParams(temperature=1.0, cfg=1.5)
    expected = _exact_sequence_distribution(target, 1, params)
    n = 800
    out = generate(target, None, sjd(params, window=3, **variant), [1] * n, seed=11)
    counts: dict = {}
    for row in out.tokens.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert _chi_square_p_value(counts, expected, n) > 1e-3
    assert out.stats["mean_accepted_length"] > 1.3  # drafts were accepted


def test_proactive_tree_is_a_k_ary_tree_then_a_chain():
    tree = proactive_tree(3, 2, 6)
    assert tree.widths == [3, 9, 1, 1, 1, 1]
    assert (0, 0, 0, 0, 0, 0) in tree.paths and (2, 2) in tree.paths
    with pytest.raises(UserError, match="below --window"):
        MethodSpec("sjd", proactive=(2, 4), window=4)


def _synthetic_stage(v: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = torch.softmax(torch.randn(v, generator=g) * 1.5, 0)
    q = torch.softmax(torch.randn(v, generator=g) * 1.5, 0)
    emb = torch.nn.functional.normalize(torch.randn(v, 4, generator=g), dim=-1)
    return r, q, GroupRule(window=3, gap=0.2, dist=2.0, embed=emb)


def test_grouped_acceptance_stays_within_its_bound_and_is_active():
    """One judged draft x ~ q at a target r: the committed token's law is within the bound."""
    r, q, rule = _synthetic_stage()
    b, v = 200_000, r.numel()
    rng = CounterRNG("cpu", 5)
    x = torch.argmax(torch.log(q) + rng.gumbel(b, v), -1)
    tokens = torch.stack([torch.zeros(b, dtype=torch.long), x], 1)
    p = torch.stack([r, torch.full((v,), 1.0 / v)])[None].expand(b, 2, v)
    qq = torch.stack([q, torch.zeros(v)])[None].expand(b, 2, v)
    acc = accept_grouped(tokens, p, qq, static_buffers(chain_tree(1)), rng, rule)
    out = torch.where(acc.count == 2, x, acc.bonus)
    emp = torch.bincount(out, minlength=v).float() / b
    tvd = 0.5 * (emp - r).abs().sum().item()
    bound = rule.bound(r[None], q[None]).item()
    noise = 3 * (v / b) ** 0.5  # sampling error of an empirical TVD over v cells
    assert tvd <= bound + noise
    assert tvd > 2 * noise  # the rule moves the output away from r
    # the per-run figure sums the bound of every committed judged position
    assert acc.relax_mass.mean().item() == pytest.approx(bound, rel=1e-5)


def test_grouped_equals_exact_when_clusters_are_singletons():
    r, q, rule = _synthetic_stage()
    single = GroupRule(window=3, gap=1e-9, dist=2.0, embed=rule.embed)
    assert single.bound(r[None], q[None]).item() == pytest.approx(0.0, abs=1e-6)


def test_grouped_and_relaxed_sjd_run_on_a_model_and_report_their_bound():
    target, _ = tiny_pair(vocab=8, sharpness=1.0)
    params = SamplingParams(cfg=2.0)
    exact = generate(target, None, sjd(params), [0, 1, 2, 3], seed=3)
    grouped = generate(target, None, sjd(params, accept="grouped", group_dist=4.0, group_gap=0.5),
                       [0, 1, 2, 3], seed=3)
    assert grouped.stats["mean_relaxation_mass"] > 0
    assert not torch.equal(grouped.tokens, exact.tokens)
    relaxed = generate(target, None, sjd(SamplingParams(greedy=True), relax="lambda", lantern_lambda=50.0,
                                         lantern_k=3), [0, 1, 2, 3], seed=3, neighbours=neighbours(8))
    ar = generate(target, None, MethodSpec("ar", sampling=SamplingParams(greedy=True)), [0, 1, 2, 3], seed=3)
    assert relaxed.stats["mean_relaxation_mass"] > 0
    assert not torch.equal(relaxed.tokens, ar.tokens)


@pytest.mark.parametrize("kw,match", [
    (dict(greedy=True, coupling="maximal"), "does nothing with --greedy"),
    (dict(greedy=True, proactive=(2, 1)), "only sampling"),
    (dict(greedy=True, accept="grouped"), "sampling rule"),
    (dict(accept="grouped", relax="lambda", lantern_lambda=4.0), "two relaxations"),
    (dict(accept="grouped", proactive=(2, 1)), "one draft per position"),
    (dict(init="diagonal"), "--init must be one of"),
])
def test_sjd_refuses_settings_that_do_nothing(kw, match):
    greedy = kw.pop("greedy", False)
    with pytest.raises(UserError, match=match):
        MethodSpec("sjd", sampling=SamplingParams(greedy=greedy), **kw)


def test_sjd_options_are_refused_for_other_methods():
    with pytest.raises(UserError, match="sjd only"):
        MethodSpec("lantern++", coupling="maximal")


def test_cli_refuses_flags_no_method_reads(run_cli):
    res = run_cli("run", "--device", "cpu", "--method", "ar", "--window", "8", "--out", "unused")
    assert res.exit_code != 0 and "--window does nothing for --method ar" in res.stderr
    res = run_cli("run", "--device", "cpu", "--method", "sjd", "--group-gap", "0.2", "--out", "unused")
    assert res.exit_code != 0 and "without --accept grouped" in res.stderr
    res = run_cli("run", "--device", "cpu", "--method", "sjd", "--proactive", "three", "--out", "unused")
    assert res.exit_code != 0 and "expected K,D" in res.stderr


def test_grouped_near_table_equals_the_per_step_embedding_test():
    target, _ = tiny_pair(vocab=16)
    rule = GroupRule.for_target(target, window=3, gap=0.5, dist=1.5)
    assert rule.near is not None
    per_step = GroupRule(rule.window, rule.gap, rule.dist, rule.embed)
    g = torch.Generator().manual_seed(2)
    r = torch.softmax(torch.randn(5, 16, generator=g), -1)
    x = torch.randint(0, 16, (5, 4), generator=g)
    members, inside = rule.cluster(r, x)
    members2, inside2 = per_step.cluster(r, x)
    assert torch.equal(members, members2) and torch.equal(inside, inside2)
    assert inside.sum() > x.numel()  # some clusters hold more than their draft


def test_bench_method_entries_carry_their_own_options():
    from runtime.bench.runner import plan_runs
    from runtime.generation.settings import parse_proactive

    plan = plan_runs(["ar", "sjd:coupling=maximal:proactive=4x1", "sjd:window=8"], [])
    assert [(p.method, p.overrides) for p in plan] == [
        ("ar", {}), ("sjd", {"coupling": "maximal", "proactive": "4x1"}), ("sjd", {"window": 8})]
    assert parse_proactive("4x1") == (4, 1) == parse_proactive("4,1") and parse_proactive("off") is None
    for bad, match in (("sjd:window=eight", "window must be an integer"), ("sjd:colour=red", "KEY one of"),
                       ("jacobi", "unknown method")):
        with pytest.raises(UserError, match=match):
            plan_runs([bad], [])
