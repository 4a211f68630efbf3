"""The CPU's fp32 row kernel (`backends.cpu_kernels`): F.linear's function at every row count, width
and thread count, its add and bias, built once per host into the cache, and the oneDNN path kept
where it is switched off or cannot be built."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import backends.cpu_kernels as kernels
from backends.cpu_packing import _lookup, pack_linears, unpack_linears

kernel = kernels.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernels do not build here (no C++ compiler)")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(96, 64), (100, 37), (1, 5), (33, 129)])
def test_every_row_count_matches_f_linear(n, k, threads):
    """1-20 rows (chunks of 8 and the 1-7 row tiles), widths not a multiple of the 32-output
    panel, odd K; with an (m, n) add and a bias (one row, broadcast)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n * 1000 + k)
        w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        packed = kernel.pack(w)
        assert packed.numel() == -(-n // kernels.PANEL) * kernels.PANEL * k
        for m in range(1, 21):
            x, add = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
            torch.testing.assert_close(kernel.matmul(x, packed, n), F.linear(x, w), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(kernel.matmul(x, packed, n, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(kernel.matmul(x, packed, n, add), add + F.linear(x, w), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(previous)


def test_leading_dims_and_non_contiguous_inputs():
    w = torch.randn(64, 48)
    packed = kernel.pack(w.t().contiguous().t())  # a transposed view packs as its values
    x = torch.randn(3, 48, 5).transpose(1, 2)  # (3, 5, 48), not contiguous
    out = kernel.matmul(x, packed, 64)
    assert out.shape == (3, 5, 64)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_nan_input_row_stays_in_its_row():
    w = torch.randn(40, 16)
    x = torch.randn(3, 16)
    x[1, 4] = float("nan")
    out = kernel.matmul(x, kernel.pack(w), 40)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


@pytest.mark.skipif(kernel is None or not kernel.bf16, reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("n,k", [(96, 64), (100, 37), (33, 129)])
def test_bf16_matches_an_fp32_product_of_the_bf16_values_rounded_once(n, k):
    """bf16 weights and rows: each output is the fp32 sum of the exact products (bf16 x bf16 is
    exact in fp32), plus the add, rounded to bf16 once; odd K included."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    packed = kernel.pack(w)
    for m in (1, 2, 5, 8, 11):
        x, add = torch.randn(m, k, generator=g).bfloat16(), torch.randn(m, n, generator=g).bfloat16()
        exact = x.double() @ w.double().T
        got = kernel.matmul(x, packed, n, add)
        assert got.dtype == torch.bfloat16
        # within a bf16 rounding of the exact sum (fp32 accumulation adds far less)
        torch.testing.assert_close(got.double(), (exact + add.double()).bfloat16().double(), rtol=2 ** -7, atol=1e-3)
        assert kernel.matmul(x, packed, n).bfloat16().shape == (m, n)


def test_packed_layers_use_it_in_their_dtype():
    fp32 = torch.nn.Linear(512, 768)
    bf16 = torch.nn.Linear(512, 768).to(torch.bfloat16)
    assert pack_linears(fp32) == 1 and pack_linears(bf16) == 1
    assert _lookup(fp32.weight).rows and _lookup(bf16.weight).rows == kernel.bf16
    x = torch.randn(2, 3, 512)
    with torch.no_grad():
        torch.testing.assert_close(fp32(x), F.linear(x, fp32.weight, fp32.bias), rtol=1e-5, atol=1e-5)
        xb = x.bfloat16()
        torch.testing.assert_close(bf16(xb).float(), F.linear(xb, bf16.weight, bf16.bias).float(), rtol=2e-2,
                                   atol=2e-2)
        torch.testing.assert_close(fp32(xb.float()), F.linear(xb.float(), fp32.weight, fp32.bias))
    unpack_linears(fp32)
    unpack_linears(bf16)


def test_built_once_into_the_cache_and_reused(tmp_path):
    """A fresh process builds into `<cache>/kernels/`, the next loads that file; switched off,
    layers pack for oneDNN instead."""
    code = ("import torch, backends.cpu_kernels as r, backends.cpu_packing as p; k = r.load(); "
            "l = torch.nn.Linear(512, 512); p.pack_linears(l); "
            "print(k.path if k else None, p._lookup(l.weight).rows)")
    env = {"LANTERN_RUNTIME_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    first, second = (r.stdout.split() for r in runs)
    assert first == second and first[1] == "True" and first[0].startswith(str(tmp_path / "kernels"))
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, kernels.SWITCH: "0"})
    assert off.returncode == 0 and off.stdout.split() == ["None", "False"], off.stderr


def test_a_cache_it_cannot_load_from_builds_in_a_temporary_folder_else_keeps_pytorch(monkeypatch, tmp_path, caplog):
    """A container's cache volume may be mounted noexec: dlopen refuses the cached library. The
    kernels are built again where they load; where nothing loads, one log line and PyTorch's paths."""
    import ctypes
    import logging

    monkeypatch.setenv("LANTERN_RUNTIME_CACHE", str(tmp_path))
    real = ctypes.CDLL

    def noexec_cache(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise OSError(f"{path}: cannot open shared object file: Permission denied")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(kernels.ctypes, "CDLL", noexec_cache)
    loaded = kernels._build_and_load()
    assert loaded is not None and not str(loaded.path).startswith(str(tmp_path))
    monkeypatch.setattr(kernels.ctypes, "CDLL", lambda *a, **k: (_ for _ in ()).throw(OSError("noexec")))
    with caplog.at_level(logging.INFO, logger="backends.cpu_kernels"):
        assert kernels._build_and_load() is None
    assert any("could not be built or loaded" in r.getMessage() for r in caplog.records)


def test_no_compiler_keeps_onednn(monkeypatch):
    monkeypatch.setattr("backends.toolchain.cxx_compiler", lambda: None)
    assert kernels._build_and_load() is None


def test_threads_rise_to_every_core_only_for_a_model_beyond_the_caches(monkeypatch):
    """A model in the caches decodes on one thread; one whose weights exceed
    MEMORY_BOUND_CACHES x the last-level cache on every core; a user's OMP_NUM_THREADS wins."""
    import backends.cpu as cpu

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu, "_TORCH_THREADS", 3)
    monkeypatch.setattr(cpu, "last_level_cache_bytes", lambda: 64 * 1024)
    backend = cpu.CpuBackend(graph_mode=False)
    assert torch.get_num_threads() == 1
    backend.prepare_inference(torch.nn.Linear(64, 64))  # 16 KiB: in the cache
    assert torch.get_num_threads() == 1
    backend.prepare_inference(torch.nn.Linear(256, 256))  # 256 KiB > 2 x 64 KiB
    assert torch.get_num_threads() == 3
    backend.prepare_inference(torch.nn.Linear(8, 8))  # never fewer again
    assert torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    cpu.CpuBackend(graph_mode=False).prepare_inference(torch.nn.Linear(256, 256))
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("heads,kv_heads,t", [(4, 4, 1), (8, 2, 4), (6, 3, 16)])
def test_cached_attention_matches_sdpa_and_reads_kv_heads_in_place(heads, kv_heads, t):
    """Against SDPA over keys repeated per query head: committed slots, a block's own causal mask,
    slots never written (-inf), a query that sees nothing; bf16 within one rounding."""
    from backends.cpu_attention import MAX_QUERIES, cached_attention

    g = torch.Generator().manual_seed(heads * 10 + t)
    b, s, d = 2, 64, 32
    q = torch.randn(b, t, heads, d, generator=g).transpose(1, 2)  # strided, as the model hands it
    k, v = torch.randn(b, kv_heads, s, d, generator=g), torch.randn(b, kv_heads, s, d, generator=g)
    mask = torch.full((b, 1, t, s), float("-inf"))
    mask[0, :, :, :20] = 0.0
    mask[1, :, :, :33] = 0.0
    mask[:, :, :, 40:40 + t] = torch.where(torch.ones(t, t, dtype=torch.bool).tril(), 0.0, float("-inf"))
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    got = cached_attention(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bf = [x.bfloat16() for x in (q, k, v, mask)]
    got_bf16 = cached_attention(*bf)
    assert got_bf16.dtype == torch.bfloat16
    want_bf16 = F.scaled_dot_product_attention(bf[0].float(), bf[1].float().repeat_interleave(rep, 1),
                                               bf[2].float().repeat_interleave(rep, 1), attn_mask=bf[3].float())
    torch.testing.assert_close(got_bf16.float(), want_bf16, rtol=2 ** -7, atol=1e-2)  # one bf16 rounding
    assert cached_attention(q, k, v, mask.bool()) is None and cached_attention(q.double(), k, v, mask) is None
    many = torch.randn(b, heads, MAX_QUERIES + 1, d)
    assert cached_attention(many, k, v, torch.zeros(b, 1, MAX_QUERIES + 1, s)) is None
    mask[1, :, 0] = float("-inf")  # a query that sees nothing (a padded row): zeros, as SDPA gives
    blind = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    assert (blind[1, :, 0] == 0).all()
    torch.testing.assert_close(kernel.attend(q, k, v, mask), blind, rtol=1e-5, atol=1e-5)


def test_a_decoder_on_the_cpu_backend_attends_through_it_and_keeps_greedy_exactness():
    """A GQA target on the CPU backend: every method's greedy tokens are AR's, with the steps'
    attention in the kernel (SDPA's path never called)."""
    from backends import get_backend
    from runtime.core import MethodSpec, SamplingParams, generate
    from runtime.models.configs import DrafterConfig, GPTConfig
    from runtime.models.drafter import Drafter
    from runtime.models.gpt import Transformer
    import runtime.models.layers as layers

    torch.manual_seed(0)
    cfg = GPTConfig(dim=128, n_layer=2, n_head=4, n_kv_head=2, vocab_size=16, block_size=16, num_classes=4)
    target = Transformer(cfg)
    target.init_weights()
    torch.nn.init.normal_(target.output.weight, std=1.0)
    drafter = Drafter(DrafterConfig.for_target(cfg))
    backend = get_backend("cpu", graph_mode=False)
    params = SamplingParams(greedy=True, cfg=2.0)
    sdpa_calls = []
    real = layers._sdpa
    layers._sdpa = lambda *a: sdpa_calls.append(1) or real(*a)
    try:
        ar = generate(target.eval(), None, MethodSpec(method="ar", sampling=params), [1, 2], seed=3, backend=backend)
        decode_calls = len(sdpa_calls)
        spec = MethodSpec(method="lantern++", sampling=params, tree="chain3", lantern_lambda=1.0, lantern_k=4)
        nb = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i))[:15] for i in range(16)])
        got = generate(target, drafter.eval(), spec, [1, 2], seed=3, backend=backend, neighbours=nb)
    finally:
        layers._sdpa = real
    assert torch.equal(got.tokens, ar.tokens)
    assert decode_calls <= 2 * cfg.n_layer  # the prefill's (no cache mask) at most; every step took the kernel
