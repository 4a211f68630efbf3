"""The CPU backend's small linear layers in graph mode (`backends.cpu_small_linear`): a compiled
matmul of at most MAX_ROWS rows is a multiply and a sum (the same function up to rounding), a
wider one and every eager one stay plain; checkpoints and layouts untouched; the decoder's
models get them in graph mode only, and decoding through them keeps greedy exactness."""

from __future__ import annotations

import pickle

import pytest
import torch

from backends import get_backend
from backends.cpu_packing import MIN_PACKED_ELEMENTS
import backends.cpu_small_linear as small
from backends.cpu_small_linear import MAX_ROWS, ReducedLinear, l2_bytes, reduce_small_linears, restore_small_linears
from runtime.core import Decoder, MethodSpec, SamplingParams, generate
from tiny_models import tiny_pair


def _traced_ops(fn, *args) -> set[str]:
    """The torch-level callables in the graph dynamo hands over for fn(*args)."""
    graphs = []

    def keep(gm: torch.fx.GraphModule, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True, dynamic=False)(*args)
    return {getattr(n.target, "__name__", str(n.target)) for gm in graphs for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")}


def test_only_small_layers_swap_and_the_checkpoint_and_class_come_back():
    target, drafter = tiny_pair()
    keys = {k: v.clone() for k, v in target.state_dict().items()}
    big = torch.nn.Linear(512, 512, bias=False)
    target.extra = big  # 262,144 weights: the packing's, not the reduction's
    assert reduce_small_linears(target) == 0  # a few kB of weights: they stay in L2, MKL's kernel wins
    swapped = reduce_small_linears(target, min_bytes=0)
    assert swapped == 5 * target.config.n_layer + 1 and type(big) is torch.nn.Linear
    assert big.weight.numel() >= MIN_PACKED_ELEMENTS
    assert isinstance(target.layers[0].attention.wqkv, ReducedLinear)
    assert reduce_small_linears(target, min_bytes=0) == swapped  # idempotent
    del target.extra
    state = target.state_dict()
    assert list(state) == list(keys) and all(torch.equal(state[k], keys[k]) for k in keys)
    pickle.loads(pickle.dumps(target))
    reduce_small_linears(drafter, min_bytes=0)
    assert type(drafter.layers[0].mlp.gate_up).__name__ == "ReducedFusedLinear"
    assert len(drafter.layers[0].mlp.gate_up(torch.randn(2, drafter.config.hidden_size))) == 2  # still the parts
    assert restore_small_linears(target) == swapped and type(target.layers[0].attention.wqkv) is torch.nn.Linear
    assert restore_small_linears(target) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_matmul_of_few_rows_is_a_sum_and_keeps_the_function(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 24, bias=True).to(dtype)
    plain = torch.nn.Linear(48, 24, bias=True).to(dtype)
    plain.load_state_dict(layer.state_dict())
    reduce_small_linears(layer, min_bytes=0)
    residual = torch.randn(2, 3, 24, dtype=dtype)
    few, many = torch.randn(2, 4, 48, dtype=dtype), torch.randn(2, MAX_ROWS, 48, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        assert "linear" not in _traced_ops(layer, few) and {"mul", "sum"} <= _traced_ops(layer, few)
        assert "linear" in _traced_ops(layer, many)  # 16 rows: the plain matmul
        for x in (few, many):
            compiled = torch.compile(lambda v: layer(v), fullgraph=True, dynamic=False)(x)
            torch.testing.assert_close(compiled, plain(x), rtol=tol, atol=tol)
        assert torch.equal(layer(few), plain(few))  # eager: F.linear itself
        bias_free = torch.nn.Linear(48, 24, bias=False).to(dtype)
        reduce_small_linears(bias_free, min_bytes=0)
        inp = torch.randn(2, 3, 48, dtype=dtype)
        added = torch.compile(lambda r, v: bias_free.add_into(r, v), fullgraph=True, dynamic=False)(residual, inp)
        torch.testing.assert_close(added, residual + torch.nn.functional.linear(inp, bias_free.weight), rtol=tol,
                                   atol=tol)


def test_the_decoder_reduces_in_graph_mode_only_and_keeps_greedy_exactness(monkeypatch):
    monkeypatch.setattr(small, "L2_MULTIPLE", 0)  # the tiny models' weights count as larger than L2
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    params = SamplingParams(greedy=True, cfg=2.0)
    eager = get_backend("cpu", graph_mode=False)
    generate(target, None, MethodSpec(method="ar", sampling=params), [1], seed=3, backend=eager)
    assert type(target.layers[0].attention.wqkv) is torch.nn.Linear  # eager steps: nothing to reduce
    graph = get_backend("cpu", graph_mode=True)
    ar_spec = MethodSpec(method="ar", sampling=params)
    ar = generate(target, None, ar_spec, [1, 2], seed=3, decoder=Decoder(target, None, ar_spec, backend=graph))
    assert isinstance(target.layers[0].attention.wqkv, ReducedLinear)
    nb = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:7] for i in range(8)])
    spec = MethodSpec(method="lantern++", sampling=params, tree="small_12", lantern_lambda=1.0, lantern_k=4)
    got = generate(target, drafter, spec, [1, 2], seed=3, decoder=Decoder(target, drafter, spec, neighbours=nb,
                                                                          backend=graph))
    assert isinstance(drafter.fc, ReducedLinear)
    assert torch.equal(got.tokens, ar.tokens)
    assert got.stats["target_forwards"] < ar.stats["target_forwards"]  # drafts were accepted
    assert graph.release_inference(target) > 0 and type(target.layers[0].attention.wqkv) is torch.nn.Linear


def test_the_l2_size_is_read_or_a_mebibyte():
    size = l2_bytes()
    assert size >= 64 << 10 and size % 1024 == 0
