"""The CPU backend: fp32 by default, ``torch.compile`` (inductor) as its graph mode."""

from __future__ import annotations

import logging
import os
import platform
import resource
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from backends.base import Backend
from backends.toolchain import cxx_compiler, graph_toolchain_missing

log = logging.getLogger(__name__)


def _read_proc_status_kib(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (e.g. ``VmRSS``, ``VmHWM``), or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


# a model is memory-bound where its weights exceed this many times the last-level cache
MEMORY_BOUND_CACHES = 2
_LLC_FALLBACK = 32 << 20


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 in bytes (Linux sysfs: L3 on most hosts), else 32 MiB."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip().upper()
            best = max(best, int(size.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1))
        except (OSError, ValueError):
            continue
    return best or _LLC_FALLBACK


def _weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# PyTorch's own thread count as this module is first imported, before any backend lowers it:
# one per physical core the process may use
_TORCH_THREADS = max(torch.get_num_threads(), 1)


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class CpuBackend(Backend):
    """Runs everything on the host.

    Graph mode compiles each step with ``torch.compile(fullgraph=True, dynamic=False)`` through
    inductor; a counting wrapper around inductor records every graph dynamo compiles, so
    ``capture_count`` shows recompilations. The phase timer is ``time.perf_counter``.
    """

    name: ClassVar[str] = "cpu"
    default_dtype: ClassVar[torch.dtype] = torch.float32
    dist_backend: ClassVar[str] = "gloo"

    def __init__(self, *, dtype: str | torch.dtype | None = None, graph_mode: bool = True, index: int | None = None) -> None:
        super().__init__(dtype=dtype, graph_mode=graph_mode)
        # One host device; `index` is accepted so every backend takes the same arguments.
        del index
        self._peak_resettable = True
        # A model in the caches decodes in chains of small ops, and waking a second OpenMP thread
        # for each costs more than it saves (the demo's steps ran 25-35x slower with 2 threads
        # than with 1 on the 2-core CI machine); a model larger than the caches is bound by the
        # weights' read rate, which more cores raise (`prepare_inference`: all of them). A
        # user's OMP_NUM_THREADS wins over both.
        self._all_threads = torch.get_num_threads() if "OMP_NUM_THREADS" in os.environ else _TORCH_THREADS
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        missing = graph_toolchain_missing() if graph_mode else None
        if missing is not None:
            # graph mode is the CPU profile's default; a host without the toolchain still decodes
            log.warning("graph mode needs %s to build its kernels, and this host lacks it: steps run eagerly "
                        "(install it for ~2.5x the images/s, or pass --no-graph)", missing)
            self.graph_mode = False

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return True, ""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def info(self) -> dict[str, Any]:
        return {
            **self._common_info(),
            "name": _cpu_model_name(),
            "count": 1,
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
        }

    def synchronize(self) -> None:
        """Nothing to wait for: CPU ops complete before they return."""

    def memory_stats(self) -> dict[str, int]:
        """Resident set size of the whole process, in bytes.

        CPU memory is not attributable to tensors, so both figures are **process-wide**: the
        current RSS (``/proc/self/statm``) and the peak RSS (``VmHWM`` in ``/proc/self/status``,
        which :meth:`reset_peak_memory` restarts). Where ``VmHWM`` cannot be reset or read, the peak
        is ``getrusage(RUSAGE_SELF).ru_maxrss``, the peak since the process started.
        """
        current = self._current_rss_bytes()
        peak_kib = _read_proc_status_kib("VmHWM") if self._peak_resettable else None
        if peak_kib is None:
            max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = max_rss if sys.platform == "darwin" else max_rss * 1024  # bytes on macOS, KiB on Linux
        else:
            peak = peak_kib * 1024
        return {"current_bytes": current, "peak_bytes": max(peak, current)}

    def reset_peak_memory(self) -> None:
        """Restart the peak-RSS window (Linux: writing 5 to /proc/self/clear_refs resets VmHWM)."""
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
                clear_refs.write("5")
        except OSError:
            self._peak_resettable = False

    @staticmethod
    def _current_rss_bytes() -> int:
        try:
            with open("/proc/self/statm", encoding="ascii") as statm:
                resident_pages = int(statm.read().split()[1])
            return resident_pages * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return max_rss if sys.platform == "darwin" else max_rss * 1024

    def prepare_inference(self, module: torch.nn.Module) -> int:
        """Prepack the large linear layers' weights (`backends.cpu_packing`: 2-16-row matmuls
        read them at the 1-row rate); in graph mode the small ones compile their few-row
        matmuls as fused reductions (`backends.cpu_small_linear`)."""
        from backends.cpu_packing import pack_linears
        from backends.cpu_small_linear import reduce_small_linears

        self._fit_threads(module)
        return pack_linears(module) + (reduce_small_linears(module) if self.graph_mode else 0)

    def _fit_threads(self, module: torch.nn.Module) -> None:
        """Decode on every core once a model's weights exceed MEMORY_BOUND_CACHES x the last-level
        cache (each step then streams them from memory); never fewer threads again, and never
        where the user set OMP_NUM_THREADS."""
        if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() >= self._all_threads:
            return
        if self.memory_bound(module):
            log.info("%s: %.2f GB of weights, beyond the caches: decoding on all %d cores",
                     type(module).__name__, _weight_bytes(module) / 1e9, self._all_threads)
            torch.set_num_threads(self._all_threads)

    def memory_bound(self, module: torch.nn.Module) -> bool:
        """Its weights exceed MEMORY_BOUND_CACHES x the last-level cache: a step streams them."""
        return _weight_bytes(module) > MEMORY_BOUND_CACHES * last_level_cache_bytes()

    def cached_attention(self) -> Callable[..., Tensor | None] | None:
        """`backends.cpu_attention.cached_attention` where the CPU kernels build, else None."""
        from backends import cpu_attention
        from backends.cpu_kernels import load

        return cpu_attention.cached_attention if load() is not None else None

    def release_inference(self, module: torch.nn.Module) -> int:
        """Undo `prepare_inference`: packed copies dropped, every layer back in its own class."""
        from backends.cpu_packing import unpack_linears
        from backends.cpu_small_linear import restore_small_linears

        return unpack_linears(module) + restore_small_linears(module)

    def _capture(self, fn: Callable[..., None], static_args: tuple[Tensor, ...], name: str) -> Callable[[], None]:
        replay = self._compile_counted(fn, static_args, name, "inductor")

        def unguarded() -> None:
            # A captured step reads the same buffers, shapes and settings on every call, so
            # dynamo's guard check before each replay (0.2-0.3 ms on the demo's steps, over a
            # hundred parameter and state tensors) decides nothing; only the guards that tell
            # apart steps compiled from one function still run.
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                replay()

        return unguarded
