"""The Intel Gaudi (HPU) backend: bf16 by default; HPU graphs in lazy mode, ``hpu_backend`` in eager mode.

``habana_frameworks`` is imported lazily, only when this backend is asked for, because it is
present only inside Intel's Gaudi containers. Its execution mode is fixed by ``PT_HPU_LAZY_MODE``
at its first import in a process (the bridge reads the variable once):

* lazy (``PT_HPU_LAZY_MODE=1``): ops accumulate into a graph that ``htcore.mark_step()`` flushes;
  steps are captured with ``HPUGraph`` and replayed. Needs Habana's torch fork.
* eager (``PT_HPU_LAZY_MODE=0``, the bridge's default from SynapseAI 1.21): op by op; steps are
  compiled with ``torch.compile(backend="hpu_backend")``. HPU graphs are not available.

If the variable is unset when this module first imports ``habana_frameworks``, it is set to
eager (Intel's default and recommended mode from SynapseAI 1.21; lazy mode is a legacy path
Intel no longer develops), so steps are compiled with ``hpu_backend``. Lazy mode with HPU graphs
stays available with ``PT_HPU_LAZY_MODE=1`` or a profile's ``hpu_mode = "lazy"``. On SynapseAI
>= 1.21 a plain ``import torch`` may already have auto-loaded the bridge in eager mode; the
backend then uses the mode that is active
(:attr:`HpuBackend.lazy_mode` says which). Set ``PT_HPU_LAZY_MODE`` in the environment (the
Gaudi container does) to be sure.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import Tensor

from backends.base import Backend, PhaseTimer
from runtime.utils.errors import UserError

LAZY_MODE_ENV = "PT_HPU_LAZY_MODE"
INT64_ENV = "PT_ENABLE_INT64_SUPPORT"
CONTAINER_HINT = "run inside the Gaudi container (docker/Dockerfile.hpu) or use --device cpu"


def bridge_imported() -> bool:
    """Whether ``habana_frameworks.torch`` is already imported (its mode is then fixed)."""
    return "habana_frameworks.torch" in sys.modules


def request_lazy_mode(lazy: bool | None) -> None:
    """Ask for lazy (True) or eager (False) mode before the bridge's first import; None keeps the env.

    Has no effect once the bridge is imported; :class:`HpuBackend` then reports the active mode.
    """
    if lazy is None or bridge_imported():
        return
    os.environ[LAZY_MODE_ENV] = "1" if lazy else "0"


def _import_bridge() -> tuple[ModuleType, ModuleType]:
    """Import ``habana_frameworks.torch`` (lazy mode unless the env says otherwise) and its ``core``."""
    if not bridge_imported():
        os.environ.setdefault(LAZY_MODE_ENV, "0")
        # The counter RNG and the KV-cache indices are int64; without this the bridge narrows
        # int64 to int32 on the device and splitmix64 hashes wrong.
        os.environ.setdefault(INT64_ENV, "1")
    import habana_frameworks.torch as htorch
    import habana_frameworks.torch.core as htcore

    return htorch, htcore


def lazy_mode_hint(lazy_env: str | None, torch_version: str) -> str | None:
    """The fix when lazy mode was asked for on a stock (upstream) PyTorch, which Habana's bridge
    refuses: its fork builds carry `git` in their local version. None where that is not the case."""
    if lazy_env == "1" and "git" not in torch_version:
        return (f"lazy mode ({LAZY_MODE_ENV}=1) needs Intel's fork PyTorch (a pytorch-installer image, "
                f"not pytorch-upstream-installer; torch here is {torch_version}): unset {LAZY_MODE_ENV} "
                "to run eager + torch.compile, or build docker/Dockerfile.hpu with --build-arg GAUDI_FLAVOUR=")
    return None


def _bridge_is_lazy() -> bool:
    from habana_frameworks.torch.utils.internal import is_lazy

    return bool(is_lazy())


def _synapse_version() -> str | None:
    """The SynapseAI release, read from the bridge's distribution (``habana-torch-plugin``)."""
    for dist in ("habana-torch-plugin", "habana_torch_plugin"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class HpuBackend(Backend):
    """One Gaudi card, seen by this process as ``hpu:0`` (pick the card with ``HABANA_VISIBLE_MODULES``).

    Timing uses ``torch.hpu.Event(enable_timing=True)``: recording an event flushes the lazy
    graph (lazy mode) or joins the eager threads (eager mode), so events are valid fences in both.
    Memory figures are the bridge's ``InUse``/``MaxInUse`` allocator counters.
    """

    name: ClassVar[str] = "hpu"
    # Gaudi's recipe cache (PT_HPU_RECIPE_CACHE_CONFIG) is read when the bridge starts, before any
    # configuration is known: set it per container (docker/README.md); nothing is switched here.
    compile_cache_vars: ClassVar[dict[str, str]] = {}
    default_dtype: ClassVar[torch.dtype] = torch.bfloat16
    dist_backend: ClassVar[str] = "hccl"

    def __init__(
        self,
        *,
        dtype: str | torch.dtype | None = None,
        graph_mode: bool = True,
        index: int | None = None,
        lazy_mode: bool | None = None,
    ) -> None:
        request_lazy_mode(lazy_mode)
        super().__init__(dtype=dtype, graph_mode=graph_mode)
        if index not in (None, 0):
            raise UserError(
                f"hpu:{index} is not addressable: each process sees its Gaudi card as hpu:0; "
                "choose the card with HABANA_VISIBLE_MODULES"
            )
        self._htorch, self._htcore = _import_bridge()
        self.lazy_mode: bool = _bridge_is_lazy()
        if lazy_mode is not None and lazy_mode != self.lazy_mode:
            active = "lazy" if self.lazy_mode else "eager"
            warnings.warn(
                f"habana_frameworks was imported in {active} mode before the backend was created; "
                f"running in {active} mode (set {LAZY_MODE_ENV} before starting the process to choose)",
                stacklevel=2,
            )
        self._device = torch.device("hpu", 0)
        self._graphs: list[Any] = []

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if importlib.util.find_spec("habana_frameworks") is None:
            return False, f"habana_frameworks (Intel Gaudi software) is not installed; {CONTAINER_HINT}"
        try:
            htorch, _ = _import_bridge()
        except Exception as err:  # noqa: BLE001 - a broken install surfaces in many exception types
            first_line = (str(err).strip().splitlines() or [""])[0]
            hint = lazy_mode_hint(os.environ.get(LAZY_MODE_ENV), torch.__version__) or CONTAINER_HINT
            return False, f"habana_frameworks failed to import ({type(err).__name__}: {first_line}); {hint}"
        if not htorch.hpu.is_available():
            return False, "habana_frameworks is installed but no Gaudi device is visible; check hl-smi and HABANA_VISIBLE_DEVICES"
        return True, ""

    @property
    def device(self) -> torch.device:
        return self._device

    def info(self) -> dict[str, Any]:
        hpu = self._htorch.hpu
        return {
            **self._common_info(),
            "name": hpu.get_device_name(),
            "count": int(hpu.device_count()),
            "synapseai": _synapse_version(),
            "hpu_mode": "lazy" if self.lazy_mode else "eager",
        }

    def synchronize(self) -> None:
        # In lazy mode the binding issues a step marker first, so pending lazy ops run too.
        self._htorch.hpu.synchronize()

    def mark_step(self) -> None:
        if self.lazy_mode:
            self._htcore.mark_step()

    def timer(self) -> PhaseTimer:
        return PhaseTimer(event_factory=lambda: self._htorch.hpu.Event(enable_timing=True), synchronize=self.synchronize)

    def memory_stats(self) -> dict[str, int]:
        """Bytes in use on the card (``InUse``) and the peak (``MaxInUse``) since the last reset."""
        hpu = self._htorch.hpu
        return {"current_bytes": int(hpu.memory_allocated()), "peak_bytes": int(hpu.max_memory_allocated())}

    def reset_peak_memory(self) -> None:
        self._htorch.hpu.reset_peak_memory_stats()

    def free_memory(self) -> int | None:
        """``Limit - InUse`` of the card's memory pool (``hpu.mem_get_info()[0]``)."""
        return int(self._htorch.hpu.mem_get_info()[0])

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        # The bridge replaces ProfilerActivity with an enum that has HPU; stock torch may lack it.
        activity = torch.profiler.ProfilerActivity
        hpu_activity = getattr(activity, "HPU", None)
        return [activity.CPU] if hpu_activity is None else [activity.CPU, hpu_activity]

    def _capture(self, fn: Callable[..., None], static_args: tuple[Tensor, ...], name: str) -> Callable[[], None]:
        if not self.lazy_mode:
            return self._compile_counted(fn, static_args, name, "hpu_backend")
        # HPU graphs exist only in lazy mode (the bridge imports them behind is_lazy()).
        import habana_frameworks.torch.hpu.graphs as hpu_graphs

        with torch.no_grad():
            self._htcore.mark_step()
            fn(*static_args)  # warm-up: the first lazy execution compiles its recipe outside the capture
            self._htcore.mark_step()
        self.synchronize()
        graph = hpu_graphs.HPUGraph()
        with torch.no_grad(), hpu_graphs.graph(graph):
            fn(*static_args)
        self._graphs.append(graph)
        self.capture_count[name] += 1
        replay: Callable[[], None] = graph.replay
        return replay
