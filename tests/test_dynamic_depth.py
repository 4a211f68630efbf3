"""Drafts whose depth is decided per iteration: `ddd` (Dynamic Depth Decoding over EAGLE-2's
tree) and `--dynamic-depth` (a static tree cut at the first improbable depth).

Both change only what is drafted, so with relaxation off they reproduce AR greedy token for
token and AR sampling in distribution; their depth must actually vary for that to mean anything.
"""

import re

import pytest
import torch

from backends import get_backend
from runtime.core import Decoder, MethodSpec, SamplingParams, generate
from runtime.utils.errors import UserError
from test_core_exactness import _chi_square_p_value, _exact_sequence_distribution, neighbours
from tiny_models import caption, tiny_pair

DDD = dict(method="ddd", top_k_draft=3, total_tokens=10, ddd_min_depth=1, ddd_check_every=1,
           ddd_max_depth=4, ddd_threshold=-0.7)
DYN = dict(method="lantern++", tree="small_12", lantern_lambda=1.0, dynamic_depth=0.5)
SD_DYN = dict(method="sd", depth=4, dynamic_depth=0.5)
CASES = {"ddd": DDD, "lantern++ dynamic": DYN, "sd dynamic": SD_DYN}


def spec(params: SamplingParams, **kw) -> MethodSpec:
    return MethodSpec(sampling=params, lantern_k=4, **kw)


def _depth_varied(stats: dict, kw: dict) -> bool:
    """The mean drafted depth lies strictly between the shallowest and the deepest draft."""
    low, high = ((kw["ddd_min_depth"] + 1, kw["ddd_max_depth"] + 1) if kw["method"] == "ddd"
                 else (1, 4 if kw["method"] == "sd" else 3))  # small_12 is 3 deep
    return low < stats["mean_drafted_depth"] < high


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_greedy_dynamic_depth_equals_ar_token_for_token(model_type, cfg):
    target, drafter = tiny_pair(model_type=model_type, vocab=8, sharpness=1.0)
    params = SamplingParams(greedy=True, cfg=cfg)
    conds, masks = ([0, 1, 2, 3], None) if model_type == "c2i" else caption(target, n=3)
    ar = generate(target, None, spec(params, method="ar"), conds, cond_masks=masks, seed=3)
    for name, kw in CASES.items():
        out = generate(target, drafter, spec(params, **kw), conds, cond_masks=masks, seed=3, neighbours=neighbours(8))
        assert torch.equal(out.tokens, ar.tokens), name
        assert out.stats["target_forwards"] < ar.stats["target_forwards"], name
        assert _depth_varied(out.stats, kw), (name, out.stats["mean_drafted_depth"])


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_dynamic_depth_matches_ar_distribution(name):
    # the enumerated 2x2-grid, 3-code target of test_core_exactness (81 images)
    target, drafter = tiny_pair(vocab=3, grid=2, sharpness=0.05, seed=4)
    params = SamplingParams(temperature=1.0, cfg=1.5)
    expected = _exact_sequence_distribution(target, 1, params)
    n = 800
    kw = dict(CASES[name])
    if kw["method"] == "ddd":  # three codes: at most three children per node
        kw.update(top_k_draft=2, total_tokens=6, ddd_max_depth=3, ddd_threshold=-1.3)
    else:
        kw["dynamic_depth"] = 0.12
    out = generate(target, drafter, spec(params, **kw), [1] * n, seed=11, neighbours=neighbours(3))
    counts: dict = {}
    for row in out.tokens.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert _chi_square_p_value(counts, expected, n) > 1e-3
    assert out.stats["mean_accepted_length"] > 1.3
    assert _depth_varied(out.stats, kw), out.stats["mean_drafted_depth"]


@pytest.mark.parametrize("greedy", [True, False])
def test_limits_reproduce_the_fixed_depth_methods(greedy):
    """ddd that never stops is EAGLE-2 at its maximum depth, ddd that always stops is EAGLE-2 at
    its minimum depth, and a cut at probability 0 is the uncut static tree: same tokens."""
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    params = SamplingParams(greedy=greedy, cfg=2.0)
    nb = neighbours(8)

    def tokens(**kw):
        return generate(target, drafter, spec(params, **kw), [0, 1, 2], seed=5, neighbours=nb).tokens

    eagle = dict(method="eagle2", top_k_draft=3, total_tokens=10)
    never = dict(DDD, ddd_threshold=-1e9)
    always = dict(DDD, ddd_threshold=0.0, ddd_min_depth=2)
    assert torch.equal(tokens(**never), tokens(**eagle, depth=4))
    assert torch.equal(tokens(**always), tokens(**eagle, depth=2))
    assert torch.equal(tokens(**dict(DYN, dynamic_depth=0.0)), tokens(**dict(DYN, dynamic_depth=None)))


def test_ddd_tokens_do_not_depend_on_the_batch():
    """Each image stops drafting on its own heuristic, whatever its batch-mates do."""
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    s = spec(SamplingParams(cfg=2.0), **DDD)
    one = generate(target, drafter, s, [0, 1, 2, 3, 4], seed=7, batch_size=1)
    three = generate(target, drafter, s, [0, 1, 2, 3, 4], seed=7, batch_size=3)
    assert torch.equal(one.tokens, three.tokens)
    assert one.stats["mean_drafted_depth"] == pytest.approx(three.stats["mean_drafted_depth"])


@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
@pytest.mark.parametrize("kw", [DYN, dict(DYN, lantern_lambda=3.0), SD_DYN], ids=["lantern++", "lantern++ relaxed", "sd"])
def test_dynamic_depth_tokens_do_not_depend_on_the_batch(kw, greedy):
    """--dynamic-depth cuts each image at its own first failed check: an image whose batch-mates
    have the tree verified deeper accepts nothing below its cut, so it makes the tokens it makes
    alone (at B = 1, 3 and 8), and each image's drafted depth is its own."""
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    s = spec(SamplingParams(greedy=greedy, cfg=2.0), **kw)
    conds = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]
    runs = {b: generate(target, drafter, s, conds, seed=7, batch_size=b, neighbours=neighbours(8)) for b in (1, 3, 8)}
    for b in (3, 8):
        assert torch.equal(runs[1].tokens, runs[b].tokens), b
        assert runs[1].stats["mean_drafted_depth"] == pytest.approx(runs[b].stats["mean_drafted_depth"]), b
    assert _depth_varied(runs[1].stats, kw), runs[1].stats["mean_drafted_depth"]


def test_dynamic_depth_greedy_is_exact_in_a_batch():
    """A batch verifies the deepest prefix any of its images wants; greedy stays AR's."""
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    params = SamplingParams(greedy=True, cfg=2.0)
    ar = generate(target, None, spec(params, method="ar"), [0, 1, 2, 3], seed=3)
    out = generate(target, drafter, spec(params, **DYN), [0, 1, 2, 3], seed=3, batch_size=3)
    assert torch.equal(out.tokens, ar.tokens)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddd", "lantern++ dynamic"])
def test_graph_equals_eager_with_one_capture_per_segment_and_prefix(name):
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    s = spec(SamplingParams(cfg=2.0), **CASES[name])
    eager = generate(target, drafter, s, [0, 1], seed=1, neighbours=neighbours(8))
    backend = get_backend("cpu", graph_mode=True)
    decoder = Decoder(target, drafter, s, neighbours=neighbours(8)[:, :4], backend=backend)
    graph = generate(target, drafter, s, [0, 1], seed=1, decoder=decoder)
    assert torch.equal(graph.tokens, eager.tokens)
    assert graph.stats["mean_drafted_depth"] == pytest.approx(eager.stats["mean_drafted_depth"])
    counts = dict(backend.capture_count)
    assert all(v == 1 for v in counts.values())
    method = s.method
    if name == "ddd":  # segments: expansions 1 | 2 | 3 | 4 (checks after 1, 2, 3), then the selection
        assert {f"{method}.draft.{i}" for i in range(4)} | {f"{method}.draft.finish"} <= set(counts)
    else:  # one draft segment per level, one verify and accept per prefix depth
        assert {f"{method}.verify.d{d}" for d in (1, 2, 3)} <= set(counts)


@pytest.mark.parametrize("kw, message", [
    (dict(method="eagle2", dynamic_depth=0.3), "--dynamic-depth cuts a static tree"),
    (dict(method="ddd", ddd_threshold=0.5), "--ddd-threshold must be a finite number <= 0, got 0.5"),
    (dict(method="ddd", ddd_min_depth=5, ddd_max_depth=4), "--ddd-min-depth 5 exceeds --ddd-max-depth 4"),
    (dict(method="ddd", ddd_check_every=0), "--ddd-check-every must be an integer >= 1, got 0"),
    (dict(method="ddd", ddd_min_depth=1, top_k_draft=2, total_tokens=10), "exceeds the 7 nodes"),
    (dict(method="lantern++", dynamic_depth=1.0), "--dynamic-depth must be a finite number in [0, 1), got 1.0"),
])
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(UserError, match=re.escape(message)):
        MethodSpec(**kw)


def test_flags_of_another_method_are_refused(run_cli):
    r = run_cli("run", "--device", "cpu", "--method", "eagle2", "--ddd-threshold", "-1", "--out", "unused")
    assert r.exit_code == 2 and "--ddd-threshold does nothing for --method eagle2" in r.stderr
    r = run_cli("run", "--device", "cpu", "--method", "ddd", "--dynamic-depth", "0.3", "--out", "unused")
    assert r.exit_code == 2 and "--dynamic-depth does nothing for --method ddd" in r.stderr
