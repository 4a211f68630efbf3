"""Python API: `generate(...)` -> tokens + statistics, for any method.

    from runtime.core import MethodSpec, SamplingParams, generate
    result = generate(target, drafter, MethodSpec("lantern++", SamplingParams(cfg=4.0)),
                      conditions=[3, 7], seed=0, vq=vq)
    result.tokens      # (2, block_size) long
    result.stats       # {"mean_accepted_length", "target_forwards", "tokens", ...}

Image i is generated with seed `derive_seed(seed, index_i)`, so its tokens depend only on
the run seed and its index: not on the batch size, order, or how images are split across
ranks (`batch_size=B` decodes B images at once; the tokens are the same for every B).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from runtime.core.decoder import Decoder
from runtime.core.slots import ImageStats, RunStats, RunSummary, SlotDecoder
from runtime.core.methods import MethodSpec
from runtime.core.pjd_published import PublishedPJD
from runtime.core.proximity import neighbour_table
from runtime.core.rng import derive_seed

if TYPE_CHECKING:
    from backends import Backend
    from runtime.models.target import DrafterModel, Target


class Codebook(Protocol):
    """What a relaxed method needs of a VQ model: its codebook vectors (codes, dim)."""

    def codebook_vectors(self, normalized: bool = ...) -> torch.Tensor: ...


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (num_images, block_size) long, CPU
    stats: RunSummary
    seeds: list[int]
    # per image, workload order: (tokens accepted, target forwards); tau = their sums' ratio
    image_counts: list[tuple[int, int]] = field(default_factory=list)


def neighbours_for(vq: Codebook, spec: MethodSpec, vocab_size: int) -> torch.Tensor | None:
    """The proximity table a relaxed method needs, from the VQ codebook (raw vectors, as LANTERN).

    Only the first `vocab_size` codes are tokens the GPT can emit (a GPT may use fewer tokens than
    the codebook holds), so neighbours are searched among those: the table is (vocab_size, k). A
    vocabulary larger than the codebook (Lumina-mGPT's row-end token) gets rows of valid codes.
    The table has lantern_k + 1 columns (at most V - 1).
    """
    if not spec.needs_neighbours:
        return None
    codebook = vq.codebook_vectors(normalized=False)[:vocab_size]
    # k + 1 columns: the paper rule clears a rejected draft's k+1 nearest codes
    k = min(spec.lantern_k + 1, codebook.size(0) - 1)
    table, _ = neighbour_table(codebook, k)
    if vocab_size > codebook.size(0):  # tokens that are no code (a row-end token): any valid codes; a
        # layout that forces such a token gives every code probability 0 there, so nothing moves
        extra = torch.arange(k, device=table.device).expand(vocab_size - codebook.size(0), k)
        table = torch.cat([table, extra])
    return table


# The loops, by `MethodSpec.loop` (the method table's `out_of_order` field): the shared decoder for
# every method that commits in raster order; pjd's released loop for the rule that commits out of it.
LOOPS: dict[str, Callable[..., SlotDecoder]] = {
    "raster": lambda target, drafter, spec, **kw: Decoder(target, drafter, spec, **kw),
    "out_of_order": lambda target, drafter, spec, neighbours=None, **kw: PublishedPJD(target, spec, **kw),
}


def new_decoder(target: Target, drafter: DrafterModel | None, spec: MethodSpec, *,
                neighbours: torch.Tensor | None = None, backend: Backend | None = None,
                batch_size: int = 1) -> SlotDecoder:
    """The loop that runs `spec` (`LOOPS[spec.loop]`), behind the slot API."""
    return LOOPS[spec.loop](target, drafter, spec, neighbours=neighbours, backend=backend, batch_size=batch_size)


def workload_items(conditions: Sequence[int] | torch.Tensor, cond_masks: torch.Tensor | None, seeds: Sequence[int],
                   device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
    """`SlotDecoder.iter_finished`'s items: per image (cond, mask, seed) on `device`, cond (1,) a
    class id, or (1, cls, caption_dim) caption features / (1, cls) prompt ids with mask (1, cls)."""
    # a sequence per image: captions (n, cls, caption_dim) or prompt token ids (n, cls)
    captions = conditions if isinstance(conditions, torch.Tensor) and conditions.dim() >= 2 else None
    work: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []
    for j in range(len(conditions)):
        if captions is not None:
            cond = captions[j:j + 1].to(device)
            mask = cond_masks[j:j + 1].to(device) if cond_masks is not None else None
        else:
            cond, mask = torch.tensor([int(conditions[j])], device=device), None
        work.append((cond, mask, seeds[j]))
    return work


def generate(target: Target, drafter: DrafterModel | None, spec: MethodSpec,
             conditions: Sequence[int] | torch.Tensor, *, cond_masks: torch.Tensor | None = None,
             seed: int = 0, indices: Sequence[int] | None = None, vq: Codebook | None = None,
             neighbours: torch.Tensor | None = None, backend: Backend | None = None,
             decoder: SlotDecoder | None = None, batch_size: int = 1,
             on_image: Callable[[int, torch.Tensor], None] | None = None) -> GenerationResult:
    """Generate one image per condition, `batch_size` images per decode.

    conditions: class ids (c2i), caption features (n, cls, caption_dim) (t2i) or prompt token ids
    (n, cls) (Chameleon), the last two with `cond_masks` (n, cls) bool (True on real positions).
    indices: the global image index of each condition (defaults to 0..n-1), used to derive
    per-image seeds. Pass `decoder` to reuse one across calls
    (state and captured graphs are kept; its batch size is used). B images decode at once;
    when one is done the next condition takes its slot (`Decoder.generate_many`).
    `on_image(i, tokens)` is called as each image is done (not necessarily in order).
    """
    dev = target.tok_embeddings.weight.device
    if decoder is None:
        if neighbours is None and vq is not None:
            neighbours = neighbours_for(vq, spec, target.config.vocab_size)
        decoder = new_decoder(target, drafter, spec, neighbours=neighbours, backend=backend, batch_size=batch_size)
    n = len(conditions)
    indices = list(range(n)) if indices is None else list(indices)
    seeds = [derive_seed(seed, i) for i in indices]
    work = workload_items(conditions, cond_masks, seeds, dev)
    out = torch.zeros(n, target.config.block_size, dtype=torch.long)

    def done(j: int, tokens: torch.Tensor, _stats: ImageStats) -> None:
        out[j] = tokens.cpu()
        if on_image is not None:
            on_image(j, out[j])

    _, image_stats = decoder.generate_many(work, on_image=done)
    stats = RunStats()
    for s in image_stats:  # workload order, whatever order the images finished in
        stats.add(s)
    return GenerationResult(out, stats.summary(), seeds,
                            [(s.accepted_tokens, s.target_forwards) for s in image_stats])
