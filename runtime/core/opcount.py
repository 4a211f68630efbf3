"""Device-op budget of a decoding step, counted without a device.

An eager step dispatches one aten op per device kernel launch (roughly: a view costs no launch).
Counting non-view aten ops at the dispatcher therefore gives, on the CPU, the number of kernels
the same step would launch eagerly on a GPU: the replay overhead a graph without fusion pays.

    with OpCounter() as c:
        decoder.accept_step()
    c.count        # non-view aten ops dispatched
    c.by_op        # Counter of op names, for finding what to remove

`kernels_generated()` reads inductor's kernel counter, for the kernels a captured step compiled to.
`phase_ops(decoder, ...)` runs a decoder eagerly for a few iterations and returns the mean ops
per iteration of each phase (draft / verify / accept).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.config.method_options import Drafting

if TYPE_CHECKING:
    from runtime.core.state import DecodeBuffers, DecodeConfig

PHASES = ("draft", "verify", "accept")
# aten ops that return an alias of their input without being flagged as views
_ALIASES = frozenset({"_unsafe_view", "_reshape_alias", "alias", "lift_fresh"})


def kernels_generated() -> int | None:
    """Inductor's running count of generated kernels in this process (None if unavailable).

    The difference around a compilation is the number of kernels that compilation made.
    """
    try:
        from torch._inductor import metrics
    except ImportError:  # pragma: no cover - inductor ships with torch >= 2.0
        return None
    return int(getattr(metrics, "generated_kernel_count", 0))


class OpCounter(TorchDispatchMode):
    """Counts non-view aten ops dispatched inside the `with` block.

    Views (`view`, `expand`, `select`, slicing, ...) alias memory and launch nothing, so they
    are not counted, nor are the aliasing reshapes that are not flagged as views
    (`_unsafe_view`, `_reshape_alias`, `alias`); everything else is, including in-place ops
    and copies.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ has no annotations
        self.count = 0
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if not func.is_view and func.overloadpacket.__name__ not in _ALIASES:
            self.count += 1
            self.by_op[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class PhaseSteps(Protocol):
    """What `phase_ops` runs: the shared loop's eager steps (`runtime.core.steps.DecodeSteps`)."""

    config: DecodeConfig
    buffers: DecodeBuffers

    def prefill(self, cond: torch.Tensor, cond_mask: torch.Tensor | None, seed: int | list[int]) -> None: ...

    def draft_step(self) -> None: ...

    def verify_step(self) -> None: ...

    def accept_step(self) -> None: ...


@torch.no_grad()
def phase_ops(decoder: PhaseSteps, cond: torch.Tensor, cond_mask: torch.Tensor | None = None, *,
              seed: int = 0, iterations: int = 4) -> dict[str, float]:
    """Mean non-view aten ops per iteration of each phase, from `iterations` eager iterations.

    Runs the decoder's step functions directly (never its captured replays), after a prefill
    of `cond` ((B,) conditions for a decoder of batch size B). Phases the method does not have (AR has no draft) are absent.
    """
    decoder.prefill(cond, cond_mask, seed)
    steps = {"verify": decoder.verify_step, "accept": decoder.accept_step}
    if decoder.config.spec.drafting != Drafting.NONE:
        steps = {"draft": decoder.draft_step, **steps}
    totals = {name: 0 for name in steps}
    done = 0
    for _ in range(iterations):
        if int(decoder.buffers.count.min()) >= decoder.config.num_tokens:
            break
        for name, step in steps.items():
            with OpCounter() as counter:
                step()
            totals[name] += counter.count
        done += 1
    return {name: totals[name] / max(done, 1) for name in steps}
