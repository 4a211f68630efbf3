"""Building blocks shared by the LlamaGen GPT and the EAGLE/LANTERN drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.kv_cache import StaticKVCache


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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer: int,
           cache: StaticKVCache | None, slots: torch.Tensor | None,
           mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention, through the static cache when one is given.

    q: (B, H, T, D); k, v: (B, KV, T, D) for the T new tokens (already rotated).
    With a cache, k and v are stored at `slots` and attention reads all `capacity` slots
    under `mask` (B, 1, T, capacity). Without one, `mask` is (B, 1, T, T) or None (causal).
    Returns (B, H, T, D).
    """
    if cache is not None:
        cache.write(layer, slots, k, v)
        k, v = cache.k[layer], cache.v[layer]
    if k.size(1) != q.size(1):
        rep = q.size(1) // k.size(1)
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
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
