"""Building blocks shared by the LlamaGen GPT and the EAGLE/LANTERN drafter."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.errors import UserError
from runtime.models.kv_cache import StaticKVCache

# Which scaled-dot-product-attention kernel `attend` asks for (`--attention`):
#   "auto": PyTorch picks (flash / memory-efficient / math, whatever fits the inputs);
#   "math": the math kernel only, as LlamaGen's sampling forces it. In bf16 the fused kernels
#           accumulate differently, and tokens part from the reference after 15-20 tokens.
# One process-wide setting, read when a step runs or is traced: torch.compile guards on it
# (a change recompiles) and a captured graph keeps the kernel it was captured with, so set it
# before building the decoder. fp32 results agree between the two up to rounding.
ATTENTION_KERNELS: tuple[str, ...] = ("auto", "math")
_attention_kernel = "auto"


def set_attention_kernel(name: str) -> str:
    """Make every `attend` call use kernel `name` ("auto" or "math"); returns the previous one."""
    global _attention_kernel
    if name not in ATTENTION_KERNELS:
        raise UserError(f"--attention {name!r} is not a kernel setting; choose "
                        f"{' or '.join(ATTENTION_KERNELS)} (math: LlamaGen's reference kernel)")
    previous, _attention_kernel = _attention_kernel, name
    return previous


def attention_kernel() -> str:
    """The kernel setting `attend` uses now ("auto" or "math")."""
    return _attention_kernel


@contextmanager
def use_attention_kernel(name: str) -> Iterator[None]:
    """`set_attention_kernel(name)` for the duration of a `with` block, then the previous one."""
    previous = set_attention_kernel(name)
    try:
        yield
    finally:
        set_attention_kernel(previous)


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps), computed in fp32, cast back, then scaled by `weight`."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive mask (0 where allowed, -inf elsewhere) that
    scaled_dot_product_attention builds from it: built once per forward, not once per layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer: int,
           cache: StaticKVCache | None, slots: torch.Tensor | None,
           mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention, through the static cache when one is given.

    q: (B, H, T, D); k, v: (B, KV, T, D) for the T new tokens (already rotated).
    With a cache, k and v are stored at `slots` and attention reads all `capacity` slots
    under `mask` (B, 1, T, capacity), bool or additive (`additive_mask`). Without one, `mask` is (B, 1, T, T) or None (causal).
    Returns (B, H, T, D).
    """
    if cache is not None:
        cache.write(layer, slots, k, v)
        k, v = cache.k[layer], cache.v[layer]
    if k.size(1) != q.size(1):
        rep = q.size(1) // k.size(1)
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if _attention_kernel == "math":
        with sdpa_kernel(SDPBackend.MATH):
            return _sdpa(q, k, v, mask)
    return _sdpa(q, k, v, mask)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x). Names are parameterised so the drafter can keep HF names."""

    def __init__(self, dim: int, hidden: int, names: tuple[str, str, str] = ("w1", "w3", "w2")) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(dim, hidden, bias=False))
        setattr(self, up, nn.Linear(dim, hidden, bias=False))
        setattr(self, down, nn.Linear(hidden, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))
