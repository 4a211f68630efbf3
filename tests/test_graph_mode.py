"""Graph mode on CPU (torch.compile, fullgraph): same tokens and statistics as eager, each step
compiled once and replayed on every later iteration and image.

fullgraph=True also proves the invariant of the core: a step with a host sync (.item(),
data-dependent shapes) would break the graph and fail to compile.
"""

import pytest
import torch

from backends import get_backend
from runtime.core import Decoder, MethodSpec, SamplingParams, generate
from runtime.core.proximity import compute_neighbours
from tiny_models import tiny_pair


@pytest.mark.parametrize("method", ["ar", "lantern++"])
def test_graph_equals_eager_and_steps_compile_once(method):
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    nb = compute_neighbours(torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), 3)
    spec = MethodSpec(method=method, sampling=SamplingParams(greedy=True, cfg=2.0), tree="small_12",
                      lantern_lambda=2.0, lantern_k=3)
    eager = generate(target, drafter, spec, [0, 1, 2], seed=1, neighbours=nb)

    backend = get_backend("cpu", graph_mode=True)
    decoder = Decoder(target, drafter, spec, neighbours=nb, backend=backend)
    graph = generate(target, drafter, spec, [0, 1, 2], seed=1, decoder=decoder)
    again = generate(target, drafter, spec, [3, 0], seed=2, decoder=decoder)

    assert torch.equal(graph.tokens, eager.tokens)
    for key in ("mean_accepted_length", "target_forwards", "tokens", "per_depth_acceptance"):
        assert graph.stats[key] == eager.stats[key], key
    assert graph.stats["mean_relaxation_mass"] == pytest.approx(eager.stats["mean_relaxation_mass"], rel=1e-4)
    steps = ["verify", "accept"] + (["draft"] if method != "ar" else [])
    # compiled exactly once each, though replayed for every iteration of five images
    assert dict(backend.capture_count) == {f"{method}.{s}": 1 for s in steps}
    assert again.stats["target_forwards"] > 2 * 2
    assert torch.equal(again.tokens, generate(target, drafter, spec, [3, 0], seed=2, neighbours=nb).tokens)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [dict(coupling="maximal", proactive=(2, 2)), dict(coupling="gumbel", accept="grouped")])
def test_sjd_steps_compile_whole_and_match_eager(variant):
    target, _ = tiny_pair(vocab=8, sharpness=1.0)
    spec = MethodSpec("sjd", sampling=SamplingParams(cfg=2.0), window=5, **variant)
    eager = generate(target, None, spec, [0, 1], seed=1)
    backend = get_backend("cpu", graph_mode=True)
    graph = generate(target, None, spec, [0, 1], seed=1, decoder=Decoder(target, None, spec, backend=backend))
    assert torch.equal(graph.tokens, eager.tokens)
    assert graph.stats["target_forwards"] == eager.stats["target_forwards"]
    assert dict(backend.capture_count) == {f"sjd.{s}": 1 for s in ("draft", "verify", "accept")}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sd", "lantern", "lantern++", "cool-sd"])
def test_sampled_acceptance_compiles_whole_and_matches_eager(method):
    """Sampling paths (sibling stages over all parents, relaxed and exact) compile fullgraph."""
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    nb = compute_neighbours(torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), 3)
    spec = MethodSpec(method=method, sampling=SamplingParams(cfg=2.0), tree="small_12", depth=2,
                      top_k_draft=3, total_tokens=8, lantern_lambda=2.0, lantern_delta=0.2, lantern_k=3)
    eager = generate(target, drafter, spec, [0, 1], seed=4, neighbours=nb)
    backend = get_backend("cpu", graph_mode=True)
    graph = generate(target, drafter, spec, [0, 1], seed=4, neighbours=nb, backend=backend)
    assert torch.equal(graph.tokens, eager.tokens)
    assert graph.stats["target_forwards"] == eager.stats["target_forwards"]
    assert all(v == 1 for v in backend.capture_count.values())


@pytest.mark.parametrize("method", ["eagle2", "lantern", "cool-eagle2"])
def test_dynamic_tree_at_batch_two_compiles_whole_and_matches_eager(method):
    """The EAGLE-2 draft writes its top-k into column slices of per-batch buffers, contiguous only
    at batch 1: at batch 2 the capture must still be one graph (it failed: `out=` non-contiguous)."""
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    nb = compute_neighbours(torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), 3)
    spec = MethodSpec(method=method, sampling=SamplingParams(cfg=2.0), depth=2, top_k_draft=3, total_tokens=8,
                      lantern_delta=0.2, lantern_k=3)
    eager = generate(target, drafter, spec, [0, 1, 2], seed=6, neighbours=nb,
                     decoder=Decoder(target, drafter, spec, neighbours=nb, batch_size=2))
    backend = get_backend("cpu", graph_mode=True)
    graph = generate(target, drafter, spec, [0, 1, 2], seed=6,
                     decoder=Decoder(target, drafter, spec, neighbours=nb, backend=backend, batch_size=2))
    assert torch.equal(graph.tokens, eager.tokens)
    assert all(v == 1 for v in backend.capture_count.values()) and f"{method}.draft.b2" in backend.capture_count


def test_compile_caches_are_keyed_on_every_shape_setting_knob(tmp_path, monkeypatch):
    """With LANTERN_RUNTIME_CACHE set, each configuration's compiled steps land in their own
    folder, named by the decoder's compile_key: another batch size, tree or window is another
    key (another folder); the same configuration is the same key in any process. The compilers'
    variables are restored after capture, and a user's own TORCHINDUCTOR_CACHE_DIR wins."""
    import os

    monkeypatch.setenv("LANTERN_RUNTIME_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    nb = compute_neighbours(torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), 3)
    greedy = SamplingParams(greedy=True, cfg=2.0)
    ar = MethodSpec("ar", sampling=greedy)
    keys = []
    for batch in (1, 2):
        backend = get_backend("cpu", graph_mode=True)
        decoder = Decoder(target, None, ar, backend=backend, batch_size=batch)
        generate(target, None, ar, [0, 1], seed=1, decoder=decoder)
        keys.append(decoder.compile_key)
        assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # restored after the capture
    assert keys[0].startswith("ar-b1-") and keys[1].startswith("ar-b2-") and keys[0][6:] != keys[1][6:]
    for key in keys:
        assert any((tmp_path / "compile" / key / "inductor").rglob("*")), f"nothing compiled into {key}"
    assert Decoder(target, None, ar, batch_size=2).compile_key == keys[1]  # same knobs, same key

    def key(**knobs):
        spec = MethodSpec(knobs.pop("method", "lantern++"), sampling=greedy, lantern_k=3, **knobs)
        return Decoder(target, drafter, spec, neighbours=nb).compile_key

    assert len({key(tree="small_12"), key(tree="chain3"), key(method="sjd", window=5), key(method="sjd", window=6),
                key(tree="chain3", lantern_lambda=3.0)}) == 5

    mine = tmp_path / "mine"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    backend = get_backend("cpu", graph_mode=True)
    with backend.compile_cache("ar-b1-x") as folder:
        assert folder is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)

    # inductor writes its default into the environment when anything compiles outside a compile
    # cache (and child processes inherit it): that value is not a user's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    with backend.compile_cache("ar-b1-x") as folder:
        assert folder == tmp_path / "compile" / "ar-b1-x"
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()  # restored as it was


def test_compiled_steps_are_cached_by_default_and_an_unwritable_default_is_skipped(tmp_path, monkeypatch):
    """Without LANTERN_RUNTIME_CACHE the compile cache is the user's cache folder
    ($XDG_CACHE_HOME/lantern-runtime/compile/<key>), so a second process loads what the first
    compiled; where that folder cannot be made the steps compile as they would without it."""
    import os

    monkeypatch.delenv("LANTERN_RUNTIME_CACHE", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    backend = get_backend("cpu", graph_mode=True)
    with backend.compile_cache("ar-b1-x") as folder:
        assert folder == tmp_path / "lantern-runtime" / "compile" / "ar-b1-x"
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    with backend.compile_cache("ar-b1-x") as folder:
        assert folder is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    with get_backend("cpu", graph_mode=False).compile_cache("ar-b1-x") as folder:
        assert folder is None  # eager: nothing compiles


def test_compiler_logs_are_held_while_a_step_compiles_and_released_unless_replaced():
    """What torch logs during a compile reaches its handlers, in order, once released; a fault
    worded as one line of the runtime's own drops the compiler's account of it."""
    import logging

    from backends.compile_faults import held_compiler_logs

    logger = logging.getLogger("torch._inductor.output_code")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep()
    owner = logging.getLogger("torch._inductor")
    owner.addHandler(keep)
    try:
        with held_compiler_logs() as release:
            logger.error("first")
            logger.error("second")
            assert seen == []
            release()
            logger.error("after release")
        assert seen == ["first", "second", "after release"]
        seen.clear()
        with held_compiler_logs():
            logger.error("replaced by one line")
        logger.error("outside")
        assert seen == ["outside"]
    finally:
        owner.removeHandler(keep)
