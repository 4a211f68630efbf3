"""The slot API every decoding loop offers, and what flows through it.

A loop holds `config.batch` slots. A caller admits a `SlotRequest` (an image: condition, mask,
seed) into a free slot, steps every busy slot together, collects the images that are done
(`Finished`: tokens and `ImageStats`) and releases their slots, which then take the next
request: `admit` -> `step` -> `finished` -> `release`. `SlotDecoder` is that contract, with the
rest callers use (progress, previews, capture, the compile key, state size, the phase timer,
law measurement). Two loops implement it (`runtime.core.generate.LOOPS`):

    Decoder       runtime/core/decoder.py (its phase steps: steps.py): every method that
                  commits tokens in raster order (each iteration extends the image's prefix:
                  AR, the drafter trees, sjd, pjd)
    PublishedPJD  runtime/core/pjd_published.py: pjd's released loop (`--accept published`),
                  which commits tokens of several rows ahead of the raster frontier, so an
                  image's state is a set of committed positions, not a prefix length

They share this module's statistics, the compile key and the non-finite error, and the
workload loop `SlotDecoder.generate_many`. The serving engine (runtime/serve/engine.py), the
pipeline and the tools reach a loop only through `SlotDecoder`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, TypedDict, cast, runtime_checkable

import torch

from runtime.core.state import DecodeConfig
from runtime.utils.errors import UserError

if TYPE_CHECKING:
    from backends.base import PhaseTimer
    from runtime.core.rng import CounterRNG
    from runtime.models.kv_cache import StaticKVCache


@dataclass(frozen=True)
class SlotRequest:
    """One image to decode in a slot: key (the caller's name for it, returned with its result),
    cond (1,) label or (1, cls, caption_dim) / (1, cls) prompt, mask (1, cls) or None, seed (its
    random stream: its tokens depend on nothing else)."""
    key: Any  # the caller's (a job, an index): handed back as given
    cond: torch.Tensor
    mask: torch.Tensor | None
    seed: int


@dataclass(frozen=True)
class Finished:
    """A done image: its slot, its request's key, tokens (block_size,) on the device, statistics."""
    slot: int
    key: Any  # the caller's (a job, an index): handed back as given
    tokens: torch.Tensor
    stats: ImageStats


class NonFiniteError(UserError):
    """A model produced NaN or infinite logits while decoding (named part, first token index)."""


def nonfinite_error(part: str, key: object, index: int, dtype: torch.dtype) -> NonFiniteError:
    """The one line a NaN or inf in `part`'s logits for image `key` at image token `index` gives."""
    return NonFiniteError(f"the {part} produced NaN or infinite logits for image {key} at image token {index} "
                          f"({str(dtype).replace('torch.', '')}); decoding stopped. Finite weights overflow in "
                          "fp16: use --dtype bf16 or fp32")


def compile_key(config: DecodeConfig) -> str:
    """`{method}-b{batch}-{16 hex}`: names every knob that sets a captured step's graph (each field
    of the method spec: tree, window, depths, accept, sampling constants; the batch; the target's
    and drafter's configurations; dtype, device kind, torch version). Equal keys, equal graphs;
    the backend keys its compile caches on it."""
    drafter = getattr(config.drafter, "config", None) if config.drafter is not None else None
    knobs = {"spec": asdict(config.spec), "batch": config.batch, "target": config.target.config,
             "drafter": drafter, "dtype": str(config.dtype), "device": config.device.type,
             "torch": torch.__version__}
    digest = hashlib.sha256(json.dumps(knobs, sort_keys=True, default=repr).encode()).hexdigest()[:16]
    return f"{config.spec.method}-b{config.batch}-{digest}"


@dataclass
class ImageStats:
    """Per-image counters (host values, read once after the image is done)."""

    tokens: int
    target_forwards: int
    accepted_tokens: int
    depth_accepted: list[int]
    depth_reached: list[int]
    relax_mass: float
    accepted_drafts: int
    drafted_levels: int = 0  # tree levels drafted, summed over iterations
    # `Decoder.measure_law`: TV(output law, p) at the root's children and the stated bound
    # there, summed over the iterations measured
    law_tvd: float = 0.0
    law_bound: float = 0.0
    law_steps: int = 0


@dataclass
class RunStats:
    """Aggregated statistics over images."""

    images: int = 0
    tokens: int = 0
    target_forwards: int = 0
    accepted_tokens: int = 0
    depth_accepted: list[int] = field(default_factory=list)
    depth_reached: list[int] = field(default_factory=list)
    relax_mass: float = 0.0
    accepted_drafts: int = 0
    drafted_levels: int = 0
    law_tvd: float = 0.0
    law_bound: float = 0.0
    law_steps: int = 0

    def add(self, s: ImageStats) -> None:
        self.images += 1
        self.tokens += s.tokens
        self.target_forwards += s.target_forwards
        self.accepted_tokens += s.accepted_tokens
        if not self.depth_accepted:
            self.depth_accepted = [0] * len(s.depth_accepted)
            self.depth_reached = [0] * len(s.depth_reached)
        self.depth_accepted = [a + b for a, b in zip(self.depth_accepted, s.depth_accepted)]
        self.depth_reached = [a + b for a, b in zip(self.depth_reached, s.depth_reached)]
        self.relax_mass += s.relax_mass
        self.accepted_drafts += s.accepted_drafts
        self.drafted_levels += s.drafted_levels
        self.law_tvd += s.law_tvd
        self.law_bound += s.law_bound
        self.law_steps += s.law_steps

    def summary(self) -> RunSummary:
        """tau = tokens produced (bonus included) per target forward; mean_drafted_depth =
        tree levels drafted per iteration (every image's prefill is a forward, not an iteration);
        step_tvd / step_tvd_bound: mean TV distance of a step's output law from the target and
        the stated bound there (`Decoder.measure_law`; None when not measured)."""
        fw = max(self.target_forwards, 1)
        iterations = max(self.target_forwards - self.images, 1)
        return {
            "mean_accepted_length": self.accepted_tokens / fw,
            "target_forwards": self.target_forwards,
            "tokens": self.tokens,
            "step_compression": self.tokens / fw,
            "per_depth_acceptance": [a / r if r else 0.0 for a, r in zip(self.depth_accepted, self.depth_reached)],
            "mean_relaxation_mass": self.relax_mass / self.accepted_drafts if self.accepted_drafts else 0.0,
            "mean_drafted_depth": self.drafted_levels / iterations,
            "step_tvd": self.law_tvd / self.law_steps if self.law_steps else None,
            "step_tvd_bound": self.law_bound / self.law_steps if self.law_steps else None,
            "law_steps": self.law_steps,
        }


class RunSummary(TypedDict):
    """`RunStats.summary()`: a run's statistics as result files record them."""

    mean_accepted_length: float
    target_forwards: int
    tokens: int
    step_compression: float
    per_depth_acceptance: list[float]
    mean_relaxation_mass: float
    mean_drafted_depth: float
    step_tvd: float | None
    step_tvd_bound: float | None
    law_steps: int


@runtime_checkable
class SlotDecoder(Protocol):
    """A decoding loop over `config.batch` slots (see the module docstring). Implementations
    subclass it for `generate_many` / `generate_one`; a test's fake may just match it."""

    config: DecodeConfig
    timer: PhaseTimer | None  # set to time the phases (prefill / draft / verify / accept ...)
    measure_law: bool  # set to measure each step's output law against the target's (sampling)

    @property
    def slots(self) -> list[SlotRequest | None]:
        """The request each slot holds (None: free)."""
        ...

    @property
    def compile_key(self) -> str:
        """`compile_key(config)`: equal keys, equal captured graphs."""
        ...

    def reset_slots(self) -> None:
        """Forget every slot: a new workload (captured steps are kept)."""
        ...

    def admit(self, slot: int, request: SlotRequest) -> None:
        """Start `request` in the free `slot`."""
        ...

    def busy(self) -> list[int]:
        """The slots holding a request."""
        ...

    def step(self) -> None:
        """One iteration for every busy slot."""
        ...

    def finished(self, progress: bool = False) -> list[Finished]:
        """The busy slots whose image is done (still busy until `release`); with `progress`, also
        read every busy slot's count of known tokens for `progress`."""
        ...

    def release(self, slot: int) -> None:
        """Free `slot`."""
        ...

    def progress(self) -> list[tuple[int, Any, int]]:
        """(slot, request key, tokens known) of every busy slot, as the last read found them."""
        ...

    def committed(self, slot: int, known: int) -> torch.Tensor:
        """The first `known` tokens of the image in `slot`, on the host (a preview)."""
        ...

    def capture_steps(self, cond: torch.Tensor, cond_mask: torch.Tensor | None) -> None:
        """Capture the loop's steps once (graph mode), on state from a throwaway condition."""
        ...

    def state_bytes(self) -> int:
        """Bytes of the decode state (what grows with the batch)."""
        ...

    @torch.no_grad()  # entered each time the generator resumes
    def iter_finished(self, conds: list[tuple[torch.Tensor, torch.Tensor | None, int]]) -> Iterator[Finished]:
        """Decode a workload B images at a time, yielding each image as it is done (its key is
        its index j in `conds`; not necessarily in order). conds[j] = (cond (1,) or (1, cls,
        caption_dim), mask (1, cls) or None, seed). The first B images fill the slots; each time
        one is done its slot starts the next. With fewer than B images the spare slots decode a
        copy of the first one, unused. The caller must run it to the end before another workload."""
        waiting = iter(range(len(conds)))
        self.reset_slots()
        for slot in range(self.config.batch):
            if (j := next(waiting, None)) is not None:
                self.admit(slot, SlotRequest(j, *conds[j]))
        while self.busy():
            self.step()
            for done in self.finished():
                yield done
                self.release(done.slot)
                if (j := next(waiting, None)) is not None:
                    self.admit(done.slot, SlotRequest(j, *conds[j]))
        # the loop ends when every slot is free: each image of the workload is done

    @torch.no_grad()
    def generate_many(self, conds: list[tuple[torch.Tensor, torch.Tensor | None, int]],
                      on_image: Callable[[int, torch.Tensor, ImageStats], None] | None = None
                      ) -> tuple[list[torch.Tensor], list[ImageStats]]:
        """Decode a workload (`iter_finished`'s) and return each image's tokens (block_size,) on
        the device and statistics, in workload order; `on_image(j, tokens, stats)` is called as
        each is done."""
        n = len(conds)
        tokens: list[torch.Tensor | None] = [None] * n
        stats: list[ImageStats | None] = [None] * n
        for done in self.iter_finished(conds):
            tokens[done.key], stats[done.key] = done.tokens, done.stats
            if on_image is not None:
                on_image(done.key, done.tokens, done.stats)
        return cast(list[torch.Tensor], tokens), cast(list[ImageStats], stats)

    @torch.no_grad()
    def generate_one(self, cond: torch.Tensor, cond_mask: torch.Tensor | None = None,
                     seed: int = 0) -> tuple[torch.Tensor, ImageStats]:
        """One image: tokens (block_size,) and its statistics."""
        tokens, stats = self.generate_many([(cond, cond_mask, seed)])
        return tokens[0], stats[0]


class NullTimer:
    """A timer that times nothing (a decoder built without a backend timer)."""

    def phase(self, name: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def phase_timer(timer: PhaseTimer | None) -> PhaseTimer | NullTimer:
    """The loop's phase timer, or one that times nothing (no timer set)."""
    return timer if timer is not None else NullTimer()


def prefill_slot(config: DecodeConfig, cache: StaticKVCache, start_cache: StaticKVCache, rng: CounterRNG,
                 slot: int, cond: torch.Tensor, cond_mask: torch.Tensor | None,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Start an image in `slot` of a loop (both loops start images this way, one at a time, so
    its numbers never depend on the batch): run its condition (1,) / (1, cls, caption_dim) /
    (1, cls) prompt ids with mask (1, cls), the null condition added under guidance, in the
    condition-sized `start_cache`; copy that into the slot's rows of `cache`; restart the slot's
    random stream at `seed`. Returns (hidden (rows per image, cls, dim), the first token's
    logits (rows per image, 1, V), the mask as the model rows read it (rows per image, cls) or
    None)."""
    b = config.batch
    rows = slot + b * torch.arange(config.rows // b, device=config.device)
    cond, cond_mask = config.guided(cond, cond_mask)  # the null condition's own padding included
    start_cache.reset()
    hidden = config.target.prefill(cond, start_cache, cond_mask)
    cache.load_rows(rows, start_cache)
    rng.reset_streams(torch.tensor([slot], device=config.device),
                      torch.tensor([seed], dtype=torch.long, device=config.device))
    return hidden, config.target.logits(hidden[:, -1:]), cond_mask
