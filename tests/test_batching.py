"""Batched decoding: B images per decode give the same tokens as one at a time, for every method.

Image i's random numbers come from its own stream (keyed by its seed), its KV length, path,
bonus and drafter state are its own, a done image hands its slot to the next one and a slot
with nothing left stops advancing; so its tokens (and statistics) must not depend on B, on
its slot, or on the images beside it.
"""

from __future__ import annotations

import pytest
import torch

from backends import get_backend
from runtime.core import Decoder, MethodSpec, SamplingParams, generate
from runtime.core.proximity import compute_neighbours
from runtime.core.rng import CounterRNG
from tiny_models import caption, tiny_pair

# settings small enough for the tiny models; lambda / delta large enough to move mass
METHODS = {
    "ar": {},
    "sd": {"depth": 3},
    "eagle2": {"depth": 2, "top_k_draft": 3, "total_tokens": 8},
    "lantern": {"depth": 2, "top_k_draft": 3, "total_tokens": 8, "lantern_delta": 0.3},
    "lantern++": {"tree": "small_12", "lantern_lambda": 4.0},
    "cool-sd": {"tree": "small_12", "cool_delta": 2.0},
    "cool-eagle2": {"depth": 2, "top_k_draft": 3, "total_tokens": 8, "cool_delta": 2.0},
    "sjd": {"window": 4},
}
# sampling-only sjd options: position-keyed noise (gumbel) with a proactive tree, and maximal coupling
SJD_SAMPLING = {"sjd": {"coupling": "gumbel", "proactive": (2, 1)}, "sjd-maximal": {"coupling": "maximal"}}
CONDITIONS = [0, 1, 2, 3, 1, 0, 3, 2]


def _run(method: str, greedy: bool, batch: int, conditions=CONDITIONS, **extra):
    if method.startswith("sjd") and not greedy:
        extra = {**SJD_SAMPLING[method], **extra}
    method = "sjd" if method.startswith("sjd") else method
    target, drafter = tiny_pair(vocab=8, grid=6, sharpness=1.0)
    nb = compute_neighbours(torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), 3)
    spec = MethodSpec(method=method, sampling=SamplingParams(greedy=greedy, cfg=2.0), lantern_k=3,
                      **METHODS[method], **extra)
    return generate(target, drafter if spec.needs_drafter else None, spec, conditions, seed=5,
                    neighbours=nb, batch_size=batch)


@pytest.mark.parametrize("method,greedy", [(m, g) for m in METHODS for g in (True, False)]
                         + [("sjd-maximal", False)])
def test_tokens_do_not_depend_on_the_batch_size(method, greedy):
    one = _run(method, greedy, 1)
    for b in (3, 8):
        got = _run(method, greedy, b)
        assert torch.equal(got.tokens, one.tokens), f"B={b}"
        for key in ("target_forwards", "tokens", "per_depth_acceptance", "mean_accepted_length"):
            assert got.stats[key] == one.stats[key], (b, key)
        assert got.stats["mean_relaxation_mass"] == pytest.approx(one.stats["mean_relaxation_mass"], rel=1e-5)
    # the images differ from each other: a batch that copied one image into all rows would fail
    assert len({tuple(t.tolist()) for t in one.tokens}) > 2


def test_a_finished_image_is_not_changed_by_the_rest_of_its_batch():
    """Image 0 finishes many iterations before its batch-mates (it accepts long drafts, they
    do not: a different tree depth per image is impossible, so use greedy lantern++ with a
    large lambda on an easy class beside hard ones) and keeps stepping with them."""
    alone = _run("lantern++", True, 1, conditions=[0])
    hard = _run("lantern++", True, 1, conditions=[2, 3, 1])
    batch = _run("lantern++", True, 4, conditions=[0, 2, 3, 1])
    assert torch.equal(batch.tokens[0], alone.tokens[0])
    assert torch.equal(batch.tokens[1:], hard.tokens)
    # the batch ran as long as its slowest image, yet every image's statistics are its own
    assert batch.stats["target_forwards"] == alone.stats["target_forwards"] + hard.stats["target_forwards"]


def test_a_done_image_hands_its_slot_to_the_next_one_at_once():
    """The loop runs exactly as long as a schedule where each image, as it finishes, is
    replaced by the next in workload order (no slot waits for its batch-mates)."""
    target, drafter = tiny_pair(vocab=8, grid=6, sharpness=1.0)
    spec = MethodSpec("sd", sampling=SamplingParams(cfg=2.0), depth=3)
    decoder = Decoder(target, drafter, spec, batch_size=3)
    steps = []
    verify = decoder.verify_at[decoder.policy.tree.max_depth]
    decoder.verify_at[decoder.policy.tree.max_depth] = lambda: (steps.append(1), verify())[1]
    work = [(torch.tensor([c]), None, 100 + j) for j, c in enumerate(CONDITIONS)]
    tokens, stats = decoder.generate_many(work)
    iterations = [s.target_forwards - 1 for s in stats]  # minus the prefill
    free = [0, 0, 0]
    for j, it in enumerate(iterations):
        slot = min(range(3), key=lambda i: (free[i], i)) if j >= 3 else j
        free[slot] += it
    assert len(steps) == max(free)
    assert len(steps) < sum(max(iterations[k:k + 3]) for k in range(0, len(work), 3))  # static batches
    alone = Decoder(target, drafter, spec)
    for j in (0, 5, 7):
        assert torch.equal(tokens[j], alone.generate_one(*work[j])[0])


@pytest.mark.parametrize("n", [2, 5])
def test_a_workload_that_leaves_slots_empty_returns_exactly_its_images(n):
    got = _run("sd", False, 3, conditions=CONDITIONS[:n])
    assert got.tokens.shape[0] == n and len(got.seeds) == n
    assert got.stats["tokens"] == n * 36
    assert torch.equal(got.tokens, _run("sd", False, 1, conditions=CONDITIONS[:n]).tokens)


def test_captions_with_padding_masks_batch_like_single_images():
    target, drafter = tiny_pair(model_type="t2i", vocab=8, grid=4, sharpness=1.0)
    cond, mask = caption(target, n=3, seed=1)
    mask[1, :3] = False  # a different amount of padding per image
    spec = MethodSpec("lantern++", sampling=SamplingParams(cfg=2.0, cfg_interval=3), tree="small_12",
                      lantern_lambda=2.0, lantern_k=3)
    nb = compute_neighbours(torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), 3)
    one = generate(target, drafter, spec, cond, cond_masks=mask, seed=2, neighbours=nb)
    three = generate(target, drafter, spec, cond, cond_masks=mask, seed=2, neighbours=nb, batch_size=3)
    assert torch.equal(one.tokens, three.tokens)


def test_each_stream_draws_what_the_image_draws_alone():
    rng = CounterRNG("cpu", streams=3)
    rng.reset(torch.tensor([7, 8, 9]))
    batch = [rng.uniform(3, 5, 2), rng.uniform(3, 4)]
    for i, seed in enumerate((7, 8, 9)):
        alone = CounterRNG("cpu", seed=seed)
        assert torch.equal(alone.uniform(1, 5, 2)[0], batch[0][i])
        assert torch.equal(alone.uniform(1, 4)[0], batch[1][i])
    with pytest.raises(ValueError, match="leading dim 3"):
        rng.uniform(2, 4)


@pytest.mark.slow
def test_graph_mode_captures_each_step_once_per_batch_size():
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    nb = compute_neighbours(torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), 3)
    spec = MethodSpec("lantern++", sampling=SamplingParams(cfg=2.0), tree="small_12", lantern_lambda=2.0, lantern_k=3)
    eager = generate(target, drafter, spec, [0, 1, 2, 3, 0], seed=1, neighbours=nb)
    backend = get_backend("cpu", graph_mode=True)
    decoder = Decoder(target, drafter, spec, neighbours=nb, backend=backend, batch_size=2)
    graph = generate(target, drafter, spec, [0, 1, 2, 3, 0], seed=1, decoder=decoder)
    assert torch.equal(graph.tokens, eager.tokens)
    assert dict(backend.capture_count) == {f"lantern++.{s}.b2": 1 for s in ("draft", "verify", "accept")}


def test_batch_size_below_one_is_refused():
    from runtime.utils.errors import UserError

    target, _ = tiny_pair()
    with pytest.raises(UserError, match="--batch-size must be >= 1"):
        Decoder(target, None, MethodSpec("ar"), batch_size=0)


def test_out_of_memory_is_one_line_naming_a_batch_size_that_fits():
    from runtime.utils.errors import UserError
    from runtime.generation.pipeline import out_of_memory_as_user_error

    target, drafter = tiny_pair()
    dec = Decoder(target, drafter, MethodSpec("sd", depth=2), batch_size=4)
    per_image = dec.state_bytes() / 4

    class Gpu:
        name = "cuda"

        def free_memory(self):
            return int(10 * 2 * per_image)  # room for 10 images' state, counted twice

    with pytest.raises(UserError) as caught:
        with out_of_memory_as_user_error(dec, Gpu()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    message = str(caught.value)
    assert "batch size 4 does not fit in cuda memory" in message and "--batch-size 10 should fit" in message
    assert "\n" not in message
    # the state grows linearly with the batch
    assert Decoder(target, drafter, MethodSpec("sd", depth=2), batch_size=8).state_bytes() == pytest.approx(
        8 * per_image, rel=0.01)
