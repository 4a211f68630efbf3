"""Device backends: one interface (:class:`Backend`), three implementations, chosen by name.

    backend = get_backend("auto")            # cuda, else hpu, else cpu
    model = backend.to_device(model)         # floating-point weights take backend.dtype
    timer = backend.timer()
    with timer.phase("verify"):
        step()                               # a replay from backend.capture(...)
    timer.summary()                          # {"verify": {"seconds": ..., "count": ...}}

Only this package knows which device it runs on; the decoding core is handed a backend.
"""

from __future__ import annotations

import torch

from backends.base import DTYPES, Backend, PhaseTimer, dtype_name, parse_dtype
from backends.cpu import CpuBackend
from backends.cuda import CudaBackend
from backends.hpu import HpuBackend, request_lazy_mode
from runtime.utils.errors import UserError

BACKENDS: dict[str, type[Backend]] = {"cpu": CpuBackend, "cuda": CudaBackend, "hpu": HpuBackend}
DEVICE_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda", "hpu")
# `auto` prefers the fastest accelerator that is present.
AUTO_ORDER: tuple[str, ...] = ("cuda", "hpu", "cpu")


def resolve_backend_name(name: str) -> str:
    """``"auto"`` -> the first available of cuda, hpu, cpu; a concrete name is returned as is."""
    name = name.lower()
    if name not in DEVICE_CHOICES:
        raise UserError(f"unknown device '{name}' (choose {', '.join(DEVICE_CHOICES)})")
    if name != "auto":
        return name
    for candidate in AUTO_ORDER:
        if BACKENDS[candidate].availability()[0]:
            return candidate
    return "cpu"


def get_backend(
    name: str = "auto",
    *,
    dtype: str | torch.dtype | None = None,
    graph_mode: bool = True,
    index: int | None = None,
    hpu_lazy_mode: bool | None = None,
) -> Backend:
    """The backend for ``name`` (``"cpu" | "cuda" | "hpu" | "auto"``).

    Args:
        dtype: overrides the backend's ``default_dtype`` (bf16 on cuda/hpu, fp32 on cpu).
        graph_mode: capture/compile steps (``--graph``) or run them eagerly (``--no-graph``).
        index: device index (``cuda:index``; e.g. the local rank); None picks the current device.
        hpu_lazy_mode: HPU execution mode if the Gaudi bridge is not imported yet (None: environment,
            else lazy); ignored by the other backends.

    Raises:
        UserError: unknown name, or the backend is unavailable here (one line with the reason
            and the fix, e.g. the container to use).
    """
    # Must precede any availability probe: probing HPU imports the bridge and fixes its mode.
    request_lazy_mode(hpu_lazy_mode)
    resolved = resolve_backend_name(name)
    cls = BACKENDS[resolved]
    available, reason = cls.availability()
    if not available:
        raise UserError(f"{resolved} is not available: {reason}")
    if cls is HpuBackend:
        return HpuBackend(dtype=dtype, graph_mode=graph_mode, index=index, lazy_mode=hpu_lazy_mode)
    return cls(dtype=dtype, graph_mode=graph_mode, index=index)  # type: ignore[call-arg]


__all__ = [
    "BACKENDS",
    "DEVICE_CHOICES",
    "DTYPES",
    "Backend",
    "CpuBackend",
    "CudaBackend",
    "HpuBackend",
    "PhaseTimer",
    "dtype_name",
    "get_backend",
    "parse_dtype",
    "resolve_backend_name",
]
