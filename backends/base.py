"""The backend interface: everything that differs between CPU, CUDA and Gaudi (HPU) lives here.

The decoding core is handed a :class:`Backend` and never asks which device it runs on. A backend
owns placement and the dtype policy, synchronisation, per-phase timing, memory statistics, the
profiler, and graph capture of fixed-shape steps.

Graph-capture contract (:meth:`Backend.capture`): ``fn(*static_args)`` updates tensors in place
and returns nothing. Every tensor it reads or writes is device-resident with a fixed shape, given
as an argument or closed over; no host sync (``.item()``, ``.cpu()``, ``bool(tensor)``) happens
inside. The returned callable applies ``fn`` once to the same buffers each time it is called.
Capturing may run ``fn`` a few times (warm-up, compilation), so buffer contents after
``capture`` are unspecified: write the real inputs into the buffers before the first replay.
"""

from __future__ import annotations

import abc
import contextlib
import gzip
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import Tensor, nn

from backends.compile_faults import compile_fault, held_compiler_logs
from runtime.utils.atomic import atomic_path
from runtime.utils.cache_dirs import cache_root, root_is_chosen
from runtime.utils.errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
DTYPE_ALIASES: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Turn ``"bf16" | "fp16" | "fp32"`` (or a long alias such as ``"bfloat16"``, or a dtype) into a dtype."""
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise UserError(f"unsupported dtype {value} (choose {', '.join(DTYPES)})")
        return value
    key = DTYPE_ALIASES.get(value.lower(), value.lower())
    if key not in DTYPES:
        raise UserError(f"unknown dtype '{value}' (choose {', '.join(DTYPES)})")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (``bf16``/``fp16``/``fp32``) of a supported dtype."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


class TimingEvent(Protocol):
    """What :class:`PhaseTimer` needs of a device event (``torch.cuda.Event``, ``torch.hpu.Event``)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Any) -> float: ...


class PhaseTimer:
    """Accumulates wall time and call count per named phase, correctly for the device.

    Two clocks:

    * **events** (``event_factory`` given; CUDA, HPU): each phase records a start and a stop event
      on the current stream and never waits. Elapsed times are resolved in :meth:`summary`, after
      a single ``synchronize``. Pairs whose stop event has already completed are folded in as the
      run goes, so a long run does not hold an unbounded number of events.
    * **host clock** (no factory; CPU): ``time.perf_counter`` around the phase. If ``synchronize``
      is given it is called at both ends, so queued device work is charged to its own phase.

    Phases are meant to be disjoint (``prefill``, ``draft``, ``verify``, ``accept``, ``decode``);
    re-entering a phase that is still open is a programming error.
    """

    _FOLD_EVERY = 256

    def __init__(
        self,
        *,
        event_factory: Callable[[], TimingEvent] | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        self._event_factory = event_factory
        self._synchronize = synchronize
        self._seconds: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._pending: list[tuple[str, TimingEvent, TimingEvent]] = []
        self._open: set[str] = set()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as one occurrence of phase ``name``."""
        if name in self._open:
            raise RuntimeError(f"phase '{name}' is already open; phases must not nest in themselves")
        self._open.add(name)
        self._counts[name] = self._counts.get(name, 0) + 1
        self._seconds.setdefault(name, 0.0)
        try:
            if self._event_factory is not None:
                start, stop = self._event_factory(), self._event_factory()
                start.record()
                try:
                    yield
                finally:
                    stop.record()
                    self._pending.append((name, start, stop))
                    if len(self._pending) >= self._FOLD_EVERY:
                        self._fold(wait=False)
            else:
                if self._synchronize is not None:
                    self._synchronize()
                began = time.perf_counter()
                try:
                    yield
                finally:
                    if self._synchronize is not None:
                        self._synchronize()
                    self._seconds[name] += time.perf_counter() - began
        finally:
            self._open.discard(name)

    def _fold(self, *, wait: bool) -> None:
        if wait and self._pending and self._synchronize is not None:
            self._synchronize()
        still_pending = []
        for name, start, stop in self._pending:
            if wait or stop.query():
                self._seconds[name] += start.elapsed_time(stop) / 1000.0  # events report ms
            else:
                still_pending.append((name, start, stop))
        self._pending = still_pending

    def summary(self) -> dict[str, dict[str, float | int]]:
        """``{phase: {"seconds": float, "count": int}}`` for every phase entered so far.

        With device events this synchronises once, so call it after the timed work, not inside.
        """
        self._fold(wait=True)
        return {name: {"seconds": self._seconds[name], "count": self._counts[name]} for name in self._counts}

    def total_seconds(self) -> float:
        """Sum of all phases' seconds (synchronises like :meth:`summary`)."""
        return sum(float(entry["seconds"]) for entry in self.summary().values())

    def reset(self) -> None:
        """Forget every phase (e.g. after warm-up)."""
        if self._open:
            raise RuntimeError(f"cannot reset while phases are open: {sorted(self._open)}")
        self._seconds.clear()
        self._counts.clear()
        self._pending.clear()


ModuleOrTensor = TypeVar("ModuleOrTensor", nn.Module, Tensor)


class Backend(abc.ABC):
    """One accelerator kind: placement, dtype policy, sync, timing, memory, profiler, graphs.

    Attributes:
        name: ``"cpu" | "cuda" | "hpu"``.
        device: the ``torch.device`` all tensors of a run live on.
        dtype: floating-point dtype for weights and activations (``default_dtype`` unless overridden).
        graph_mode: whether :meth:`capture` compiles/captures (True) or returns an eager closure.
        capture_count: how many times each named step was compiled or captured; a step that is
            captured once and replayed N times reads 1. Missing names read 0.
        dist_backend: the ``torch.distributed`` process-group backend for this device.
    """

    name: ClassVar[str]
    default_dtype: ClassVar[torch.dtype]
    dist_backend: ClassVar[str]
    # the compilers' on-disk cache variables this backend's graph mode writes through
    compile_cache_vars: ClassVar[dict[str, str]] = {"TORCHINDUCTOR_CACHE_DIR": "inductor"}

    def __init__(self, *, dtype: str | torch.dtype | None = None, graph_mode: bool = True) -> None:
        available, reason = self.availability()
        if not available:
            raise UserError(f"{self.name} is not available: {reason}")
        self.dtype: torch.dtype = self.default_dtype if dtype is None else parse_dtype(dtype)
        self.graph_mode = graph_mode
        self.capture_count: Counter[str] = Counter()

    # -- availability and identity -------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def availability(cls) -> tuple[bool, str]:
        """``(True, "")`` if this backend can run here, else ``(False, reason)``: one line naming the fix."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The device every tensor of a run lives on."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """Facts for logs and result files: ``backend``, ``name``, ``count``, ``torch``, versions, ``dtype``."""

    def _common_info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "torch": torch.__version__,
            "dtype": dtype_name(self.dtype),
            "graph_mode": self.graph_mode,
        }

    # -- placement -----------------------------------------------------------------------------

    def to_device(self, obj: ModuleOrTensor, *, cast: bool = True) -> ModuleOrTensor:
        """Move a module or tensor to :attr:`device`.

        With ``cast`` (default), floating-point parameters, buffers and tensors take :attr:`dtype`;
        integer and boolean tensors (token ids, masks, indices) keep their dtype. A module is moved
        in place and returned; a tensor is returned as a new tensor (or itself if already there).
        """
        if isinstance(obj, nn.Module):
            return obj.to(device=self.device, dtype=self.dtype) if cast else obj.to(device=self.device)
        if isinstance(obj, Tensor):
            if cast and obj.is_floating_point():
                return obj.to(device=self.device, dtype=self.dtype)
            return obj.to(device=self.device)
        raise TypeError(f"to_device expects an nn.Module or a Tensor, got {type(obj).__name__}")

    def prepare_inference(self, module: nn.Module) -> int:
        """Ready a model's layers for decoding on this device; returns how many layers read
        prepared weights. Idempotent, and a weight changed in place later is read as it is
        (never a stale copy). Nothing here; the CPU backend prepacks its large linear layers
        (`backends.cpu_packing`) and, in graph mode, compiles its small ones' matmuls as
        reductions (`backends.cpu_small_linear`)."""
        del module
        return 0

    def cached_attention(self) -> Callable[..., Tensor | None] | None:
        """The backend's own attention over a static KV cache, (q, k, v, mask) -> output or None
        where it does not serve those inputs (then SDPA runs); None: SDPA always. The CPU's reads
        only the open slots (`backends.cpu_attention`)."""
        return None

    def memory_bound(self, module: nn.Module) -> bool:
        """Whether a step of `module` is bound by reading its weights from memory rather than by
        its arithmetic (`--method auto` then reads a profile's [auto] memory_bound table). No
        here: an accelerator's profile measures its own table; the CPU's says by cache size."""
        del module
        return False

    def release_inference(self, module: nn.Module) -> int:
        """Undo `prepare_inference` on a model (a plain baseline in the same process); returns how
        many layers it restored."""
        del module
        return 0

    # -- synchronisation and timing -----------------------------------------------------------

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until all queued device work has finished."""

    def mark_step(self) -> None:
        """End of one decoding step. Flushes the accumulated graph in HPU lazy mode; a no-op elsewhere."""

    def timer(self) -> PhaseTimer:
        """A fresh :class:`PhaseTimer` using this device's clock."""
        return PhaseTimer(synchronize=self.synchronize)

    # -- memory --------------------------------------------------------------------------------

    @abc.abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """``{"current_bytes": int, "peak_bytes": int}`` since the last :meth:`reset_peak_memory`."""

    @abc.abstractmethod
    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""

    def free_memory(self) -> int | None:
        """Bytes the device can still allocate, or None where that is not known (CPU)."""
        return None

    # -- profiler ------------------------------------------------------------------------------

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """The ``torch.profiler`` activities that cover this device."""
        return [torch.profiler.ProfilerActivity.CPU]

    @contextlib.contextmanager
    def profiler(self, path: str | os.PathLike[str]) -> Iterator[torch.profiler.profile]:
        """Profile the body with ``torch.profiler`` and write a Chrome trace JSON to ``path``
        (gzipped where ``path`` ends in ``.gz``; Perfetto opens both).

        The trace opens in Perfetto (ui.perfetto.dev) or chrome://tracing. Device work is
        synchronised before the profiler stops so it lands in the trace. The file is written to a
        temporary name and renamed, so a failure never leaves a half-written trace; if the body
        raises, no trace is written.
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with torch.profiler.profile(activities=self.profiler_activities(), record_shapes=True) as prof:
            yield prof
            self.synchronize()
        with atomic_path(target) as tmp:
            if target.suffix != ".gz":
                prof.export_chrome_trace(str(tmp))
                return
            raw = tmp.with_name(tmp.name + ".json")
            try:
                prof.export_chrome_trace(str(raw))
                with open(raw, "rb") as source, gzip.open(tmp, "wb", compresslevel=6) as sink:
                    shutil.copyfileobj(source, sink)
            finally:
                raw.unlink(missing_ok=True)

    # -- graph capture -------------------------------------------------------------------------

    @contextlib.contextmanager
    def compile_cache(self, key: str | None) -> Iterator[Path | None]:
        """While the steps of one configuration are compiled, point the compilers' on-disk caches
        (:attr:`compile_cache_vars`) at ``<cache>/compile/<key>/``, where ``<cache>`` is
        ``$LANTERN_RUNTIME_CACHE`` or ``~/.cache/lantern-runtime`` (`runtime.utils.cache_dirs`); yields
        that folder, or None where nothing changes.

        So a second process running the same configuration reads its compiled steps instead of
        compiling them again (inductor's graph and AOT-autograd caches; what remains is dynamo's
        trace). ``key`` names every knob that sets a step's graph (the decoder's ``compile_key``:
        tree, window, depth, batch, sampling constants, model shapes, dtype, torch version), so
        two configurations never share a folder: one's artefacts are never offered to the other,
        and a cache can be kept, shipped or deleted per configuration. Nothing changes in eager
        mode or where the user set a compiler's own variable (that choice wins; a variable holding
        the compiler's default is not a choice: inductor writes its default into the environment
        the first time anything compiles, and child processes inherit it). A chosen cache
        that cannot be written is refused; the default one, unwritable, is skipped (the steps
        compile as they would without it).
        """
        names = self.compile_cache_vars
        if key is None or not self.graph_mode or not names or any(map(_user_chose, names)):
            yield None
            return
        root = cache_root()
        folder = root / "compile" / key
        try:
            for sub in names.values():
                (folder / sub).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            if root_is_chosen():
                raise UserError(f"LANTERN_RUNTIME_CACHE={root}: cannot create the compile cache {folder} ({err}); "
                                "point it at a writable folder") from None
            yield None
            return
        previous = {n: os.environ.get(n) for n in names}
        os.environ.update({n: str(folder / sub) for n, sub in names.items()})
        try:
            yield folder
        finally:
            for n, value in previous.items():
                if value is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = value

    def capture(self, fn: Callable[..., None], *static_args: Tensor, name: str) -> Callable[[], None]:
        """Capture the fixed-shape in-place step ``fn(*static_args)``; return a replay callable.

        See the module docstring for the contract. Each call of the result applies ``fn`` once to
        the same buffers, under ``torch.no_grad()``. With :attr:`graph_mode` off the result is a
        plain eager closure and nothing is counted in :attr:`capture_count`.
        """
        for index, arg in enumerate(static_args):
            if not isinstance(arg, Tensor):
                raise TypeError(f"capture '{name}': static argument {index} is a {type(arg).__name__}, not a Tensor")
            if arg.device != self.device:
                raise ValueError(f"capture '{name}': static argument {index} is on {arg.device}, not {self.device}")
        if not self.graph_mode:
            return _eager_replay(fn, static_args)
        return self._capture(fn, static_args, name)

    @abc.abstractmethod
    def _capture(self, fn: Callable[..., None], static_args: tuple[Tensor, ...], name: str) -> Callable[[], None]:
        """Device-specific capture; increments ``capture_count[name]`` once per compile/capture."""

    def _compile_counted(
        self, fn: Callable[..., None], static_args: tuple[Tensor, ...], name: str, dynamo_backend: str
    ) -> Callable[[], None]:
        """``torch.compile`` ``fn`` through ``dynamo_backend``, counting each graph dynamo hands over.

        A recompilation (a guard failed, e.g. a shape changed) shows as a count above 1. The step
        is compiled here by one warm-up call, so compile time is not charged to the first replay.
        """
        inner = torch._dynamo.lookup_backend(dynamo_backend)
        counts = self.capture_count

        def counting_backend(graph_module: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
            counts[name] += 1
            return inner(graph_module, example_inputs)

        compiled = torch.compile(fn, backend=counting_backend, fullgraph=True, dynamic=False)
        replay = _eager_replay(compiled, static_args)
        # Dynamo caches compiled graphs per code object, so closures made by one `def` (e.g. one
        # step per tree level) share a cache whose default limit of 8 entries would fail the 9th
        # capture. Each capture is meant, so lift the limit while compiling it; a later
        # unexpected recompile still meets the default limit (and shows in capture_count).
        with torch._dynamo.config.patch(recompile_limit=1_000_000, accumulated_recompile_limit=1_000_000), \
                held_compiler_logs() as release_logs:
            try:
                replay()
            except Exception as err:  # the compilers wrap the file system's fault in their own errors
                message = compile_fault(err, name)
                if message is None:
                    release_logs()
                    raise
                raise UserError(message) from None
            release_logs()
        return replay


def _user_chose(variable: str) -> bool:
    """Whether the compiler cache `variable` is set to something other than the compiler's default."""
    value = os.environ.get(variable)
    if value is None:
        return False
    if variable != "TORCHINDUCTOR_CACHE_DIR":
        return True
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without inductor's helper: any value is a choice
        return True
    return os.path.abspath(value) != os.path.abspath(default_cache_dir())


def _eager_replay(fn: Callable[..., None], static_args: tuple[Tensor, ...]) -> Callable[[], None]:
    def replay() -> None:
        with torch.no_grad():
            fn(*static_args)

    return replay
