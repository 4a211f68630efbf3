"""LlamaGen's 2D rotary position embedding.

The table has one row per sequence position: `cls_token_num` rows of zeros (condition
positions), then the g x g image grid in row-major order (the VQ raster order), then
`extra_rows` rows of zeros (room for draft tokens that run past the last image token).
A row holds (cos, sin) for each of the head_dim/2 rotation pairs: the first head_dim/4
pairs rotate by the grid row, the last head_dim/4 by the grid column.

Quirk kept on purpose: condition rows are (0, 0), so q and k at condition positions are
multiplied to zero (not left unrotated). The official checkpoints were trained that way.
"""

from __future__ import annotations

import torch


def rope_table_2d(grid_size: int, head_dim: int, base: float = 10000.0,
                  cls_token_num: int = 1, extra_rows: int = 0) -> torch.Tensor:
    """Return the fp32 table, shape (cls_token_num + grid_size**2 + extra_rows, head_dim // 2, 2)."""
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))  # (half//2,)
    t = torch.arange(grid_size, dtype=torch.float32)
    angles = torch.outer(t, freqs)  # (g, half//2)
    grid = torch.cat([
        angles[:, None, :].expand(-1, grid_size, -1),  # row angle
        angles[None, :, :].expand(grid_size, -1, -1),  # column angle
    ], dim=-1)  # (g, g, half)
    table = torch.stack([torch.cos(grid), torch.sin(grid)], dim=-1).flatten(0, 1)  # (g*g, half, 2)
    pad_front = torch.zeros(cls_token_num, half, 2)
    pad_back = torch.zeros(extra_rows, half, 2)
    return torch.cat([pad_front, table, pad_back], dim=0)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2m], x[2m+1]) of `x` (B, S, H, D) by `freqs` (S, D/2, 2),
    or per row by (B, S, D/2, 2).

    Computed in fp32 and cast back to x's dtype, as LlamaGen does.
    """
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = freqs[None, :, None] if freqs.dim() == 3 else freqs[:, :, None]
    x0, x1 = xs[..., 0], xs[..., 1]
    cos, sin = f[..., 0], f[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
    return out.flatten(3).type_as(x)
