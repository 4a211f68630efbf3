"""EAGLE-2 tree shape: reference depth semantics, drafter-cache capacity, parents always kept."""

from __future__ import annotations

import pytest
import torch

from runtime.core import Decoder, MethodSpec, SamplingParams, generate
from runtime.core.drafting import STOPPED, below_negative, child_scores
from runtime.utils.errors import UserError
from tiny_models import tiny_pair

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast


def _neighbours(vocab: int) -> torch.Tensor:
    return torch.stack([torch.tensor([j for j in range(vocab) if j != i]) for i in range(vocab)])


@pytest.mark.parametrize("depth", [1, 4])
def test_depth_counts_expansions_after_the_root_as_in_the_reference(depth):
    """Reference EAGLE-2: root top-k, then `depth` expansions -> depth + 1 levels."""
    target, drafter = tiny_pair(vocab=8, grid=4)
    spec = MethodSpec("eagle2", SamplingParams(greedy=True), depth=depth, top_k_draft=3, total_tokens=12)
    dec = Decoder(target, drafter, spec)
    assert dec.policy.tree.max_depth == depth + 1
    assert dec.policy.n_cand == 3 + depth * 9
    dec.prefill(torch.tensor([1]), None, seed=0)
    with torch.no_grad():  # as the loop runs its steps
        dec.draft_step()
    assert int(dec.policy.tree.depth.max()) <= depth + 1


def test_deep_dynamic_tree_fits_the_drafter_cache():
    """depth 10, top-k 10, 60 tokens writes 100 drafter slots per iteration (tree has 60)."""
    target, drafter = tiny_pair(vocab=16, grid=4)
    spec = MethodSpec("eagle2", SamplingParams(greedy=True), depth=10, top_k_draft=10, total_tokens=60)
    ar = generate(target, None, MethodSpec("ar", SamplingParams(greedy=True)), [2], seed=0)
    out = generate(target, drafter, spec, [2], seed=0)
    assert torch.equal(out.tokens, ar.tokens)


def test_total_tokens_limit_follows_reference_candidate_count():
    MethodSpec("eagle2", depth=1, top_k_draft=2, total_tokens=7)  # 2 + 1*4 = 6 candidates + root
    with pytest.raises(UserError, match="exceeds"):
        MethodSpec("eagle2", depth=1, top_k_draft=2, total_tokens=8)


@pytest.mark.parametrize("flush_denormal", [False, True])
def test_child_scores_stay_strictly_below_the_parent_at_any_magnitude(flush_denormal):
    parent = torch.tensor([-0.5, -31.9, -40.0, -1e4, 0.0])
    if not torch.set_flush_denormal(flush_denormal) and flush_denormal:
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        for logq in (torch.zeros(5), torch.full((5,), -1e-7), torch.full((5,), -3.0)):
            child = child_scores(parent, logq)
            assert (child < parent).all()
    finally:
        torch.set_flush_denormal(False)


def test_top_selection_keeps_every_parent_even_with_certain_children():
    """Scores near -40 with children of q = 1: the old 1e-6 tie-break vanished there."""
    parent = torch.full((4,), -40.0)
    child = child_scores(parent, torch.zeros(4))
    scores = torch.cat([parent, child])  # nodes 0..3 parents, 4..7 their children
    parent_of = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3])
    for n in range(1, 8):
        kept = set(torch.topk(scores, n).indices.tolist())
        assert all(parent_of[i] < 0 or int(parent_of[i]) in kept for i in kept)


def test_next_float_below_by_bits_steps_down_for_every_negative_score():
    """EAGLE-2's one-op "next float below" (scores under the root are negative normal floats,
    a stopped ddd image's -1e38): strictly lower, and exactly nextafter toward -inf."""
    scores = torch.tensor([-1.1754944e-38, -1e-7, -0.5, -31.9, -40.0, -1e4, -3e38, STOPPED])
    below = below_negative(scores)
    assert (below < scores).all() and torch.isfinite(below).all()
    assert torch.equal(below, torch.nextafter(scores, torch.tensor(float("-inf"))))
