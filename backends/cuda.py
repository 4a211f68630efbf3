"""The CUDA backend: bf16 by default, CUDA graphs as its graph mode, CUDA events as its clock."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from backends.base import Backend, PhaseTimer
from runtime.utils.errors import UserError

CONTAINER_HINT = "use --device cpu or the CUDA container (docker/Dockerfile.cuda)"
# LANTERN_CUDA_FUSE=0 captures each step's eager kernels instead of compiling it first: the way
# round an inductor failure that poisons the CUDA context (e.g. a misaligned-address fault, after
# which no fallback in the same process can run).
FUSE_ENV = "LANTERN_CUDA_FUSE"
_log = logging.getLogger(__name__)


def _driver_version() -> str | None:
    """The NVIDIA driver version (NVML if installed, else ``nvidia-smi``); None if neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else str(version)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML is optional; any failure falls through to nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()
    return first[0].strip() if first else None


class CudaBackend(Backend):
    """One NVIDIA GPU (``cuda:index``).

    Graph mode compiles each step with inductor (fused kernels) and captures the compiled step
    as a ``torch.cuda.CUDAGraph`` (falling back to the eager step with one logged warning if
    compilation fails): a few warm-up calls on a
    side stream (lazy initialisations, cuBLAS workspaces and allocator pools happen outside the
    capture), then one capture with ``torch.cuda.graph``; replay is ``graph.replay()``. Random
    ops inside a captured step use the default generator, which PyTorch makes graph-safe (each
    replay advances the Philox offset). A host sync inside the step fails the capture.
    """

    name: ClassVar[str] = "cuda"
    compile_cache_vars: ClassVar[dict[str, str]] = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
    default_dtype: ClassVar[torch.dtype] = torch.bfloat16
    dist_backend: ClassVar[str] = "nccl"
    warmup_calls: ClassVar[int] = 3

    def __init__(self, *, dtype: str | torch.dtype | None = None, graph_mode: bool = True, index: int | None = None,
                 fuse: bool | None = None) -> None:
        super().__init__(dtype=dtype, graph_mode=graph_mode)
        # fuse: compile each step with inductor before capturing it (False: capture eager kernels);
        # default: on unless $LANTERN_CUDA_FUSE is 0
        if fuse is None:
            fuse = os.environ.get(FUSE_ENV, "1").strip() not in ("0", "false", "no")
        self.fuse = fuse
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if index is None else index
        if not 0 <= index < count:
            raise UserError(f"cuda:{index} does not exist ({count} CUDA device(s) visible); pick an index below {count}")
        self._device = torch.device("cuda", index)
        torch.cuda.set_device(self._device)
        # Graphs hold device memory; keep them alive as long as the backend.
        self._graphs: list[torch.cuda.CUDAGraph] = []

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if torch.version.cuda is None:
            return False, f"torch was built without CUDA (torch {torch.__version__}); {CONTAINER_HINT}"
        if not torch.cuda.is_available():
            return False, (
                f"no CUDA device is visible (torch {torch.__version__}, CUDA {torch.version.cuda}); "
                f"check the driver and CUDA_VISIBLE_DEVICES, or {CONTAINER_HINT}"
            )
        return True, ""

    @property
    def device(self) -> torch.device:
        return self._device

    def info(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self._device)
        return {
            **self._common_info(),
            "name": props.name,
            "count": torch.cuda.device_count(),
            "index": self._device.index,
            "cuda": torch.version.cuda,
            "driver": _driver_version(),
            "capability": f"sm_{props.major}{props.minor}",
            "memory_bytes": int(props.total_memory),
        }

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def timer(self) -> PhaseTimer:
        """Events on the current stream; elapsed times are resolved after one sync in ``summary()``."""
        return PhaseTimer(event_factory=lambda: torch.cuda.Event(enable_timing=True), synchronize=self.synchronize)

    def memory_stats(self) -> dict[str, int]:
        """Bytes held by tensors on this GPU (caching-allocator ``allocated`` figures)."""
        return {
            "current_bytes": int(torch.cuda.memory_allocated(self._device)),
            "peak_bytes": int(torch.cuda.max_memory_allocated(self._device)),
        }

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)

    def free_memory(self) -> int | None:
        """Free bytes on the GPU once the caching allocator has returned its unused blocks."""
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(self._device)[0])

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def _capture(self, fn: Callable[..., None], static_args: tuple[Tensor, ...], name: str) -> Callable[[], None]:
        """Compile the step with inductor (fused kernels), then capture the compiled step as a
        CUDA graph (the gpt-fast recipe). If compilation fails, capture the eager step instead
        and say so in one logged line: a graph of unfused kernels is slower, never wrong."""
        if self.fuse:
            try:
                compiled = self._compile_counted(fn, static_args, name, "inductor")
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to eager capture
                first = (str(err).strip().splitlines() or [""])[0]
                _log.warning("cuda: compiling step %s failed (%s: %s); capturing its eager kernels instead",
                             name, type(err).__name__, first[:200])
            else:
                # counted once, by the compiler: a recompile during the graph's warm-up shows as 2
                return self._graph(lambda *_: compiled(), static_args, name, count=False)
        return self._graph(fn, static_args, name)

    def _graph(self, fn: Callable[..., None], static_args: tuple[Tensor, ...], name: str,
               count: bool = True) -> Callable[[], None]:
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(current)
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(self.warmup_calls):
                fn(*static_args)
        current.wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            fn(*static_args)
        self._graphs.append(graph)
        if count:
            self.capture_count[name] += 1
        return graph.replay
