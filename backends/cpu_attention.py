"""The CPU backend's attention over the static KV cache: `kernels/attention.cpp` through
`backends.cpu_kernels`, for the few queries of a decoding step.

Why: a step's queries attend over a cache allocated for the whole image, and PyTorch's CPU
kernels read every slot of it, masked or not, copying a grouped-query model's keys once per
query head first; on the Emu3 shape (8,100 slots, 8 KV heads for 32 query heads) that is most of
a step. The kernel reads only the slots some query sees, each KV head in place. It serves fp32
and bf16 steps (computed in fp32) of up to MAX_QUERIES queries with an additive mask; anything else is PyTorch's
(`cached_attention` returns None).

Under `torch.compile` it is the custom op `lantern_cpu::cached_attention` (inductor calls it as an
extern kernel). The softmax is fp32 like PyTorch's, summed in slot order, so logits move by fp32
rounding against SDPA's.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

# queries per step the kernel serves: a verify of 116 tree nodes is better in SDPA's blocked
# matmuls than in per-slot dot products
MAX_QUERIES = 16


def _kernel() -> Any:
    """The loaded `backends.cpu_kernels.Kernel`, or None."""
    from backends.cpu_kernels import load

    return load()


@torch.library.custom_op("lantern_cpu::cached_attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    return cast(Tensor, _kernel().attend(q, k, v, mask))


@_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    return q.new_empty(q.shape)


def serves(q: Tensor, k: Tensor, mask: Tensor | None) -> bool:
    """Whether the kernel takes this attention: fp32 or bf16 on the CPU, an additive mask, at most
    MAX_QUERIES queries, query heads a multiple of the KV heads."""
    return (mask is not None and q.device.type == "cpu" and q.dtype == k.dtype == mask.dtype
            and q.dtype in (torch.float32, torch.bfloat16) and q.size(-2) <= MAX_QUERIES and q.size(1) % k.size(1) == 0 and _kernel() is not None)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor | None:
    """softmax(q k^T / sqrt(D) + mask) v through the kernel, or None where it does not serve
    (`serves`). q (B, H, T, D); k, v (B, KV, S, D); mask (B, 1, T, S). Returns (B, H, T, D)."""
    if not serves(q, k, mask):
        return None
    assert mask is not None
    if torch.compiler.is_compiling():
        return cast(Tensor, _attention_op(q, k, v, mask))
    return cast(Tensor, _kernel().attend(q, k, v, mask))
