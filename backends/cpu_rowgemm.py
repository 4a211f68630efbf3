"""The CPU's fp32 matmul of a few rows by a large weight, at the rate the weights stream from memory.

Why: a decoding step multiplies 1-16 rows (an AR step with guidance: 2; a 4-token verify: 8) by
every weight of the model, so on a model larger than the caches it is bound by how fast the
weights arrive. The BLAS kernels are not built for that: on the LlamaGen-XL shape's matrices
(2 threads, AMD EPYC, 36 GB/s read) MKL's GEMM read them at 7-15 GB/s and oneDNN's packed one at
24-33 GB/s, dropping to 26 at 8 rows (its 64-output blocks do not keep 8 rows' accumulators in
registers). `kernels/rowgemm.cpp` keeps 8 rows x 32 outputs in registers and reads each weight
once, as one sequential stream per 32-output panel: 36 GB/s at 1 to 8 rows, ahead of both up
to 116 rows (`results/cpu_speed/`, docs/results.md).

How: the C++ source is compiled once per host with its C++ compiler and `-march=native`
(0.3 s) into `<cache>/kernels/<key>/`, keyed by the source, the compiler and the CPU, and
loaded with ctypes (which releases the GIL for the call). Its OpenMP threads are PyTorch's own
(the same libgomp runtime, already loaded), as many as `torch.get_num_threads()`. Where it
cannot be built (no compiler, a failed build), `load()` says why once and returns None, and the
caller keeps oneDNN's path. `LANTERN_CPU_ROWGEMM=0` turns it off (to compare against it).
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

SOURCE = Path(__file__).with_name("kernels") / "rowgemm.cpp"
PANEL = 32  # outputs per packed panel (NB in the source)
SWITCH = "LANTERN_CPU_ROWGEMM"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


@dataclass(frozen=True)
class Kernel:
    """The loaded library: `pack` and `matmul` call into it."""

    lib: ctypes.CDLL
    path: Path

    def pack(self, weight: Tensor) -> Tensor:
        """W (N, K) fp32 -> its panels (ceil(N / 32) * K * 32,), rows past N zero."""
        w = weight.detach().contiguous()
        n, k = w.shape
        out = torch.empty(-(-n // PANEL) * k * PANEL, dtype=torch.float32)
        self.lib.rowgemm_pack(w.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
        return out

    def matmul(self, x: Tensor, packed: Tensor, n: int, add: Tensor | None = None) -> Tensor:
        """x (..., K) @ W^T + add -> (..., N) fp32; `add` (..., N) or a bias (N,)."""
        lead, k = x.shape[:-1], x.size(-1)
        flat = x.reshape(-1, k).contiguous()
        m = flat.size(0)
        out = torch.empty(m, n, dtype=torch.float32)
        add_ptr, lda = None, 0
        if add is not None:
            add = add.contiguous()
            add_ptr, lda = add.data_ptr(), (0 if add.dim() == 1 else n)
        self.lib.rowgemm(flat.data_ptr(), packed.data_ptr(), out.data_ptr(), add_ptr, lda, m, n, k,
                         torch.get_num_threads())
        return out.view(*lead, n)


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
    from backends.cpu import cxx_compiler

    compiler = cxx_compiler()
    if compiler is None:
        log.info("the fp32 row kernel needs a C++ compiler (g++ or clang++); few-row matmuls use oneDNN's")
        return None
    try:
        path = _built(compiler)
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        log.warning("the fp32 row kernel could not be built (%s); few-row matmuls use oneDNN's", err)
        return None
    lib = ctypes.CDLL(str(path))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.rowgemm_pack.argtypes = [p, p, i64, i64, i32]
    lib.rowgemm_pack.restype = None
    lib.rowgemm.argtypes = [p, p, p, p, i64, i64, i64, i64, i32]
    lib.rowgemm.restype = None
    return Kernel(lib, path)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _built(compiler: str) -> Path:
    """The library's path, compiled now unless a build of the same source, compiler and CPU is
    cached. An unwritable cache builds into a temporary folder."""
    from runtime.utils.cache_dirs import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), version.encode(), platform.machine().encode(),
                                     _cpu_flags().encode(), torch.__version__.encode()])).hexdigest()[:16]
    folder = cache_root() / "kernels" / f"rowgemm-{key}"
    target = folder / "rowgemm.so"
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="lantern-rowgemm-"))
        target = folder / "rowgemm.so"
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        os.unlink(tmp)
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise RuntimeError(f"{compiler} {' '.join(FLAGS)}: {last}")
    os.replace(tmp, target)  # atomic: a process building beside this one reads a whole file
    return target
