"""The CPU's own kernels: few-row matmuls at the rate weights stream from memory, and attention of
a few queries over the static KV cache. C++ (`kernels/*.cpp`), built once per host at first use.

Why the matmul: a decoding step multiplies 1-16 rows (an AR step with guidance: 2; a 4-token
verify: 8) by every weight of the model, so on a model larger than the caches it is bound by how
fast the weights arrive. The BLAS kernels are not built for that: on the LlamaGen-XL shape's
matrices (2 threads, AMD EPYC, 36 GB/s read) MKL's GEMM read them at 7-15 GB/s and oneDNN's
packed one at 24-33 GB/s, dropping to 26 at 8 rows (its 64-output blocks do not keep 8 rows'
accumulators in registers). `kernels/rowgemm.cpp` keeps 8 rows x 32 outputs in registers and
reads each weight once, as one sequential stream per 32-output panel: 36 GB/s at 1 to 8 rows,
ahead of both up to 116 rows (docs/results.md). Where the CPU has AVX512-BF16 it runs bf16
weights too (pairs of products per instruction: twice fp32's multiply-adds at half the bytes).

Why the attention: PyTorch's CPU kernels read every slot of the cache, open or masked, and copy a
grouped-query model's keys once per query head; `kernels/attention.cpp` reads only the slots a
query sees, each KV head in place (`backends.cpu_attention`).

How: the sources are compiled once per host with its C++ compiler and `-march=native` (under a
second) into `<cache>/kernels/<key>/`, keyed by the sources, the compiler and the CPU, and loaded
with ctypes (which releases the GIL for a call). Their OpenMP threads are PyTorch's own (the same
libgomp runtime, already loaded), as many as `torch.get_num_threads()`. Where they cannot be
built (no compiler, a failed build), `load()` says why once (at info level) and returns None, and the callers keep
PyTorch's paths (oneDNN's packed matmul, SDPA). `LANTERN_CPU_KERNELS=0` turns them off (to
compare against them).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("kernels") / name for name in ("rowgemm.cpp", "attention.cpp"))
PANEL = 32  # outputs per packed panel (NB in the source)
SWITCH = "LANTERN_CPU_KERNELS"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


@dataclass(frozen=True)
class Kernel:
    """The loaded library: `pack` and `matmul` call into it. `bf16`: whether it was built with
    the bf16 path (the host's CPU has AVX512-BF16); fp32 is always there."""

    lib: ctypes.CDLL
    path: Path
    bf16: bool

    def packs(self, dtype: torch.dtype) -> bool:
        """Whether weights of `dtype` run here."""
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.bf16)

    def pack(self, weight: Tensor) -> Tensor:
        """W (N, K) -> its panels, flat: fp32 (ceil(N / 32) * K * 32,); bf16 with K in pairs
        (ceil(N / 32) * ceil(K / 2) * 64,). Rows past N and the pad past K are zero."""
        w = weight.detach().contiguous()
        n, k = w.shape
        if w.dtype == torch.bfloat16:
            out = torch.empty(-(-n // PANEL) * -(-k // 2) * 2 * PANEL, dtype=torch.bfloat16)
            self.lib.rowgemm_pack_bf16(w.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
            return out
        out = torch.empty(-(-n // PANEL) * k * PANEL, dtype=torch.float32)
        self.lib.rowgemm_pack(w.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
        return out

    def matmul(self, x: Tensor, packed: Tensor, n: int, add: Tensor | None = None) -> Tensor:
        """x (..., K) @ W^T + add -> (..., N) in W's dtype (x's must be the same); `add` (..., N)
        or a bias (N,). bf16 accumulates in fp32 and rounds once."""
        lead, k = x.shape[:-1], x.size(-1)
        flat = x.reshape(-1, k).contiguous()
        m = flat.size(0)
        out = torch.empty(m, n, dtype=packed.dtype)
        add_ptr, lda = None, 0
        if add is not None:
            add = add.to(packed.dtype).contiguous()
            add_ptr, lda = add.data_ptr(), (0 if add.dim() == 1 else n)
        call = self.lib.rowgemm_bf16 if packed.dtype == torch.bfloat16 else self.lib.rowgemm
        call(flat.data_ptr(), packed.data_ptr(), out.data_ptr(), add_ptr, lda, m, n, k, torch.get_num_threads())
        return out.view(*lead, n)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """softmax(q k^T / sqrt(D) + mask) v over a cache, fp32 or bf16 (all four alike; computed
        in fp32): q (B, H, T, D) (any strides with a contiguous last dim), k, v (B, KV, S, D) with
        H a multiple of KV, mask (B or 1, 1, T, S) additive. Returns (B, H, T, D) in q's dtype."""
        b, h, t, d = q.shape
        kv, slots = k.size(1), k.size(2)
        if q.stride(-1) != 1:
            q = q.contiguous()
        k, v = k.contiguous(), v.contiguous()
        mask = mask.expand(b, 1, t, slots).reshape(b, t, slots).contiguous()
        out = torch.empty(b, h, t, d, dtype=q.dtype)
        call = self.lib.cached_attention_bf16 if q.dtype == torch.bfloat16 else self.lib.cached_attention
        call(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(),
                                  mask.data_ptr(), out.data_ptr(), b, h, kv, t, slots, d, d ** -0.5,
                                  torch.get_num_threads())
        return out


_LOCK = threading.Lock()
_LOADED: list[Kernel | None] = []  # [] until load() first runs


def enabled() -> bool:
    """Whether the kernel may be used (`LANTERN_CPU_ROWGEMM` is not 0)."""
    return os.environ.get(SWITCH, "1").strip() not in ("0", "false", "off", "no")


def load() -> Kernel | None:
    """The kernel, built on first use; None where it is switched off or cannot be built (the
    reason logged once)."""
    if not enabled():
        return None
    if _LOADED:
        return _LOADED[0]
    with _LOCK:
        if not _LOADED:
            _LOADED.append(_build_and_load())
        return _LOADED[0]


def _build_and_load() -> Kernel | None:
    from backends import toolchain

    compiler = toolchain.cxx_compiler()
    if compiler is None:
        log.info("the CPU kernels need a C++ compiler (g++ or clang++); steps use PyTorch's")
        return None
    try:
        path = _built(compiler)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a cache on a noexec mount (a container's volume): build where it loads
            path = _built(compiler, Path(tempfile.mkdtemp(prefix="lantern-cpu-kernels-")))
            lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        # info, not a warning: the steps run on PyTorch's paths all the same, and where the
        # toolchain is broken graph mode's own one-line refusal names the fix
        log.info("the CPU kernels could not be built or loaded (%s); steps use PyTorch's", err)
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.rowgemm_pack.argtypes = [p, p, i64, i64, i32]
    lib.rowgemm_pack.restype = None
    for name in ("rowgemm", "rowgemm_bf16"):
        getattr(lib, name).argtypes = [p, p, p, p, i64, i64, i64, i64, i32]
        getattr(lib, name).restype = None
    lib.rowgemm_pack_bf16.argtypes = [p, p, i64, i64, i32]
    lib.rowgemm_pack_bf16.restype = None
    lib.rowgemm_has_bf16.restype = ctypes.c_int
    for name in ("cached_attention", "cached_attention_bf16"):
        getattr(lib, name).argtypes = [p, i64, i64, i64, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, i32]
        getattr(lib, name).restype = None
    return Kernel(lib, path, bool(lib.rowgemm_has_bf16()))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _built(compiler: str, folder: Path | None = None) -> Path:
    """The library's path, compiled now unless a build of the same sources, compiler and CPU is
    cached (in `folder`, default the runtime cache's). An unwritable cache builds into a
    temporary folder."""
    from runtime.utils.cache_dirs import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([*(f.read_bytes() for f in SOURCES), compiler.encode(), version.encode(),
                                     platform.machine().encode(), _cpu_flags().encode(),
                                     torch.__version__.encode()])).hexdigest()[:16]
    folder = cache_root() / "kernels" / f"cpu-{key}" if folder is None else folder
    target = folder / "lantern_cpu.so"
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="lantern-cpu-kernels-"))
        target = folder / "lantern_cpu.so"
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        os.unlink(tmp)
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise RuntimeError(f"{compiler} {' '.join(FLAGS)}: {last}")
    os.replace(tmp, target)  # atomic: a process building beside this one reads a whole file
    return target
