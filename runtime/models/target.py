"""The model interfaces the decoding core uses, declared: the target's (`Target`) and the
drafter's (`DrafterModel`); and the cached-decoding half both target families share
(`CachedDecoding`): a LlamaGen GPT (`gpt.Transformer`) and a Chameleon-family decoder
(`chameleon.ChameleonTarget`) differ only in how they embed a condition and which rotary table
they use. The drafters (`drafter.Drafter`, `chameleon_drafter.ChameleonDrafter`) likewise differ
only in their embedding and rotary layout.

Shapes: B model rows, T new positions, D the width, V the image-token vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from runtime.models.kv_cache import StaticKVCache
from runtime.models.layers import PrefixRule, run_prefix


class TokenTable(Protocol):
    """An image-token embedding: ids (...) -> (..., D) rows of `weight` (V, D), whose device and
    dtype are the model's."""

    weight: torch.Tensor

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor: ...


class Target(Protocol):
    """What `runtime.core` calls on a target model."""

    config: Any  # block_size (image tokens), cls_token_num (condition positions), vocab_size V, dim D, ...

    @property
    def tok_embeddings(self) -> TokenTable:
        """Image token ids (...) -> (..., D)."""
        ...

    # a layout's fixed tokens: constrain(logits (B, T, V), image index (B, T)) -> logits, or None
    constrain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None

    @property
    def max_position(self) -> int:
        """Largest sequence position the rotary table covers, plus one."""
        ...

    @property
    def row_width(self) -> int:
        """Image tokens per row, a row-end token included (a square grid's side where none)."""
        ...

    @property
    def row_end(self) -> int:
        """The token that ends every image row (Lumina-mGPT's, Emu3's), or -1 (a plain grid)."""
        ...

    def new_cache(self, batch: int, capacity: int, device: torch.device | str,
                  dtype: torch.dtype | None = None) -> StaticKVCache: ...

    def prefill(self, cond: torch.Tensor, cache: StaticKVCache,
                cond_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The condition into an empty cache; hidden states (B, cls, D)."""
        ...

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor,
                       cache: StaticKVCache, offset: int = 0) -> torch.Tensor:
        """A block of T inputs (B, T, D) through the cache without committing; hidden (B, T, D)."""
        ...

    def forward_at(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                   cache: StaticKVCache) -> torch.Tensor:
        """T inputs (B, T, D) written at the caller's slots (B, T), attending under an additive
        mask (B, 1, T, capacity); hidden (B, T, D)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., V) fp32. Where it is linear in hidden (no bias) drafts mix guidance
        before it; a target whose head is not (Janus's MLP) sets `linear_head = False`."""
        ...

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor: ...

    def null_condition_mask(self, cond_mask: torch.Tensor) -> torch.Tensor: ...


class DrafterModel(Protocol):
    """What `runtime.core` calls on a drafter model: a head that pairs each token with the hidden
    state that predicted it, over its own KV cache.

    Shapes: B model rows, T new positions, D the drafter's width (`config.hidden_size`, the
    target's D).
    """

    config: Any  # hidden_size D, condition_context ("all" / "valid": which condition positions it sees), ...

    def new_cache(self, batch: int, capacity: int, device: torch.device | str,
                  dtype: torch.dtype | None = None) -> StaticKVCache: ...

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotary rows for positions (T,) or (B, T)."""
        ...

    def block_context(self, positions: torch.Tensor, block_mask: torch.Tensor, cache: StaticKVCache,
                      offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rotary rows, cache slots (B, T), additive mask (B, 1, T, capacity)) of a block of
        T = block_mask.size(-2) tokens: what `forward_block` takes."""
        ...

    def forward_block(self, tokens: torch.Tensor, hidden: torch.Tensor, rot: torch.Tensor,
                      slots: torch.Tensor, mask: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """(B, T) tokens and (B, T, D) hidden states with their context -> (B, T, D); keys and
        values written at `slots`, uncommitted."""
        ...

    def forward_cached(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                       block_mask: torch.Tensor, cache: StaticKVCache, offset: int = 0) -> torch.Tensor:
        """`forward_block` with its context built here (`block_context`)."""
        ...


class CachedDecoding:
    """`new_cache`, `prefill` and `forward_cached` for a decoder whose subclass provides
    `config` (n_layer, kv_heads, head_dim), `layers`, `norm`, `embed_prefix(cond)` -> (B, cls, D)
    and `rotary(positions)` -> the rotation its layers take."""

    constrain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # `logits` is linear in the hidden state (no bias), so drafts mix guidance before it (Janus: False)
    linear_head: bool = True
    # what a padded condition's queries see in the prefill (`run_prefix`); None: nothing but
    # themselves hidden too
    prefix_rule: PrefixRule | None = None

    @property
    def row_width(self) -> int:
        """Image tokens per row, a row-end token included (a square grid's side where none)."""
        return int(self.config.grid_size)  # type: ignore[attr-defined]

    @property
    def row_end(self) -> int:
        """The token that ends every image row, or -1 (a plain grid)."""
        return -1

    def new_cache(self, batch: int, capacity: int, device: torch.device | str,
                  dtype: torch.dtype | None = None) -> StaticKVCache:
        cfg = self.config  # type: ignore[attr-defined]
        return StaticKVCache(cfg.n_layer, batch, cfg.kv_heads, cfg.head_dim, capacity, device,
                             dtype or self.tok_embeddings.weight.dtype)  # type: ignore[attr-defined]

    def prefill(self, cond: torch.Tensor, cache: StaticKVCache,
                cond_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the condition positions 0..cls-1 into an empty cache; returns hidden (B, cls, D)."""
        return run_prefix(self, self.embed_prefix(cond), cache, cond_mask,  # type: ignore[attr-defined]
                          self.prefix_rule)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor,
                       cache: StaticKVCache, offset: int = 0) -> torch.Tensor:
        """Run a block of T new inputs through the cache without committing it.

        x: (B, T, D) input embeddings (see `tok_embeddings`), written at slots
        `cache.length + arange(T)` of each row; positions: (T,) or per row (B, T) rotary rows;
        block_mask: (T, T) or (B, T, T) bool, which new tokens each new token sees (itself and its
        tree ancestors). Returns post-norm hidden states (B, T, D). The caller commits with
        `cache.commit`.
        """
        return self.forward_at(x, positions, cache.block_slots(x.size(1), offset),
                               cache.additive_mask(block_mask, offset), cache)

    def forward_at(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                   cache: StaticKVCache) -> torch.Tensor:
        """Run T new inputs x (B, T, D) with their KV written at the caller's `slots` (B, T) (distinct
        within a row) and attention over the whole cache under `mask` (B, 1, T, capacity), additive
        in the cache dtype. positions: (B, T) rotary rows. Returns post-norm hidden (B, T, D); the
        cache's `length` is not read or moved (a caller keeping tokens out of raster order, the
        published pjd loop, tracks validity itself)."""
        rotation = self.rotary(positions)  # type: ignore[attr-defined]
        for i, layer in enumerate(self.layers):  # type: ignore[attr-defined]
            x = layer(x, rotation, layer=i, cache=cache, slots=slots, mask=mask)
        return self.norm(x)  # type: ignore[attr-defined]
