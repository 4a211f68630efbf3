"""What a drafting policy may read and write of the decoding loop: a declared interface.

`runtime.core.decoder.Decoder` implements it; the policies (`drafting.py`, `jacobi.py`) are
typed against it, so they depend on this contract and not on the decoder module. Shapes: B
images (`batch`), R model rows (`rows`: 2B with classifier-free guidance, else B), N+1 tree
nodes (node 0 the root), V the vocabulary, M = max_depth + 1 the longest accepted block.
Buffers are allocated once by the loop and keep their identities (graph capture relies on it).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from runtime.core.methods import MethodSpec, SamplingParams
from runtime.core.rng import CounterRNG


class DecodeLoop(Protocol):
    """The loop as a policy sees it."""

    # fixed for the loop's life
    spec: MethodSpec
    params: SamplingParams
    target: Any  # the target model (`runtime.models.gpt.Transformer` or an adapter with its interface)
    drafter: Any  # the drafter model, or None for policies without one
    device: torch.device
    dtype: torch.dtype
    batch: int  # B
    rows: int  # R
    cls: int  # condition positions per row
    vocab: int  # V
    num_tokens: int  # image tokens per image
    max_depth: int  # deepest tree level
    group: Any  # the grouped acceptance rule, or None
    constrain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None  # a layout's fixed tokens
    rng: CounterRNG  # one counter-based stream per image

    # shared buffers (the policy fills `tokens` and `q` in `draft`; the loop owns the rest)
    tokens: torch.Tensor  # (B, N+1) long: node tokens, node 0 the root
    q: torch.Tensor | None  # (B, N+1, V): q[:, i] = the distribution node i's children were drawn from
    p: torch.Tensor  # (B, N+1, V): the target's distribution after each node (verify fills it)
    hidden: torch.Tensor  # (R, N+1, D): the target's last hidden state at each node
    count: torch.Tensor  # (B,) long: tokens known per image, pending root included
    out: torch.Tensor  # (B, num_tokens + 2M + 1) long: each image's tokens so far
    block: torch.Tensor  # (B, M) long: the last accept's new tokens (accepted drafts, then the bonus)
    block_ids: torch.Tensor  # (M,) long: arange(M)
    accepted: torch.Tensor  # (B,) long: the last accept's node count (root included; 0 once done)

    def dist(self, logits: torch.Tensor, depth: torch.Tensor | int | None = None, *, draft: bool = False,
             log: bool = False) -> torch.Tensor:
        """(R, T, V) logits -> (B, T, V) processed distribution (CFG, temperature, top-k/p)."""
        ...

    def expand_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Per-image (B, ...) -> per model row (R, ...)."""
        ...

    def live(self) -> torch.Tensor:
        """(B,) long: 1 for images still generating, 0 for those done."""
        ...
