"""A static, preallocated KV cache shared by the target and the drafter.

Shapes never depend on how many tokens were accepted: capacity is fixed when the cache is
built, the fill length lives in a 0-d device tensor, new blocks are written at slots
`length + arange(T)`, and accepted tree paths are compacted into place with index ops. This
is what lets a decoding step be captured once as a device graph and replayed.

Slot == sequence position for every committed token. Uncommitted slots (a tree that was
just verified) sit after `length` and are invisible to later blocks until compacted.

Keys (and values) of all layers live in one buffer (n_layer, batch, kv_heads, capacity,
head_dim); each layer writes its own view with `index_put_`, which a compiler
(torch.compile) updates in place (measured: no copy of the buffer per write). One buffer
(keys and values together, `kv_all`) makes the commit two index ops per cache whatever the
depth of the model, instead of two per layer and tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


# the slot key of a padded condition position: past any column of a mask table
PADDED = 1 << 40


CAPACITY_MULTIPLE = 16  # slots: 16-byte mask rows in bf16 / fp16 and 64-byte in fp32


class StaticKVCache:
    """Keys and values for `n_layer` layers.

    kv_all: (2, n_layer, batch, kv_heads, capacity, head_dim), model dtype: keys, then values.
    k_all, v_all: its views kv_all[0], kv_all[1].
    k, v: lists of the n_layer views k_all[i], v_all[i] (batch, kv_heads, capacity, head_dim).
    length: (batch,) int64 on the device; committed slots of each row (rows of a batch of
        images grow independently: each image accepts its own number of tokens).
    slot_key: (batch, capacity) long; slot + 1, or `PADDED` on a padded condition position
        (`mark_prefix`; `prefix_valid` reads it as bool): what `mask_columns` offsets by
        the length, so a padded slot lands in the "beyond" column with no extra kernel.
    prefix_valid: (batch, capacity) bool, read-only; False only on padded condition positions (t2i
        captions are left-padded). Slots >= length are masked by `length`, not by this.
    """

    def __init__(self, n_layer: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        # Rows of the additive mask (..., capacity) must start 16-byte aligned: the fused attention
        # kernels (cuDNN, memory-efficient) read them vectorised, and a 267-slot drafter cache
        # faulted with "misaligned address" on an H200 in bf16. Slots past the asked capacity
        # are never written and always masked (they lie "beyond" every block).
        capacity = -(-capacity // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
        shape = (batch, kv_heads, capacity, head_dim)
        # keys and values in one buffer, so the commit moves both with one index op
        self.kv_all = torch.zeros((2, n_layer, *shape), device=device, dtype=dtype)
        self.k_all, self.v_all = self.kv_all[0], self.kv_all[1]
        self.k = [self.k_all[i] for i in range(n_layer)]
        self.v = [self.v_all[i] for i in range(n_layer)]
        self.length = torch.zeros(batch, device=device, dtype=torch.long)
        self.slot_ids = torch.arange(capacity, device=device)
        self.slot_ids_1 = self.slot_ids + 1
        self.slot_key = self.slot_ids_1.repeat(batch, 1)
        # the two values of an additive mask, made here: a captured step must not allocate constants
        self._zero = torch.zeros((), device=device, dtype=dtype)
        self._neg_inf = torch.full((), float("-inf"), device=device, dtype=dtype)
        self.row_ids = torch.arange(batch, device=device)[:, None]
        self.capacity = capacity
        self.batch = batch
        # a backend's own attention over this cache, (q, k, v, mask) -> out or None where it does
        # not serve those inputs (`layers.attend` then runs SDPA); set by the decoding core
        self.attention: Callable[..., torch.Tensor | None] | None = None

    def reset(self) -> None:
        """Empty the cache in place (keeps buffers, so captured graphs stay valid)."""
        self.length.zero_()
        self.slot_key.copy_(self.slot_ids_1.expand_as(self.slot_key))

    @property
    def prefix_valid(self) -> torch.Tensor:
        """(batch, capacity) bool: False on padded condition positions (`mark_prefix`)."""
        return self.slot_key != PADDED

    def mark_prefix(self, valid: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Mark the first valid.size(1) slots of `rows` (long ids; all rows if None) as valid
        prefix positions or not: valid (len(rows) or batch, w) bool (a caption's left padding
        is False). Between steps, not inside a captured one."""
        w = valid.size(1)
        key = torch.where(valid, self.slot_ids_1[:w], PADDED)
        if rows is None:
            self.slot_key[:, :w] = key
        else:
            self.slot_key[rows, :w] = key

    def block_slots(self, block_len: int, offset: int = 0) -> torch.Tensor:
        """Slots of a block of `block_len` new tokens per row, (batch, block_len):
        length + offset + arange(block_len), one add (the offset rides on the slice)."""
        return self.length[:, None] + self.slot_ids[offset: offset + block_len]

    def mask_columns(self, width: int) -> torch.Tensor:
        """(batch, capacity) long: each slot's column in a [committed | block of `width` | beyond]
        table, for `additive_mask_from`. A padded condition slot (prefix_valid False, always
        committed) reads the "beyond" column: its key `PADDED` clamps there. Depends only on
        `length`, so a caller that builds several masks against one length (the levels of a
        draft) computes it once."""
        return (self.slot_key - self.length[:, None]).clamp(0, width + 1)

    def additive_mask_from(self, columns: torch.Tensor, width: int, block_mask: torch.Tensor) -> torch.Tensor:
        """Additive mask (batch, 1, T, capacity) in the cache dtype: 0 where a query sees a slot,
        -inf elsewhere (what scaled_dot_product_attention makes of a boolean mask).

        columns: `mask_columns(width)`; block_mask: (T, w) or per row (batch, T, w) with
        w <= width: which of the uncommitted slots length .. length+w-1 each query sees (the
        block's slots past w are masked), bool or already additive in the cache dtype
        (`additive`: a caller whose block mask is fixed converts it once). Three kernels: a
        where (none for an additive block), a cat and a gather.
        """
        t, w = block_mask.shape[-2:]
        block = block_mask if block_mask.is_floating_point() else self.additive(block_mask)
        block = block.expand(self.batch, t, w)
        table = torch.cat([self._zero.expand(self.batch, t, 1), block,
                           self._neg_inf.expand(self.batch, t, width - w + 1)], 2)
        return table.gather(2, columns[:, None, :].expand(self.batch, t, self.capacity))[:, None]

    def additive(self, mask: torch.Tensor) -> torch.Tensor:
        """A bool mask as 0 (True) / -inf (False) in the cache dtype, same shape."""
        return torch.where(mask, self._zero, self._neg_inf)

    def additive_mask(self, block_mask: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Additive mask (batch, 1, T, capacity) for a block of T new tokens over the whole cache.

        A query sees every committed slot (< length) that is a valid prefix position, plus the
        uncommitted slots length .. length+offset+T-1 where `block_mask` allows: shape
        (T, offset+T) or per row (batch, T, offset+T), bool or additive (`additive_mask_from`).
        `offset` > 0 is used when a tree is
        written level by level: earlier levels sit at length .. length+offset-1.
        """
        width = block_mask.size(-1)
        return self.additive_mask_from(self.mask_columns(width), width, block_mask)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (batch, kv_heads, T, head_dim) of `layer` at `slots` (batch, T)."""
        self.k[layer][self.row_ids, :, slots] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][self.row_ids, :, slots] = v.transpose(1, 2).to(self.v[layer].dtype)

    def commit(self, path: torch.Tensor, count: torch.Tensor) -> None:
        """Keep each row's accepted path of the block written at its `length`, advance `length`.

        path: (batch, M) long, block-relative indices of the accepted nodes in order (root
            first); entries at and after `count` are ignored (may be any valid index).
        count: (batch,) long, accepted nodes per row (0 <= count <= M; 0 keeps a finished
            image's row as it is).
        Slots length + path[j] move to length + j for all j < M; only the first `count`
        become committed, the rest lie beyond the new length and are never read.
        """
        src = self.length[:, None] + path
        dst = self.length[:, None] + self.slot_ids[: path.size(1)]
        self.kv_all[:, :, self.row_ids, :, dst] = self.kv_all[:, :, self.row_ids, :, src]  # gathered before the write
        self.length.add_(count)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empty `rows` (long ids) only."""
        self.length.index_fill_(0, rows, 0)
        self.slot_key[rows] = self.slot_ids_1

    def load_rows(self, rows: torch.Tensor, src: "StaticKVCache") -> None:
        """Make `rows` (long ids) hold exactly what `src` (len(rows) rows, same layers) holds:
        its committed slots copied in, its length and prefix validity. Used to start one image
        of a batch while the others keep their state."""
        n = src.capacity
        for buf, part in ((self.k_all, src.k_all), (self.v_all, src.v_all)):
            buf[:, rows, :, :n] = part
        self.length.index_copy_(0, rows, src.length)
        self.slot_key[rows] = self.slot_ids_1
        self.slot_key[rows, :n] = src.slot_key

    def advance(self, count: int | torch.Tensor) -> None:
        """Commit the first `count` slots (an int, or (batch,) per row) of the last block as
        written (prefill, AR)."""
        self.length.add_(count)
