"""What `runtime run`, `bench`, `sample` and `serve` share once a model is loaded and its
settings resolved (`runtime.generation.loading`, `runtime.generation.settings`): a decoder, generation with phase
timings, VQ decoding, image grids, and out-of-memory errors in one line."""


from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from runtime.core import MethodSpec, SlotDecoder, generate, neighbours_for
from runtime.core.generate import new_decoder
from runtime.core.law import WATCH_EVERY, watches_law
from runtime.utils.errors import UserError
from runtime.generation.loading import LoadedModel

if TYPE_CHECKING:
    from backends import Backend


def decode_tokens(vq: Any, tokens: torch.Tensor, batch: int = 16) -> np.ndarray:
    """(n, block_size) tokens -> uint8 images (n, H, W, 3), as LlamaGen post-processes."""
    device = next(vq.parameters()).device
    images = []
    with torch.no_grad():
        for start in range(0, tokens.size(0), batch):
            x = vq.decode_code(tokens[start:start + batch].to(device))
            images.append(torch.clamp(127.5 * x + 128.0, 0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu())
    return torch.cat(images).numpy()


def image_grid(images: np.ndarray) -> np.ndarray:
    """(n, H, W, 3) uint8 images -> one near-square uint8 grid, white 2-px gutters."""
    n, h, w, _ = images.shape
    cols = int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / cols))
    canvas = np.full((rows * (h + 2) + 2, cols * (w + 2) + 2, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        canvas[2 + r * (h + 2): 2 + r * (h + 2) + h, 2 + c * (w + 2): 2 + c * (w + 2) + w] = images[i]
    return canvas


@dataclass
class RunOutput:
    tokens: torch.Tensor
    images: np.ndarray
    stats: dict[str, Any]
    seeds: list[int]
    total_s: float
    phases: dict[str, dict[str, float]]
    # image j's share of total_s (workload order): the time from the previous image's completion
    # to its own, plus an equal share of the batched VQ decode; they sum to total_s
    image_seconds: list[float] = field(default_factory=list)
    image_counts: list[tuple[int, int]] = field(default_factory=list)  # (tokens accepted, target forwards)


def run_generation(loaded: LoadedModel, spec: MethodSpec, conditions: Sequence[int] | torch.Tensor, *,
                   seed: int, backend: Backend, indices: Sequence[int] | None = None,
                   cond_masks: torch.Tensor | None = None, decoder: SlotDecoder | None = None,
                   on_image: Callable[[int, torch.Tensor], None] | None = None) -> RunOutput:
    """Generate and decode, timing the phases prefill/draft/verify/accept/decode on the device."""
    if decoder is None:
        decoder = make_decoder(loaded, spec, backend)
    timer = backend.timer()
    decoder.timer = timer
    done_at: dict[int, float] = {}

    def image_done(j: int, tokens: torch.Tensor) -> None:
        done_at[j] = time.perf_counter()  # the loop has just read the device: its work so far is done
        if on_image is not None:
            on_image(j, tokens)

    backend.synchronize()
    start = time.perf_counter()
    with out_of_memory_as_user_error(decoder, backend):
        result = generate(loaded.target, loaded.drafter, spec, conditions, cond_masks=cond_masks, seed=seed,
                          indices=indices, decoder=decoder, on_image=image_done)
    with timer.phase("decode"):
        images = decode_tokens(loaded.vq, result.tokens)
    backend.synchronize()
    end = time.perf_counter()
    decoder.timer = None
    return RunOutput(result.tokens, images, result.stats, result.seeds, end - start, timer.summary(),
                     image_seconds=image_shares(done_at, start, end),
                     image_counts=result.image_counts)


def image_shares(done_at: dict[int, float], start: float, end: float) -> list[float]:
    """Each image's share of a run's wall time, in workload order (keys of `done_at`, 0..n-1):
    the gap since the image completed before it (or since `start`), plus 1/n of the time from
    the last completion to `end` (the batched VQ decode). The shares sum to end - start."""
    if not done_at:
        return []
    order = sorted(done_at, key=done_at.__getitem__)
    tail = (end - max(done_at.values())) / len(order)
    shares: dict[int, float] = {}
    previous = start
    for j in order:
        shares[j] = done_at[j] - previous + tail
        previous = done_at[j]
    return [shares[j] for j in sorted(shares)]


def make_decoder(loaded: LoadedModel, spec: MethodSpec, backend: Backend, batch_size: int = 1,
                 watch_law: bool = True) -> SlotDecoder:
    """A decoder of `spec` at `batch_size`. `watch_law`: a relaxed method under sampling measures its
    law at one iteration in WATCH_EVERY (`runtime.core.law.bound_warning`); tools that time decoders
    against each other turn it off."""
    if spec.needs_drafter and loaded.drafter is None:
        raise UserError(f"method {spec.method} needs a drafter: pass --drafter DIR (a LANTERN drafter "
                        "folder), use --method sjd (no drafter needed) or --method ar")
    check_published_support(spec, loaded.config.vocab_size)
    neighbours = neighbours_for(loaded.vq, spec, loaded.config.vocab_size)
    with out_of_memory_as_user_error(None, backend, batch_size):
        decoder = new_decoder(loaded.target, loaded.drafter, spec, neighbours=neighbours, backend=backend,
                              batch_size=batch_size)
    if watch_law and watches_law(spec):
        decoder.measure_law, decoder.law_every = True, WATCH_EVERY
    return decoder


def check_published_support(spec: MethodSpec, vocab_size: int) -> None:
    """pjd's released loop (`--accept published`) under sampling cannot keep a support filter: a
    later row's token is drawn under its draft context, so a token outside the final context's
    top-k / top-p set can be kept (measured: 345 of 3,600 sequences under top-k 2 were ones AR's
    top-k 2 cannot make). Refused where the filter removes anything (docs/methods.md)."""
    s = spec.sampling
    if spec.method != "pjd" or spec.accept != "published" or s.greedy:
        return
    if 0 < s.top_k < vocab_size or s.top_p < 1.0:
        what = f"top-k {s.top_k}" if 0 < s.top_k < vocab_size else f"top-p {s.top_p:g}"
        raise UserError(f"--accept published cannot keep {what} (from a flag, the profile or the model's default): "
                        "its later rows draw under draft context, so tokens outside the final context's set are "
                        "kept; give --top-k 0 --top-p 1 to run the released rule unfiltered, --accept exact, or "
                        "--greedy")


def timed_many(decoder: SlotDecoder, work: list[tuple[torch.Tensor, torch.Tensor | None, int]], backend: Backend
               ) -> tuple[list[torch.Tensor], float]:
    """Decode `work` (`Decoder.generate_many`'s items) after an untimed pass over its first batch
    (captures and warms the steps); (tokens per image, synchronised wall seconds of the timed pass)."""
    decoder.generate_many(work[: decoder.config.batch])
    backend.synchronize()
    start = time.perf_counter()
    tokens, _ = decoder.generate_many(work)
    backend.synchronize()
    return tokens, time.perf_counter() - start


@contextlib.contextmanager
def out_of_memory_as_user_error(decoder: SlotDecoder | None, backend: Backend, batch_size: int | None = None):
    """Turn the device's out-of-memory error into one line naming a batch size that should fit.

    The decode state (KV caches, p/q buffers) grows linearly with the batch; the suggestion is
    the largest batch whose state, counted twice for activations and workspace, fits in the
    memory the device reports free once this attempt's buffers are released.
    """
    try:
        yield
    except torch.OutOfMemoryError:
        b = decoder.config.batch if decoder is not None else batch_size or 1
        per_image = decoder.state_bytes() / b if decoder is not None else None
        decoder = None
        free = backend.free_memory() if backend is not None else None
        hint = ""
        if per_image and free:
            fits = int(free // (2 * per_image))
            hint = (f"; its decode state takes about {per_image / 2**20:.0f} MiB per image and "
                    f"{free / 2**30:.1f} GiB are free, so --batch-size {max(fits, 1)} should fit")
            if fits < 1:
                hint += " (if even 1 does not: a smaller tree, --dtype bf16, or a larger device)"
        elif b > 1:
            hint = f"; try --batch-size {b // 2}"
        raise UserError(f"batch size {b} does not fit in {backend.name} memory (out of memory){hint}") from None
