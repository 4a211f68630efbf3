"""The CPU's fp32 row kernel (`backends.cpu_rowgemm`): F.linear's function at every row count, width
and thread count, its add and bias, built once per host into the cache, and the oneDNN path kept
where it is switched off or cannot be built."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import backends.cpu_rowgemm as rowgemm
from backends.cpu_packing import _lookup, pack_linears, unpack_linears

kernel = rowgemm.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="the row kernel does not build here (no C++ compiler)")


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
        assert packed.numel() == -(-n // rowgemm.PANEL) * rowgemm.PANEL * k
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


def test_packed_fp32_layers_use_it_and_bf16_keeps_onednn():
    fp32 = torch.nn.Linear(512, 768)
    bf16 = torch.nn.Linear(512, 768).to(torch.bfloat16)
    assert pack_linears(fp32) == 1 and pack_linears(bf16) == 1
    assert _lookup(fp32.weight).rows and not _lookup(bf16.weight).rows
    x = torch.randn(2, 3, 512)
    with torch.no_grad():
        torch.testing.assert_close(fp32(x), F.linear(x, fp32.weight, fp32.bias), rtol=1e-5, atol=1e-5)
    unpack_linears(fp32)
    unpack_linears(bf16)


def test_built_once_into_the_cache_and_reused(tmp_path):
    """A fresh process builds into `<cache>/kernels/`, the next loads that file; switched off,
    layers pack for oneDNN instead."""
    code = ("import torch, backends.cpu_rowgemm as r, backends.cpu_packing as p; k = r.load(); "
            "l = torch.nn.Linear(512, 512); p.pack_linears(l); "
            "print(k.path if k else None, p._lookup(l.weight).rows)")
    env = {"LANTERN_RUNTIME_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    first, second = (r.stdout.split() for r in runs)
    assert first == second and first[1] == "True" and first[0].startswith(str(tmp_path / "kernels"))
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, rowgemm.SWITCH: "0"})
    assert off.returncode == 0 and off.stdout.split() == ["None", "False"], off.stderr


def test_no_compiler_keeps_onednn(monkeypatch):
    monkeypatch.setattr("backends.cpu.cxx_compiler", lambda: None)
    assert rowgemm._build_and_load() is None


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
