"""Acceptance on three-token vocabularies, worked out by hand: the literal cases come before the
statistical ones (tests/test_acceptance.py), so a broken rule fails here with numbers a reader
can check on paper.

Every case is one parent (the root) with the target p0 = (0.5, 0.3, 0.2) after it, a chain
of one or two drafts, and fixed uniforms: a node is accepted when its uniform u < its
acceptance probability a; the bonus is drawn from the residual with the remaining uniforms.
"""

from __future__ import annotations

import pytest
import torch

from runtime.core.acceptance import accept_greedy, accept_sampling
from runtime.core.relaxation import Relaxation
from runtime.core.rng import CounterRNG
from runtime.core.tree import static_buffers, validate_paths

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast

P0 = (0.5, 0.3, 0.2)
CHAIN1 = static_buffers(validate_paths("chain1", [(0,)]))
CHAIN2 = static_buffers(validate_paths("chain2", [(0,), (0, 0)]))
# token x's nearest other code first: 0 -> 1, 1 -> 2, 2 -> 1 (k = 1); the paper rule clears
# the k + 1 nearest on a relaxed rejection
ZERO_NB = torch.tensor([[1, 2], [2, 0], [1, 0]])
NB = ZERO_NB[:, :1]


def one(tokens: list[int], *dists: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (1, N+1) with node 0 the root, and p (1, N+1, 3) = the given rows."""
    return torch.tensor([tokens]), torch.tensor([list(dists)], dtype=torch.float32)


def uniforms(u_nodes: list[float], bonus: tuple[float, float, float] = (0.5, 0.5, 0.5)) -> torch.Tensor:
    return torch.tensor([u_nodes + list(bonus)])


def run(tokens, p, tree, u, q=None, relax=Relaxation()):
    res = accept_sampling(tokens, p, tree, CounterRNG("cpu", 0), q=q, relax=relax, uniforms=u)
    return int(res.count), int(res.bonus)


# -- exact speculative sampling, a sampled draft ------------------------------------------
# q0 = (0.2, 0.3, 0.5); draft x = 2 is accepted with min(1, p0(2) / q0(2)) = 0.2 / 0.5 = 0.4;
# on rejection the bonus comes from norm(max(p0 - q0, 0)) = norm(0.3, 0, 0) = token 0.
Q0 = (0.2, 0.3, 0.5)


@pytest.mark.parametrize("u, count, bonus", [(0.39, 2, 1), (0.41, 1, 0), (0.99, 1, 0)])
def test_a_sampled_draft_is_accepted_with_p_over_q_and_the_residual_is_p_minus_q(u, count, bonus):
    tokens, p = one([0, 2], P0, (0.0, 1.0, 0.0))  # after the draft the target is sure of token 1
    q = torch.tensor([[Q0, Q0]])
    assert run(tokens, p, CHAIN1, uniforms([0.0, u]), q=q) == (count, bonus)


def test_a_draft_the_target_prefers_is_always_accepted():
    # x = 0: min(1, 0.5 / 0.2) = 1, so even u = 0.999 accepts
    tokens, p = one([0, 0], P0, (0.0, 0.0, 1.0))
    q = torch.tensor([[Q0, Q0]])
    assert run(tokens, p, CHAIN1, uniforms([0.0, 0.999]), q=q) == (2, 2)


# -- exact, deterministic drafts (top-k / EAGLE-2: q is one-hot at the draft) -------------
# x = 1 is accepted with p0(1) = 0.3; on rejection the residual is p0 without x, (0.5, 0, 0.2)
# normalised: the bonus is never the rejected token.
@pytest.mark.parametrize("u, count", [(0.29, 2), (0.31, 1)])
def test_a_deterministic_draft_is_accepted_with_its_target_probability(u, count):
    tokens, p = one([0, 1], P0, (1.0, 0.0, 0.0))
    got_count, bonus = run(tokens, p, CHAIN1, uniforms([0.0, u]))
    assert got_count == count
    assert bonus == 0 if count == 2 else bonus in (0, 2)


def test_no_rule_returns_a_token_the_target_gives_probability_zero():
    # p0 = (0.7, 0.3, 0): the draft 1 rejected leaves (0.7, 0, 0): the bonus is 0 whatever the noise
    tokens, p = one([0, 1], (0.7, 0.3, 0.0), (1.0, 0.0, 0.0))
    for bonus_u in [(0.001, 0.5, 0.999), (0.999, 0.001, 0.001), (0.5, 0.5, 0.5)]:
        assert run(tokens, p, CHAIN1, uniforms([0.0, 0.9], bonus_u)) == (1, 0)


# -- greedy: the target's argmax -----------------------------------------------------------
def test_greedy_accepts_the_argmax_chain_and_adds_the_next_argmax():
    p = torch.tensor([[P0, (0.1, 0.2, 0.7), (0.6, 0.3, 0.1)]])
    both = accept_greedy(torch.tensor([[0, 0, 2]]), p, CHAIN2)  # 0 = argmax p0, 2 = argmax p1
    assert (int(both.count), int(both.bonus)) == (3, 0)  # bonus = argmax p2
    first = accept_greedy(torch.tensor([[0, 0, 1]]), p, CHAIN2)  # 1 is not argmax p1
    assert (int(first.count), int(first.bonus)) == (2, 2)
    none = accept_greedy(torch.tensor([[0, 1, 2]]), p, CHAIN2)
    assert (int(none.count), int(none.bonus)) == (1, 0)


def test_greedy_lantern_pp_accepts_a_draft_its_neighbour_lifts_to_the_maximum():
    # x = 1 (0.3) with neighbour 2 (0.2): at lambda 2 the budget (lambda - 1) * 0.3 = 0.3 holds
    # 0.2, so r~(1) = 0.5 >= max p0 = 0.5: accepted; at lambda 1.5 (budget 0.15) it is not
    p = torch.tensor([[P0, (1.0, 0.0, 0.0)]])
    tokens = torch.tensor([[0, 1]])
    for rule in ("paper", "bounded"):
        lifted = accept_greedy(tokens, p, CHAIN1, Relaxation("lambda", lam=2.0, neighbours=NB, rule=rule,
                                                             zero_neighbours=ZERO_NB))
        short = accept_greedy(tokens, p, CHAIN1, Relaxation("lambda", lam=1.5, neighbours=NB, rule=rule,
                                                            zero_neighbours=ZERO_NB))
        assert int(lifted.count) == 2 and abs(float(lifted.relax_mass) - 0.2) < 1e-6, rule
        assert int(short.count) == 1 and float(short.relax_mass) == 0.0, rule


# -- LANTERN++'s paper rule on a sampled draft ----------------------------------------------
# q0 = (0.1, 0.6, 0.3), x = 1: exact accepts with 0.3 / 0.6 = 0.5; the paper rule at lambda 2
# lifts p0(1) by its neighbour's 0.2 and accepts with min(1, 0.5 / 0.6) = 0.833.
Q1 = (0.1, 0.6, 0.3)


@pytest.mark.parametrize("u, exact, paper", [(0.49, 2, 2), (0.70, 1, 2), (0.90, 1, 1)])
def test_the_paper_rule_accepts_a_sampled_draft_with_p_plus_c_over_q(u, exact, paper):
    tokens, p = one([0, 1], P0, (1.0, 0.0, 0.0))
    q = torch.tensor([[Q1, Q1]])
    relax = Relaxation("lambda", lam=2.0, neighbours=NB, rule="paper", zero_neighbours=ZERO_NB)
    assert run(tokens, p, CHAIN1, uniforms([0.0, u]), q=q)[0] == exact
    count, bonus = run(tokens, p, CHAIN1, uniforms([0.0, u]), q=q, relax=relax)
    assert count == paper
    if count == 1:
        # rejected: g = norm(max(p0 - q', 0)) with q' = q0 cleared at x's 2 nearest codes
        # (2 and 0) = (0, 0.6, 0): g = norm(0.5, 0, 0.2), never the rejected token
        assert bonus in (0, 2)


def test_at_lambda_one_both_rules_are_the_exact_rule():
    tokens, p = one([0, 1], P0, (1.0, 0.0, 0.0))
    q = torch.tensor([[Q1, Q1]])
    for u in (0.49, 0.51):
        exact = run(tokens, p, CHAIN1, uniforms([0.0, u]), q=q)
        for rule in ("paper", "bounded"):
            relax = Relaxation("lambda", lam=1.0, neighbours=NB, rule=rule, zero_neighbours=ZERO_NB)
            assert run(tokens, p, CHAIN1, uniforms([0.0, u]), q=q, relax=relax) == exact
