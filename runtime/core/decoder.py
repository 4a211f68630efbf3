"""The shared decoding loop's slot API (`Decoder`): the phase steps of steps.py driven over B
slots, each holding one image of a caller's workload.

pjd's released loop (`--accept published`) commits tokens ahead of the raster frontier, so an
image's state is no prefix and it has its own loop (pjd_published.py); both offer the slot API
of slots.py (`SlotDecoder`), and the method table says which runs a method.

The only host read per iteration is the check whether a slot's image is done (then a few more
to collect it). When an image is done, the caller takes its tokens and starts the next image of
its workload in the slot (`admit`, between steps); a free slot keeps stepping, every advance
multiplied by 0, until a request is admitted to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from runtime.core.methods import MethodSpec
from runtime.core.slots import Finished, ImageStats, SlotDecoder, SlotRequest, nonfinite_error
from runtime.core.state import MODEL_PARTS, NO_POSITION
from runtime.core.steps import DecodeSteps

if TYPE_CHECKING:
    from backends import Backend
    from runtime.models.target import DrafterModel, Target


class Decoder(DecodeSteps, SlotDecoder):
    """Generates images with one method over `batch_size` slots (the slot API of slots.py); the
    steps, state and settings are `DecodeSteps`' (steps.py), which takes the same arguments."""

    _counts: list[int] | None  # the counts `finished` last read (None: none this iteration)

    def __init__(self, target: Target, drafter: DrafterModel | None, spec: MethodSpec, *,
                 neighbours: torch.Tensor | None = None, backend: Backend | None = None, batch_size: int = 1,
                 track_nodes: bool = False, lazy_head: bool | None = None) -> None:
        super().__init__(target, drafter, spec, neighbours=neighbours, backend=backend, batch_size=batch_size,
                         track_nodes=track_nodes, lazy_head=lazy_head)
        b = self.config.batch
        # the slot API's bookkeeping: the request each slot holds, the same as a device mask
        # (what `finished` checks), whether the batch was prefilled, the counts last read
        self._slots: list[SlotRequest | None] = [None] * b
        self.active = torch.zeros(b, dtype=torch.bool, device=self.config.device)
        self._running, self._counts = False, None

    @property
    def slots(self) -> list[SlotRequest | None]:
        """The request each slot holds (None: free)."""
        return self._slots

    # -- the slot API: admit -> step -> finished -> release ----------------------------------
    # A caller (generate_many, the server's engine) schedules; the decoder executes and updates.
    # Which slot holds which request lives here (`slots`), nowhere else.
    def admit(self, slot: int, request: SlotRequest) -> None:
        """Start `request` in the free `slot` (0 <= slot < B). Before the first step, requests
        are held and the first step captures (graph mode) and prefills them together; after
        it, the slot's image starts at once (`start_image`) while the others keep theirs."""
        held = self._slots[slot]
        if held is not None:
            raise ValueError(f"slot {slot} is busy (holds {held.key!r})")
        self._slots[slot] = request
        if self._running:
            with self._timer().phase("prefill"):
                self.start_image(slot, request.cond, request.mask, request.seed)
        self.active[slot] = True

    def release(self, slot: int) -> None:
        """Free `slot` (its image finished and was collected, or was cancelled): it keeps stepping
        with every advance multiplied by 0 until a new request is admitted to it."""
        self._slots[slot] = None
        self.active[slot] = False

    def busy(self) -> list[int]:
        """The slots holding a request."""
        return [i for i, r in enumerate(self._slots) if r is not None]

    def step(self) -> None:
        """One iteration for every slot: draft, verify, accept (the busy slots' images advance;
        no host read but the draft's depth checks, when the method has them)."""
        if not self._running:
            self._start_batch()
        timer = self._timer()
        proposal = self._deepest()
        if self.draft_segments:
            with timer.phase("draft"):
                proposal = self.run_draft()
        with timer.phase("verify"):
            self.verify_at[proposal.depth]()
        if self.measure_law and proposal.depth and self.group is None and not self.config.params.greedy:
            if self._iteration % self.law_every == 0:
                self._measure_law(proposal)
            self._iteration += 1
        with timer.phase("accept"):
            self.accept_at[proposal.depth]()
        if self.backend is not None:
            self.backend.mark_step()

    def finished(self, progress: bool = False) -> list[Finished]:
        """The busy slots whose image is done, with its tokens (block_size,) on the device and
        statistics; still busy until `release`. The iteration's one host read: whether any is
        done (then the counts and the NaN flags). progress: read the counts in any case, for
        `progress()`. Raises NonFiniteError for an image whose logits held NaN or inf."""
        self._counts = None
        if not self._running:
            return []
        buf, num_tokens = self.buffers, self.config.num_tokens
        if progress or bool(((buf.count >= num_tokens) & self.active).any()):
            self._counts = buf.count.tolist()
        if self._counts is None:
            return []
        done, nonfinite = [], None
        for i, request in enumerate(self._slots):
            if request is None or self._counts[i] < num_tokens:
                continue
            if nonfinite is None:
                nonfinite = buf.nonfinite.tolist()
            for part, at in zip(MODEL_PARTS, nonfinite):
                if at[i] != NO_POSITION:
                    raise nonfinite_error(part, request.key, at[i], self.config.dtype)
            done.append(Finished(i, request.key, buf.out[i, :num_tokens].clone(), self._image_stats(i)))
        return done

    def progress(self) -> list[tuple[int, Any, int]]:
        """(slot, key, tokens known) of every busy slot, from the counts the last
        `finished(progress=True)` read (no host read of its own); empty when it read none."""
        if self._counts is None:
            return []
        total = self.config.num_tokens
        return [(i, r.key, min(self._counts[i], total)) for i, r in enumerate(self._slots) if r is not None]

    def committed(self, slot: int, known: int) -> torch.Tensor:
        """The first `known` tokens of the image in `slot` (a `progress` count), on the host: a
        copy (one device read), for a preview of an image still decoding."""
        return self.buffers.out[slot, :known].cpu()

    def _start_batch(self) -> None:
        """The first step's prefill (and capture, in graph mode) of the admitted requests; a slot
        with none decodes a copy of the first, unused (its advances are multiplied by 0)."""
        held = [r for r in self._slots if r is not None]
        if not held:
            raise ValueError("step() before any request was admitted")
        padded = [r if r is not None else held[0] for r in self._slots]
        cond = torch.cat([r.cond for r in padded])
        mask = None if padded[0].mask is None else torch.cat([_mask_of(r) for r in padded])
        timer = self._timer()
        if not self.captured:
            with timer.phase("capture"):
                self.capture_steps(cond, mask)
        with timer.phase("prefill"):
            self.prefill(cond, mask, [r.seed for r in padded])
        self._running = True

    def reset_slots(self) -> None:
        """Forget every slot and the running batch: the next admitted requests are prefilled
        together by the next step (a new workload; captured steps are kept)."""
        self._slots = [None] * self.config.batch
        self.active.zero_()
        self._running, self._counts = False, None

    def _image_stats(self, i: int) -> ImageStats:
        """Statistics of the image in slot i, read once it is done. hist[c]: iterations
        accepting c nodes, root included; accepted: tokens known (the prefill's first one plus
        n per iteration)."""
        buf, max_depth = self.buffers, self.policy.tree.max_depth
        hist, accepted = buf.count_hist[i].tolist(), int(buf.count[i])
        iters = sum(hist)
        depth_acc = [sum(hist[d + 2:]) for d in range(max_depth)]
        if self.variable_depth:  # reached depth d: drafted that deep and accepted down to d - 1
            reached, drafted = buf.reached[i].tolist(), int(buf.drafted_sum[i])
        else:
            reached = [iters] + depth_acc[:-1] if max_depth else []
            drafted = max_depth * iters
        law_tvd, law_bound, law_steps = buf.law_sums[:, i].tolist()
        return ImageStats(tokens=self.config.num_tokens, target_forwards=1 + iters,
                          accepted_tokens=accepted, depth_accepted=depth_acc,
                          depth_reached=reached, relax_mass=float(buf.relax_mass[i]),
                          accepted_drafts=accepted - 1 - iters, drafted_levels=drafted,
                          law_tvd=law_tvd, law_bound=law_bound, law_steps=int(law_steps))


def _mask_of(request: SlotRequest) -> torch.Tensor:
    """The condition mask of a request batched with others that carry one."""
    if request.mask is None:
        raise ValueError("the requests of one batch carry a condition mask each, or none does")
    return request.mask
