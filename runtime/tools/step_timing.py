"""Timing decoding steps on a model's shape: random weights of the shape, and each phase of an
iteration bracketed by device synchronisations (what `runtime bench --shape` projects from and
`runtime selfcheck` reports for the LlamaGen-XL shape).

A decoding iteration has fixed shapes by design, so its cost depends on the shape, the tree
and the device, never on the weights' values: random weights stand in for a trained model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from runtime.core.opcount import PHASES

if TYPE_CHECKING:
    from backends import Backend
    from runtime.core.decoder import Decoder


def random_models(cfg: Any, backend: Backend, seed: int = 0) -> tuple[Any, Any]:
    """(target, drafter) of the GPT config `cfg` on the backend's device and dtype, LlamaGen-initialised
    random weights (with a non-zero head, so distributions are not uniform)."""
    from runtime.models.configs import DrafterConfig
    from runtime.models.drafter import Drafter
    from runtime.models.gpt import Transformer

    torch.manual_seed(seed)
    with torch.device(backend.device):
        target = Transformer(cfg)
        target.init_weights()
        torch.nn.init.normal_(target.output.weight, std=cfg.initializer_range)
        drafter = Drafter(DrafterConfig.for_target(cfg))
    return target.to(backend.dtype).eval(), drafter.to(backend.dtype).eval()


def random_neighbours(vocab_size: int, spec: Any, seed: int = 0) -> torch.Tensor | None:
    """The proximity table of a random 8-dimensional codebook, for relaxed methods (its values
    change which drafts are accepted, never the cost of an iteration)."""
    if not spec.needs_neighbours:
        return None
    from runtime.core.proximity import neighbour_table

    g = torch.Generator().manual_seed(seed)
    table, _ = neighbour_table(torch.randn(vocab_size, 8, generator=g), min(spec.lantern_k + 1, vocab_size - 1))
    return table


@dataclass
class StepTimes:
    """Seconds per iteration of each phase (one sample per timed iteration)."""

    draft: list[float] = field(default_factory=list)
    verify: list[float] = field(default_factory=list)
    accept: list[float] = field(default_factory=list)

    def iterations(self) -> np.ndarray:
        """(n,) seconds of each whole iteration."""
        parts = [np.asarray(getattr(self, p)) for p in PHASES if getattr(self, p)]
        return np.sum(parts, axis=0)

    def medians(self) -> dict[str, float]:
        """Median seconds of each timed phase, and of the whole iteration (key "iteration")."""
        out = {p: float(np.median(getattr(self, p))) for p in PHASES if getattr(self, p)}
        out["iteration"] = float(np.median(self.iterations()))
        return out

    def to_dict(self) -> dict[str, list[float]]:
        return {p: list(getattr(self, p)) for p in PHASES}


class _Stepper:
    """One decoder's timed iterations: captured (graph mode) and prefilled on construction, then
    one full iteration, phase by phase, per `step()` call."""

    def __init__(self, decoder: Decoder, backend: Backend) -> None:
        self.decoder, self.backend = decoder, backend
        self.cond = torch.zeros(decoder.config.batch, dtype=torch.long, device=decoder.config.device)
        if backend.graph_mode and not decoder.captured:
            decoder.capture_steps(self.cond, None)
        decoder.prefill(self.cond, None, 0)
        self.count = 0

    def step(self, times: StepTimes | None) -> None:
        """One iteration; its phases' seconds appended to `times` (None: untimed). An image that
        completes is restarted first (untimed), so every iteration is a full one."""
        decoder, backend = self.decoder, self.backend
        with torch.no_grad():
            if bool((decoder.buffers.count >= decoder.config.num_tokens - decoder.policy.tree.max_depth - 1).any()):
                decoder.prefill(self.cond, None, self.count)
            self.count += 1
            depth = decoder.policy.tree.max_depth
            phases: list[tuple[str, Callable[[], Any] | None]] = [("draft", decoder.run_draft)] if decoder.draft_segments else []
            for phase, run in phases + [("verify", None), ("accept", None)]:
                backend.synchronize()
                began = time.perf_counter()
                if run is not None:
                    depth = run().depth
                elif phase == "verify":
                    decoder.verify_at[depth]()
                else:
                    decoder.accept_at[depth]()
                backend.synchronize()
                if times is not None:
                    getattr(times, phase).append(time.perf_counter() - began)


def time_steps(decoder: Decoder, backend: Backend, *, warmup: int, iterations: int) -> StepTimes:
    """Time `iterations` decoding iterations, phase by phase, after `warmup` untimed ones.

    The steps run as the runtime runs them: captured replays in graph mode, eager otherwise.
    Each phase is bracketed by device synchronisations, so its time is the device's. An image that
    completes is restarted (untimed) so every timed iteration is a full one.
    """
    return time_interleaved([decoder], backend, warmup=warmup, iterations=iterations)[0]


def time_interleaved(decoders: list[Decoder], backend: Backend, *, warmup: int, iterations: int,
                     between: Callable[[], None] | None = None) -> list[StepTimes]:
    """`time_steps` for several decoders at once, their iterations taken in turn (one of each,
    then the next round), so every decoder sees the same machine: on a host whose memory
    bandwidth drifts with its neighbours' load, the ratios of their times stay comparable
    where timing one after the other would not. `between`: called once after each timed round
    (a probe of the machine, e.g. `roofline.ReadProbe`)."""
    steppers = [_Stepper(d, backend) for d in decoders]
    times = [StepTimes() for _ in decoders]
    for i in range(warmup + iterations):
        for stepper, own in zip(steppers, times):
            stepper.step(own if i >= warmup else None)
        if between is not None and i >= warmup:
            between()
    return times
