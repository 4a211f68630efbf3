"""The CPU backend's packed linear layers (`backends.cpu_packing`): the same function as the
plain layers (up to rounding), in eager and compiled steps, never a stale copy, checkpoints and
layouts untouched, and decoding through them keeps every exactness contract."""

from __future__ import annotations

import pickle

import pytest
import torch

from backends import get_backend
from backends.cpu_packing import MIN_PACKED_ELEMENTS, PackedLinear, available, pack_linears, packed_count, unpack_linears
from runtime.models.configs import DrafterConfig, GPTConfig
from runtime.models.drafter import Drafter
from runtime.models.gpt import Transformer

pytestmark = pytest.mark.skipif(not available()[0], reason=available()[1] or "oneDNN present")


def _wide_pair(vocab: int = 16, seed: int = 0) -> tuple[Transformer, Drafter]:
    """Width 512: every projection is above MIN_PACKED_ELEMENTS (512 x 1536 = 786,432 weights)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(dim=512, n_layer=2, n_head=8, vocab_size=vocab, block_size=16, num_classes=4)
    target = Transformer(cfg)
    target.init_weights()
    torch.nn.init.normal_(target.output.weight, std=1.0)
    drafter = Drafter(DrafterConfig.for_target(cfg))
    drafter.embed_tokens.weight.data.copy_(target.tok_embeddings.weight.data)
    return target.eval(), drafter.eval()


_BLOCK = torch.randn(2, 4, 512, generator=torch.Generator().manual_seed(1))


def _verify(model: Transformer) -> torch.Tensor:
    """Logits (2, 4, V) of a 4-token causal block after 3 committed positions."""
    x, t = _BLOCK.to(model.tok_embeddings.weight.dtype), _BLOCK.size(1)
    cache = model.new_cache(2, 32, "cpu")
    cache.length.fill_(3)
    with torch.no_grad():
        return model.logits(model.forward_cached(x, torch.arange(3, 3 + t), torch.ones(t, t, dtype=torch.bool).tril(),
                                                 cache))


def test_packing_keeps_the_function_the_checkpoint_and_skips_small_layers():
    target, _ = _wide_pair()
    keys = {k: v.clone() for k, v in target.state_dict().items()}
    plain = _verify(target)
    small = torch.nn.Linear(64, 64, bias=False)
    target.extra = small  # 4,096 weights: below MIN_PACKED_ELEMENTS, left as it is
    packed = pack_linears(target)
    assert packed == 2 * 5 == packed_count(target)  # 5 projections a layer; the 16 x 512 head is too small
    assert type(small) is torch.nn.Linear and small.weight.numel() < MIN_PACKED_ELEMENTS
    assert isinstance(target.layers[0].attention.wqkv, PackedLinear)
    del target.extra
    state = target.state_dict()
    assert list(state) == list(keys) and all(torch.equal(state[k], keys[k]) for k in keys)
    torch.testing.assert_close(_verify(target), plain, rtol=1e-5, atol=1e-5)
    assert pack_linears(target) == packed  # idempotent: nothing repacked
    pickle.loads(pickle.dumps(target))
    assert unpack_linears(target) == packed and packed_count(target) == 0
    assert type(target.layers[0].attention.wqkv) is torch.nn.Linear


def test_a_weight_changed_in_place_is_read_as_it_is_never_a_stale_copy():
    target, _ = _wide_pair()
    pack_linears(target)
    before = _verify(target)
    with torch.no_grad():
        target.layers[0].attention.wqkv.weight.mul_(1.5)
    assert packed_count(target) == 9  # that layer reads its changed weight, unpacked
    changed = _verify(target)
    unpack_linears(target)
    torch.testing.assert_close(changed, _verify(target), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, before)
    pack_linears(target)
    assert packed_count(target) == 10


def test_the_drafter_fused_layers_and_residual_matmul_pack():
    _, drafter = _wide_pair()
    mlp = drafter.layers[0].mlp
    x, h = torch.randn(3, 512), torch.randn(3, 512)
    with torch.no_grad():
        plain = mlp(x, residual=h)
        assert pack_linears(drafter) > 0
        assert isinstance(mlp.gate_up, PackedLinear) and type(mlp.gate_up).__name__ == "PackedFusedLinear"
        assert len(mlp.gate_up(x)) == 2  # still the parts
        torch.testing.assert_close(mlp(x, residual=h), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_steps_call_the_packed_matmul(dtype, monkeypatch):
    """A compiled step calls the packed matmul (the custom op, run as an extern kernel) and
    computes what the same step compiled over the plain layers computes."""
    import backends.cpu_packing as packing

    target, _ = _wide_pair()
    target = target.to(dtype)
    out = torch.zeros(2, 4, target.config.vocab_size)

    def step() -> None:
        out.copy_(_verify(target))

    torch.compile(step, fullgraph=True, dynamic=False)()
    plain = out.clone()
    calls = []
    real = packing._linear
    monkeypatch.setattr(packing, "_linear", lambda *a: calls.append(1) or real(*a))
    pack_linears(target)
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, dynamic=False)()
    assert len(calls) == 10  # each packed layer once
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, plain, rtol=tol, atol=tol)


def test_decoding_on_packed_layers_keeps_greedy_exactness():
    """With relaxation off a speculative method reproduces AR's greedy tokens on packed weights
    (the CPU backend packs whatever the decoder is given)."""
    from runtime.core import MethodSpec, SamplingParams, generate

    target, drafter = _wide_pair()
    backend = get_backend("cpu", graph_mode=False)
    params = SamplingParams(greedy=True, cfg=2.0)
    ar = generate(target, None, MethodSpec(method="ar", sampling=params), [1, 2], seed=3, backend=backend)
    assert isinstance(target.layers[0].attention.wqkv, PackedLinear)  # the decoder prepared the target
    g = torch.Generator().manual_seed(1)
    nb = torch.stack([torch.randperm(16, generator=g)[:15] for _ in range(16)])
    for method, kw in (("sd", {"depth": 3}), ("lantern++", {"tree": "small_12", "lantern_lambda": 1.0, "lantern_k": 4})):
        spec = MethodSpec(method=method, sampling=params, **kw)
        got = generate(target, drafter, spec, [1, 2], seed=3, backend=backend, neighbours=nb)
        assert isinstance(drafter.fc, PackedLinear)
        assert torch.equal(got.tokens, ar.tokens), method
        assert got.stats["target_forwards"] < ar.stats["target_forwards"], method  # drafts were accepted
