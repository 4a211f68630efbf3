"""Greedy acceptance with the target's head run only where it reads it (`Decoder(lazy_head=True)`):
exact, along the accepted path (`accept_greedy_path`); relaxed on a static tree, at the nodes with
children and the accepted leaf. The same result as the head over every verified node, for every
tree kind, batch size, eager and captured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime.core import Decoder, MethodSpec, SamplingParams, generate
from runtime.core.acceptance import accept_greedy, accept_greedy_path
from runtime.core.state import LAZY_HEAD_MIN_MACS, lazy_head_mode
from runtime.core.tree import load_tree, static_buffers
from tiny_models import caption, tiny_pair

EXACT = dict(tree="small_12", depth=3, top_k_draft=3, total_tokens=10, lantern_k=4,
             lantern_delta=0.0, lantern_lambda=1.0)
CASES = {
    "sd small_12": dict(method="sd"),
    "eagle2": dict(method="eagle2"),
    "lantern delta 0": dict(method="lantern"),
    "lantern++ lambda 1": dict(method="lantern++"),
    "sd chain4 --dynamic-depth": dict(method="sd", tree="chain4", dynamic_depth=0.05),
    "ddd": dict(method="ddd", ddd_max_depth=4, ddd_min_depth=1, ddd_check_every=1, ddd_threshold=-2.0),
}
RELAXED = {
    "lantern delta 0.8": dict(method="lantern", lantern_delta=0.8),
    "lantern delta 0.8 bounded": dict(method="lantern", lantern_delta=0.8, relax_rule="bounded"),
    "lantern++ lambda 3": dict(method="lantern++", lantern_lambda=3.0),
    "lantern++ lambda 3 bounded": dict(method="lantern++", lantern_lambda=3.0, relax_rule="bounded"),
    "lantern++ chain4 lambda 6 --dynamic-depth": dict(method="lantern++", tree="chain4", lantern_lambda=6.0,
                                                      dynamic_depth=0.05),
}


def _spec(case: str, cfg: float) -> MethodSpec:
    kw = {**EXACT, **CASES.get(case, RELAXED.get(case, {}))}
    return MethodSpec(sampling=SamplingParams(greedy=True, cfg=cfg), **kw)


def _neighbours(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.stack([torch.randperm(vocab, generator=g)[: vocab - 1] for _ in range(vocab)])


@pytest.mark.parametrize("case", list(CASES) + list(RELAXED))
@pytest.mark.parametrize("model_type, cfg, batch", [("c2i", 3.0, 1), ("c2i", 1.0, 3), ("t2i", 3.0, 2)])
def test_the_lazy_head_gives_the_tokens_of_the_head_on_every_node(case, model_type, cfg, batch):
    target, drafter = tiny_pair(model_type=model_type, vocab=8, sharpness=1.0)
    conds, masks = ([0, 1, 2, 3], None) if model_type == "c2i" else caption(target, n=3)
    spec, nb = _spec(case, cfg), _neighbours(8)
    runs = {}
    for lazy in (False, True):
        dec = Decoder(target, drafter, spec, neighbours=nb, batch_size=batch, lazy_head=lazy)
        assert dec.lazy_head == ((("parents" if case in RELAXED else "path")) if lazy else None)
        assert dec.config.lean_head is lazy  # False: the accelerators' form, the draft's included
        runs[lazy] = generate(target, drafter, spec, conds, cond_masks=masks, seed=3, decoder=dec)
    assert torch.equal(runs[True].tokens, runs[False].tokens)
    for key in ("target_forwards", "mean_accepted_length", "mean_relaxation_mass"):
        assert runs[True].stats[key] == pytest.approx(runs[False].stats[key], rel=1e-5), key
    ar = generate(target, None, MethodSpec("ar", SamplingParams(greedy=True, cfg=cfg)), conds, cond_masks=masks, seed=3)
    assert runs[True].stats["target_forwards"] < ar.stats["target_forwards"]  # drafts were accepted
    if case in RELAXED:
        assert runs[True].stats["mean_relaxation_mass"] > 0  # the relaxation acted
    else:
        assert torch.equal(runs[True].tokens, ar.tokens)


@pytest.mark.parametrize("case, method", [("eagle2", "eagle2"), ("lantern++ lambda 3", "lantern++"),
                                          ("lantern delta 0.8", "lantern")])
def test_the_lazy_head_is_captured_once_and_replays_the_eager_tokens(case, method):
    from backends import get_backend

    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    spec, nb = _spec(case, 2.0), _neighbours(8)
    eager = generate(target, drafter, spec, [0, 1, 2], seed=1,
                     decoder=Decoder(target, drafter, spec, neighbours=nb, lazy_head=True))
    backend = get_backend("cpu", graph_mode=True)
    decoder = Decoder(target, drafter, spec, neighbours=nb, backend=backend, lazy_head=True)
    graph = generate(target, drafter, spec, [0, 1, 2], seed=1, decoder=decoder)
    assert torch.equal(graph.tokens, eager.tokens)
    assert dict(backend.capture_count) == {f"{method}.draft": 1, f"{method}.verify": 1, f"{method}.accept": 1}


def test_sampling_and_pjd_keep_the_head_on_every_node():
    target, drafter = tiny_pair(vocab=8)
    nb = _neighbours(8)
    sampled = MethodSpec("eagle2", SamplingParams(greedy=False), depth=3, top_k_draft=3, total_tokens=10)
    pjd = MethodSpec("pjd", SamplingParams(greedy=True))  # its policy reads p
    for spec in (sampled, pjd):
        assert Decoder(target, drafter, spec, neighbours=nb, lazy_head=True).lazy_head is None, spec.method


def test_nan_logits_on_the_path_stop_decoding():
    from runtime.core.slots import NonFiniteError

    target, drafter = tiny_pair(vocab=8, grid=4)
    calls = {"n": 0}
    plain = target.logits

    def logits(hidden):  # NaN from the 4th call of the head on (the prefill's is the 1st)
        calls["n"] += 1
        out = plain(hidden)
        return out * float("nan") if calls["n"] >= 4 else out

    target.logits = logits
    for case in ("eagle2", "lantern++ lambda 3", "lantern delta 0.8"):
        calls["n"] = 0
        decoder = Decoder(target, drafter, _spec(case, 1.0), neighbours=_neighbours(8), lazy_head=True)
        assert decoder.lazy_head is not None
        with pytest.raises(NonFiniteError, match=r"the target model produced NaN or infinite logits for image 0"):
            decoder.generate_one(torch.tensor([1]), seed=0)


@pytest.mark.parametrize("tree_name", ["small_12", "naive_extend_57", "chain4"])
def test_the_walk_equals_the_full_greedy_rule_on_random_targets(tree_name):
    tree = static_buffers(load_tree(tree_name))
    g = torch.Generator().manual_seed(0)
    b, v = 64, 16
    p = torch.softmax(torch.randn(b, tree.size, v, generator=g) * 3, -1)
    # siblings hold distinct tokens (a random order of the vocabulary per parent, its child of
    # rank r taking the r-th); the argmax comes first 70 % of the time, so deep paths occur
    score = torch.rand(b, tree.size, v, generator=g)
    score += torch.nn.functional.one_hot(p.argmax(-1), v) * (torch.rand(b, tree.size, 1, generator=g) < 0.7)
    order = score.argsort(-1, descending=True)  # (B, N+1, V)
    tokens = order[torch.arange(b)[:, None], tree.parent[None], tree.rank[None]]  # (B, N+1)
    full = accept_greedy(tokens, p, tree)
    walk = accept_greedy_path(tokens, tree, lambda node, d: p[torch.arange(b), node].argmax(-1))
    assert torch.equal(walk.count, full.count) and torch.equal(walk.bonus, full.bonus)
    assert torch.equal(walk.path, full.path)
    assert int(full.count.max()) > 2


def test_the_default_runs_the_head_lazily_only_where_it_saves_enough_on_the_cpu():
    tree = static_buffers(load_tree("naive_extend_57"))

    def config(vocab: int, dim: int, device: str = "cpu", greedy: bool = True) -> SimpleNamespace:
        return SimpleNamespace(rows=2, vocab=vocab, target=SimpleNamespace(config=SimpleNamespace(dim=dim)),
                               lean_head=device == "cpu", params=SamplingParams(greedy=greedy))

    # exact: D + 1 = 6 of 58 rows kept; relaxed: 25 nodes with children and the leaf
    assert 2 * (tree.size - 26) * 16384 * 128 >= LAZY_HEAD_MIN_MACS
    policy = SimpleNamespace(reads_p=False, most_parents=25)
    reads_p = SimpleNamespace(reads_p=True, most_parents=25)
    for relaxed, mode in ((False, "path"), (True, "parents")):
        assert lazy_head_mode(None, config(16384, 128), tree, relaxed, policy) == mode  # a small model's head
        assert lazy_head_mode(None, config(512, 128), tree, relaxed, policy) is None  # the demo's: too little
        assert lazy_head_mode(None, config(16384, 1280, "meta"), tree, relaxed, policy) is None  # weight reads cost
        assert lazy_head_mode(True, config(512, 128), tree, relaxed, policy) == mode
        assert lazy_head_mode(False, config(16384, 128), tree, relaxed, policy) is None
        assert lazy_head_mode(True, config(16384, 128, greedy=False), tree, relaxed, policy) is None
        assert lazy_head_mode(True, config(16384, 128), tree, relaxed, reads_p) is None  # the policy reads p


def test_a_one_step_static_draft_forwards_the_spans_of_nodes_with_children():
    from runtime.core.static_tree import _forwarded_nodes

    tree = static_buffers(load_tree("naive_extend_57"))
    levels = [tree.level(d) for d in range(1, tree.max_depth + 1)]
    parent = tree.parent.tolist()
    fwd = _forwarded_nodes(levels, parent, torch.device("cpu"))
    # levels 1-4 hold 5, 13, 16 and 14 nodes, of which 5, 7, 7 and 5 have children
    assert [f.width for f in fwd] == [5, 8, 8, 8]
    assert [f.heads is None for f in fwd] == [True, False, False, False]
    assert [len(f.heads[1]) for f in fwd[1:]] == [7, 7, 5]
    kids = set(parent[1:])
    for f, (a, b) in zip(fwd, levels):
        span = range(f.nodes.start, f.nodes.stop)
        assert set(range(a, b)) & kids <= set(span) and span.start >= a and span.stop <= b
        if f.heads is not None:
            assert f.heads[1].tolist() == [i for i in span if i in kids]
            assert (f.heads[1] - f.nodes.start).tolist() == f.heads[0].tolist()
    chain = static_buffers(load_tree("chain4"))
    fwd = _forwarded_nodes([chain.level(d) for d in range(1, 5)], chain.parent.tolist(), torch.device("cpu"))
    assert [(f.width, f.heads, f.parents) for f in fwd] == [(1, None, (0, 1))] * 3
