"""Acceptance rules: lossless when exact, inside the stated TVD bound when relaxed.

Each test runs the rule on B independent copies of one verification (B large) and compares
the empirical distribution of the first output token with the target. With B = 200k and 12
codes the sampling noise of the TVD estimate is ~0.004; tolerances are 0.012.
"""

import pytest
import torch

from runtime.core.acceptance import accept_greedy, accept_sampling
from runtime.core.relaxation import Relaxation, relaxed_mixture, relaxed_target
from runtime.core.proximity import compute_neighbours
from runtime.core.rng import CounterRNG
from runtime.core.sampling import sample_without_replacement
from runtime.core.tree import load_tree, static_buffers, validate_paths

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast

V, B, NOISE = 12, 200_000, 0.012
NEIGHBOURS = compute_neighbours(torch.randn(V, 2, generator=torch.Generator().manual_seed(0)), 5)


def dist(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g) * scale, -1)


def first_token_tvd(siblings: int, relax: Relaxation, sampled: bool, seed: int):
    """One node with `siblings` children: TVD(first output token, p), plus p, q."""
    tree = static_buffers(validate_paths("t", [(i,) for i in range(siblings)]))
    p0, q0 = dist(seed), dist(seed + 100)
    P, Q = p0.expand(B, tree.size, V), q0.expand(B, tree.size, V)
    rng = CounterRNG("cpu", seed)
    if sampled:
        children = sample_without_replacement(Q[:, 0], siblings, rng)
    else:
        children = torch.topk(q0, siblings).indices[None].expand(B, -1)
    tokens = torch.zeros(B, tree.size, dtype=torch.long)
    tokens[:, 1:] = children
    res = accept_sampling(tokens, P, tree, rng, q=Q if sampled else None, relax=relax)
    first = torch.where(res.count >= 2, tokens[torch.arange(B), res.path[:, 1]], res.bonus)
    emp = torch.bincount(first, minlength=V).float() / B
    return 0.5 * (emp - p0).abs().sum().item(), p0, q0, children[0]


@pytest.mark.parametrize("seed", range(4))
def test_relaxed_target_moves_exactly_c_within_the_bound(seed):
    r = dist(seed, 2.0)[None].repeat(V, 1)
    x = torch.arange(V)
    for relax, bound in [(Relaxation("delta", rule="bounded", delta=0.1, neighbours=NEIGHBOURS), torch.full((V,), 0.1)),
                         (Relaxation("lambda", rule="bounded", lam=3.0, neighbours=NEIGHBOURS), 2.0 * r[0])]:
        r_t, c = relaxed_target(r, x, relax)
        torch.testing.assert_close(r_t.sum(-1), torch.ones(V))
        torch.testing.assert_close(0.5 * (r_t - r).abs().sum(-1), c)
        assert (c <= bound + 1e-7).all()
        torch.testing.assert_close(r_t[x, x], r[x, x] + c)
        assert (r_t >= 0).all()


def test_mixture_of_a_one_hot_proposal_is_the_per_draft_target():
    r = dist(3, 2.0)[None].repeat(V, 1)
    x = torch.arange(V)
    relax = Relaxation("lambda", rule="bounded", lam=4.0, neighbours=NEIGHBOURS)
    m, tvd = relaxed_mixture(r, torch.eye(V), relax)
    r_t, c = relaxed_target(r, x, relax)
    torch.testing.assert_close(m, r_t)
    torch.testing.assert_close(tvd, c)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("siblings", [1, 3])
def test_exact_acceptance_is_lossless(sampled, siblings):
    for seed in range(2):
        tvd, *_ = first_token_tvd(siblings, Relaxation(), sampled, seed)
        assert tvd < NOISE


def test_exact_acceptance_is_lossless_over_two_tree_levels():
    # the target after a node depends on the node's token through a fixed table, so the
    # output pair (y1, y2) must follow p0(y1) * table[y1](y2)
    tree = static_buffers(load_tree("small_12"))
    p0, q0 = dist(7), dist(8)
    table = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(9)), -1)
    qtable = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(10)), -1)
    rng = CounterRNG("cpu", 5)
    tokens = torch.zeros(B, tree.size, dtype=torch.long)
    for i in range(1, tree.size):  # sample each node's children from its proposal
        par = int(tree.parent[i])
        qp = q0.expand(B, V) if par == 0 else qtable[tokens[:, par]]
        if int(tree.rank[i]) == 0:
            draws = sample_without_replacement(qp, tree.max_children, rng)
            kids = tree.children[par]
            for r_, node in enumerate(kids.tolist()):
                if node >= 0:
                    tokens[:, node] = draws[:, r_]
    P = table[tokens]
    P[:, 0] = p0
    Q = qtable[tokens]
    Q[:, 0] = q0
    res = accept_sampling(tokens, P, tree, rng, q=Q)
    rows = torch.arange(B)
    y1 = torch.where(res.count >= 2, tokens[rows, res.path[:, 1]], res.bonus)
    y2 = torch.where(res.count >= 3, tokens[rows, res.path[:, 2]], res.bonus)
    joint = torch.zeros(V, V)
    joint.index_put_((y1[res.count >= 2], y2[res.count >= 2]), torch.ones(int((res.count >= 2).sum())),
                     accumulate=True)
    # pairs are only observed when the first token came from a draft; condition on y1 instead
    for a in range(V):
        n_a = joint[a].sum()
        if n_a > 20_000:
            emp = joint[a] / n_a
            assert 0.5 * (emp - table[a]).abs().sum() < 0.02
    assert (res.count >= 3).float().mean() > 0.1  # depth-2 acceptance was exercised


@pytest.mark.parametrize("sampled", [False, True])
def test_lantern_additive_bound_holds_and_is_active(sampled):
    worst = 0.0
    for seed in range(3):
        relax = Relaxation("delta", rule="bounded", delta=0.1, neighbours=NEIGHBOURS)
        tvd, *_ = first_token_tvd(3, relax, sampled, seed)
        assert tvd <= 0.1 + NOISE
        worst = max(worst, tvd)
    assert worst > 0.03  # the relaxation really changed the output


@pytest.mark.parametrize("sampled", [False, True])
def test_lantern_pp_multiplicative_bound_holds_and_is_active(sampled):
    lam, worst = 2.0, 0.0
    for seed in range(3):
        tvd, p0, q0, children = first_token_tvd(1, Relaxation("lambda", rule="bounded", lam=lam, neighbours=NEIGHBOURS),
                                                sampled, seed)
        # one stage: TVD <= (lambda-1) p(x) for a fixed draft, (lambda-1) E_q[p(x)] when sampled
        bound = (lam - 1) * ((q0 * p0).sum() if sampled else p0[children[0]])
        assert tvd <= bound + NOISE
        worst = max(worst, tvd)
    assert worst > 0.015


def test_greedy_exact_follows_argmax_and_relaxed_accepts_near_ties():
    tree = static_buffers(validate_paths("chain", [(0,), (0, 0)]))
    p = torch.tensor([[0.40, 0.35, 0.25] + [0.0] * (V - 3)]).repeat(3, 1)[None]
    tokens = torch.tensor([[0, 1, 0]])  # draft 1 (not the argmax 0) then 0
    exact = accept_greedy(tokens, p, tree)
    assert int(exact.count) == 1 and int(exact.bonus) == 0
    nb = torch.arange(V).roll(-1)[:, None].repeat(1, 3)  # neighbour of 1 is 2
    nb[1, 0] = 2
    relaxed = accept_greedy(tokens, p, tree, Relaxation("lambda", rule="bounded", lam=2.0, neighbours=nb))
    # 0.35 + 0.25 (neighbour 2; 0.25 <= (2-1)*0.35) >= 0.40: accepted, then 0 is the argmax
    assert int(relaxed.count) == 3 and relaxed.path[0].tolist() == [0, 1, 2]
    assert float(relaxed.relax_mass) == pytest.approx(0.25)


def test_a_sibling_draft_is_never_moved_onto_another():
    # x1 = 1 is x0 = 0's nearest neighbour and fits its lambda bound; the siblings' proximity
    # sets are disjoint, so x1 keeps its own mass: x0 takes 2 and 3 (not 1), x1 takes only 4
    # (2 and 3 are already in x0's list)
    nb = (torch.arange(V)[:, None] + torch.arange(1, 4)[None]) % V  # neighbours of i: i+1, i+2, i+3
    p0 = torch.tensor([0.3, 0.25] + [0.45 / (V - 2)] * (V - 2))
    tree = static_buffers(validate_paths("t", [(0,), (1,)]))
    P = p0.expand(B, tree.size, V)
    tokens = torch.tensor([0, 0, 1]).expand(B, -1)
    res = accept_sampling(tokens, P, tree, CounterRNG("cpu", 3), relax=Relaxation("lambda", rule="bounded", lam=2.0, neighbours=nb))
    first = torch.where(res.count >= 2, tokens[torch.arange(B), res.path[:, 1]], res.bonus)
    emp = torch.bincount(first, minlength=V).float() / B
    other = 0.45 / (V - 2)
    assert abs(float(emp[0]) - (0.3 + 2 * other)) < NOISE
    assert abs(float(emp[1]) - (0.25 + other)) < NOISE


@pytest.mark.parametrize("kind", ["lambda", "delta"])
def test_sampled_siblings_output_exactly_the_relaxed_mixture(kind):
    # a relaxed parent's target is relaxed once, for its first proposal; its sampled children
    # are then judged exactly, so the first output token follows the mixture M itself
    relax = Relaxation(kind, rule="bounded", delta=0.1, lam=3.0, neighbours=NEIGHBOURS)
    for seed in range(2):
        tvd_to_p, p0, q0, _ = first_token_tvd(3, relax, True, seed)
        mix, shift = relaxed_mixture(p0[None], q0[None], relax)
        tree = static_buffers(validate_paths("t", [(i,) for i in range(3)]))
        rng = CounterRNG("cpu", seed)
        children = sample_without_replacement(q0.expand(B, V), 3, rng)
        tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), children], 1)
        res = accept_sampling(tokens, p0.expand(B, tree.size, V), tree, rng, q=q0.expand(B, tree.size, V),
                              relax=relax)
        first = torch.where(res.count >= 2, tokens[torch.arange(B), res.path[:, 1]], res.bonus)
        emp = torch.bincount(first, minlength=V).float() / B
        assert 0.5 * (emp - mix[0]).abs().sum() < NOISE
        assert tvd_to_p <= float(shift) + NOISE
