"""The two relaxation rules: "paper" (the reference LANTERN code) and "bounded".

The paper rule is checked against a direct transcription of the reference's loops
(`evaluate_posterior` for dynamic trees, `evaluate_posterior_v1` for static trees in
jadohu/LANTERN's ea_model_llamagen.py): one node at a time, one sibling at a time, Python
scalars. Given the same uniforms both must take the same path and draw the bonus from the
same residual.
"""

import math

import pytest
import torch

from runtime.core.acceptance import accept_greedy, accept_sampling
from runtime.core.relaxation import Relaxation
from runtime.core.proximity import compute_neighbours
from runtime.core.rng import CounterRNG, race
from runtime.core.sampling import sample_without_replacement
from runtime.core.tree import buffers_from_parents, static_buffers, validate_paths

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast

V = 12
TABLE = compute_neighbours(torch.randn(V, 2, generator=torch.Generator().manual_seed(1)), 4)
K_NEAR = 3  # lantern_k; the paper rule clears k + 1 = 4 codes on a relaxed rejection


def relaxation(kind: str, rule: str = "paper", delta: float = 0.2, lam: float = 3.0) -> Relaxation:
    return Relaxation(kind, delta=delta, lam=lam, neighbours=TABLE[:, :K_NEAR], rule=rule,
                      zero_neighbours=TABLE[:, :K_NEAR + 1])


TREE = static_buffers(validate_paths("t", [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]))


def _children(tree) -> list[list[int]]:
    kids = tree.children.tolist()
    return [[c for c in row if c >= 0] for row in kids]


def _relaxed_px(g: torch.Tensor, x: int, kind: str, delta: float, lam: float) -> tuple[float, bool]:
    """The reference's relaxed p(x) on the current residual g, and whether relaxation was used."""
    px = float(g[x])
    cum = torch.cumsum(g[TABLE[x, :K_NEAR]], 0)
    bound = (lam - 1.0) * px if kind == "lambda" else (delta if px > 0 else 0.0)  # runtime: no budget at p(x) = 0
    inside = (cum <= bound).nonzero()
    if inside.numel() == 0:
        return px, False
    return px + float(cum[inside[-1, 0]]), True


def reference_walk(tokens, p, q, u, kind, delta=0.2, lam=3.0, clear=True):
    """Transcription of the reference sampler, one image: (path, bonus distribution).

    q None: dynamic-tree rule (drafts deterministic, accept with p(x) + c, clear x and its
    k+1 codes); else the static-tree rule (accept with (p(x) + c) / q_s(x), residual
    max(g - q', 0))."""
    kids = _children(TREE)
    node, path = 0, [0]
    while True:
        if not kids[node]:
            return path, p[node]
        g = p[node].clone().double()
        accepted, earlier = None, []
        for c in kids[node]:
            x = int(tokens[c])
            px, used = _relaxed_px(g, x, kind, delta, lam)
            if q is None:
                if float(u[c]) < px:
                    accepted = c
                    break
                g[x] = 0
                if used and clear:
                    g[TABLE[x, :K_NEAR + 1]] = 0
            else:
                qq = q[node].clone().double()
                qq[earlier] = 0
                qq = qq / qq.sum()
                qs = float(qq[x])
                earlier.append(x)
                if qs <= 0:
                    continue
                if float(u[c]) < min(1.0, px / qs):
                    accepted = c
                    break
                if used and clear:
                    qq[TABLE[x, :K_NEAR + 1]] = 0
                g = (g - qq).clamp(min=0)
            if g.sum() == 0:
                return path, p[node]  # the runtime falls back to p (the reference: uniform)
            g = g / g.sum()
        if accepted is None:
            return path, g.float()
        path.append(accepted)
        node = accepted


def _case(seed: int, sampled: bool, b: int = 64):
    g = torch.Generator().manual_seed(seed)
    n1 = TREE.size
    p = torch.softmax(torch.randn(b, n1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(b, n1, V, generator=g) * 1.5, -1)
    rng = CounterRNG("cpu", seed)
    tokens = torch.zeros(b, n1, dtype=torch.long)
    for parent, kids in enumerate(_children(TREE)):
        if not kids:
            continue
        if sampled:
            tokens[:, kids] = sample_without_replacement(q[:, parent], len(kids), rng)
        else:
            tokens[:, kids] = torch.stack([torch.randperm(V, generator=g)[:len(kids)] for _ in range(b)])
    noise = torch.rand(b, n1 + V, generator=g)
    return tokens, p, (q if sampled else None), noise


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("kind", ["delta", "lambda"])
def test_paper_rule_matches_the_reference_loops(sampled, kind):
    for seed in range(3):
        tokens, p, q, noise = _case(seed, sampled)
        relax = relaxation(kind)
        acc = accept_sampling(tokens, p, TREE, CounterRNG("cpu", 0), q=q, relax=relax, uniforms=noise)
        for i in range(tokens.size(0)):
            path, residual = reference_walk(tokens[i], p[i], None if q is None else q[i], noise[i], kind)
            n = int(acc.count[i])
            assert acc.path[i, :n].tolist() == path, (seed, i)
            expected = race(residual[None].float(), noise[i:i + 1, TREE.size:])
            assert int(acc.bonus[i]) == int(expected), (seed, i)


def test_paper_rule_relaxes_more_than_the_bounded_rule_on_the_same_drafts():
    """Same drafts and uniforms: the paper rule gives each sampled draft its full budget, so it
    accepts at least as often on average as the bounded rule (which gains q(x) c_x)."""
    tokens, p, q, noise = _case(5, True, b=4000)
    counts = {}
    for rule in ("paper", "bounded"):
        acc = accept_sampling(tokens, p, TREE, CounterRNG("cpu", 0), q=q, relax=relaxation("lambda", rule, lam=4.0),
                              uniforms=noise)
        counts[rule] = acc.count.float().mean().item()
    assert counts["paper"] > counts["bounded"] + 0.05


def _dynamic_tree(parents: list[int]):
    """A batched (B = 1) tree as EAGLE-2 builds it, from parent pointers (children in node order)."""
    parent = torch.tensor([parents])
    rank = torch.zeros_like(parent)
    for i in range(1, len(parents)):
        rank[0, i] = sum(1 for j in range(1, i) if parents[j] == parents[i])
    return buffers_from_parents(parent, rank, max_depth=3, max_children=3)


def test_greedy_tie_commits_the_reference_row():
    """Two depth-1 nodes pass (one by relaxation); node 1 has a deeper child that fails, node 2
    is a leaf. The reference verifies rows leaf by leaf in node order (leaves 2, 3): row [0, 2]
    reaches length 1 first, so it commits node 2; the lowest-index rule would commit node 1."""
    tree = _dynamic_tree([0, 0, 0, 1])  # root -> 1, 2; 1 -> 3
    n1 = tree.size
    p = torch.full((1, n1, V), 0.01)
    assert 5 not in TABLE[6, :K_NEAR].tolist()
    p[0, 0, 5], p[0, 0, 6] = 0.40, 0.33  # after the root: 5 is the argmax, 6 behind
    p[0, 0, TABLE[6, 0]] = 0.12  # 6's nearest code: within (lambda - 1) p(6), and enough to reach 5
    p = p / p.sum(-1, keepdim=True)
    p[0, 1] = torch.softmax(torch.randn(V), -1)
    tokens = torch.tensor([[0, 5, 6, int(p[0, 1].argmin())]])  # node 3 fails its test
    lam = 1.5
    paper = accept_greedy(tokens, p, tree, relaxation("lambda", "paper", lam=lam))
    bounded = accept_greedy(tokens, p, tree, relaxation("lambda", "bounded", lam=lam))
    assert paper.count.item() == bounded.count.item() == 2
    assert paper.path[0, 1].item() == 2
    assert bounded.path[0, 1].item() == 1


@pytest.mark.parametrize("rule", ["paper", "bounded"])
@pytest.mark.parametrize("sampled", [False, True])
def test_at_lambda_one_and_delta_zero_both_rules_are_the_exact_rule(rule, sampled):
    tokens, p, q, noise = _case(7, sampled, b=256)
    exact = accept_sampling(tokens, p, TREE, CounterRNG("cpu", 0), q=q, uniforms=noise)
    for relax in (relaxation("lambda", rule, lam=1.0), relaxation("delta", rule, delta=0.0)):
        got = accept_sampling(tokens, p, TREE, CounterRNG("cpu", 0), q=q, relax=relax, uniforms=noise)
        assert torch.equal(got.path, exact.path) and torch.equal(got.bonus, exact.bonus)


@pytest.mark.parametrize("sampled", [False, True])
def test_paper_rule_never_returns_a_token_of_probability_zero(sampled):
    tokens, p, q, noise = _case(11, sampled, b=2000)
    p = p.clone()
    p[..., :4] = 0.0  # tokens 0..3 impossible everywhere (e.g. filtered by top-k)
    p = p / p.sum(-1, keepdim=True)
    for kind in ("delta", "lambda"):
        acc = accept_sampling(tokens, p, TREE, CounterRNG("cpu", 0), q=q,
                              relax=relaxation(kind, delta=0.9, lam=50.0), uniforms=noise)
        rows = torch.arange(tokens.size(0))
        for j in range(1, acc.path.size(1)):
            took = j < acc.count
            parent = TREE.parent[acc.path[:, j]]
            prob = p[rows, parent, tokens[rows, acc.path[:, j]]]
            assert (prob[took] > 0).all()
        assert (acc.bonus >= 4).all()


# -- the law of one step (runtime.core.law) ----------------------------------------------------

def _empirical_first_token(siblings: int, relax: Relaxation, sampled: bool, seed: int, b: int = 200_000):
    """Run the rule on b copies of one node with `siblings` children: (empirical law of the
    first output token, p, q, the deterministic drafts)."""
    tree = static_buffers(validate_paths("t", [(i,) for i in range(siblings)]))
    g = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    P, Q = p0.expand(b, tree.size, V), q0.expand(b, tree.size, V)
    rng = CounterRNG("cpu", seed)
    drafts = torch.topk(q0, siblings).indices
    tokens = torch.zeros(b, tree.size, dtype=torch.long)
    tokens[:, 1:] = sample_without_replacement(Q[:, 0], siblings, rng) if sampled else drafts
    res = accept_sampling(tokens, P, tree, rng, q=Q if sampled else None, relax=relax)
    first = torch.where(res.count >= 2, tokens[torch.arange(b), res.path[:, 1]], res.bonus)
    return torch.bincount(first, minlength=V).double() / b, p0, q0, drafts


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("siblings", [1, 3])
@pytest.mark.parametrize("rule", ["paper", "bounded"])
def test_node_law_is_the_law_the_rule_samples(sampled, siblings, rule):
    from runtime.core.law import node_law, nominal_bound, step_tvd

    for kind, relax in (("none", Relaxation()), ("lambda", relaxation("lambda", rule, lam=3.0)),
                        ("delta", relaxation("delta", rule, delta=0.2))):
        emp, p0, q0, drafts = _empirical_first_token(siblings, relax, sampled, seed=3)
        q = q0[None] if sampled else None
        for estimate in (False, True) if sampled else (False,):
            law = node_law(p0[None], drafts[None], relax, q, samples=8192, estimate=estimate)[0]
            assert 0.5 * (law.double() - emp).abs().sum() < 0.012, (kind, rule, estimate)
        tvd = step_tvd(p0[None], drafts[None], relax, q)[0]
        if kind == "none":
            assert tvd < 1e-5
        elif rule == "bounded":
            assert tvd <= nominal_bound(p0[None], drafts[None], relax, q)[0] + 0.005


# -- COOL-SD (annealed acceptance, G* residual) and the TV-optimal residual for LANTERN -----------

def cool(delta: float, nu: float = 0.7, levels: int = TREE.max_depth) -> Relaxation:
    from runtime.core.relaxation import anneal_weights

    return Relaxation("anneal", weights=torch.tensor(anneal_weights(delta, nu, None, levels, 34)))


def cool_walk(tokens, p, q, u, weights):
    """COOL-SD as the paper states it, one image: a child x at depth d is accepted with probability
    min(1, w_d g(x) / q_s(x)) (q_s = q without the earlier siblings; a deterministic draft's q_s(x)
    is 1), and a rejection leaves G* = norm([g - min(q_s, w_d g)]_+). (path, bonus distribution)."""
    kids, depth = _children(TREE), TREE.depth.tolist()
    node, path = 0, [0]
    while True:
        if not kids[node]:
            return path, p[node]
        g = p[node].clone().double()
        accepted, earlier = None, []
        for c in kids[node]:
            x, w = int(tokens[c]), float(weights[depth[c]])
            if q is None:
                qq = torch.zeros(V, dtype=torch.float64)
                qq[x] = 1.0
            else:
                qq = q[node].clone().double()
                qq[earlier] = 0
                qq = qq / qq.sum()
            earlier.append(x)
            if float(u[c]) < min(1.0, w * float(g[x]) / float(qq[x])):
                accepted = c
                break
            g = (g - torch.minimum(qq, w * g)).clamp(min=0)
            g = g / g.sum()
        if accepted is None:
            return path, g.float()
        path.append(accepted)
        node = accepted


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("delta", [0.6, 1.1, 2.0])
def test_cool_sd_matches_the_papers_rule_written_out(sampled, delta):
    relax = cool(delta)
    assert relax.anneal
    for seed in range(3):
        tokens, p, q, noise = _case(seed, sampled)
        acc = accept_sampling(tokens, p, TREE, CounterRNG("cpu", 0), q=q, relax=relax, uniforms=noise)
        for i in range(tokens.size(0)):
            path, residual = cool_walk(tokens[i], p[i], None if q is None else q[i], noise[i], relax.weights)
            n = int(acc.count[i])
            assert acc.path[i, :n].tolist() == path, (seed, i)
            expected = race(residual[None].float(), noise[i:i + 1, TREE.size:])
            assert int(acc.bonus[i]) == int(expected), (seed, i)


def test_cool_sd_weights_anneal_around_delta():
    from runtime.core.relaxation import anneal_weights

    w = anneal_weights(1.1, 0.7, None, 4, 34)
    assert w[0] == 1.0 and all(v == 1.0 for v in w[5:])
    assert w[1] > w[2] > w[3] > w[4] and sum(w[1:5]) / 4 == pytest.approx(1.1)
    assert anneal_weights(1.0, 0.0, None, 4, 34) == [1.0] * 34  # exact
    assert anneal_weights(2.0, 0.7, 0.0, 2, 34)[1:3] == pytest.approx([2 * math.exp(-0.7), 2 * math.exp(-1.4)])
    assert not cool(1.0, 0.0).active and cool(1.0, 0.7).active  # delta 1 still anneals unless nu is 0


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("siblings", [1, 3])
@pytest.mark.parametrize("delta", [0.5, 1.5, 3.0])
def test_cool_sd_node_law_is_sampled_and_keeps_its_bound(sampled, siblings, delta):
    """The watcher's law is what the rule samples; its TV from p is within 1 - 1/w_1 (relaxation.py:
    the output is at most w p pointwise), and 0 where every w <= 1 (G* makes such stages lossless)."""
    from runtime.core.law import node_law, nominal_bound, step_tvd

    relax = cool(delta, nu=0.0)  # w = delta at every depth
    emp, p0, q0, drafts = _empirical_first_token(siblings, relax, sampled, seed=5)
    q = q0[None] if sampled else None
    law = node_law(p0[None], drafts[None], relax, q, samples=8192)[0]
    assert 0.5 * (law.double() - emp).abs().sum() < 0.012
    tvd = float(step_tvd(p0[None], drafts[None], relax, q)[0])
    bound = float(nominal_bound(p0[None], drafts[None], relax, q)[0])
    assert bound == pytest.approx(max(0.0, 1 - 1 / delta))
    assert tvd <= bound + (0.015 if sampled else 1e-6)  # sampled: the estimate's noise (later siblings drawn)
    if delta > 1:
        assert tvd > 1e-3  # relaxed for real


@pytest.mark.parametrize("sampled", [False, True])
def test_cool_sd_never_returns_a_token_of_probability_zero(sampled):
    tokens, p, q, noise = _case(11, sampled, b=2000)
    p = p.clone()
    p[..., :4] = 0.0
    p = p / p.sum(-1, keepdim=True)
    acc = accept_sampling(tokens, p, TREE, CounterRNG("cpu", 0), q=q, relax=cool(8.0), uniforms=noise)
    rows = torch.arange(tokens.size(0))
    for j in range(1, acc.path.size(1)):
        took = j < acc.count
        prob = p[rows, TREE.parent[acc.path[:, j]], tokens[rows, acc.path[:, j]]]
        assert (prob[took] > 0).all()
    assert (acc.bonus >= 4).all()
    greedy = accept_greedy(tokens, p, TREE, cool(8.0))
    for j in range(1, greedy.path.size(1)):
        took = j < greedy.count
        prob = p[rows, TREE.parent[greedy.path[:, j]], tokens[rows, greedy.path[:, j]]]
        assert (prob[took] > 0).all()


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("kind", ["delta", "lambda"])
def test_the_tv_optimal_residual_is_the_paper_rule_without_clearing(sampled, kind):
    """--residual tv-optimal: the same acceptance as the paper rule, and a rejection removes only
    the draft (q_s from the residual, for sampled drafts): the reference loop with its clearing
    taken out, and nearer the target in law at the same drafts."""
    from dataclasses import replace

    from runtime.core.law import step_tvd

    for seed in range(2):
        tokens, p, q, noise = _case(seed, sampled)
        relax = replace(relaxation(kind), residual="tv-optimal")
        acc = accept_sampling(tokens, p, TREE, CounterRNG("cpu", 0), q=q, relax=relax, uniforms=noise)
        for i in range(tokens.size(0)):
            path, residual = reference_walk(tokens[i], p[i], None if q is None else q[i], noise[i], kind,
                                            clear=False)
            n = int(acc.count[i])
            assert acc.path[i, :n].tolist() == path, (seed, i)
            assert int(acc.bonus[i]) == int(race(residual[None].float(), noise[i:i + 1, TREE.size:])), (seed, i)
    if not sampled:
        _, p0, q0, drafts = _empirical_first_token(3, Relaxation(), False, seed=3, b=10)
        rule, optimal = relaxation(kind, lam=3.0), replace(relaxation(kind, lam=3.0), residual="tv-optimal")
        assert step_tvd(p0[None], drafts[None], optimal)[0] <= step_tvd(p0[None], drafts[None], rule)[0] + 1e-6
