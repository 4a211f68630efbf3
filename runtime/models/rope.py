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


def rotation_table(table: torch.Tensor) -> torch.Tensor:
    """(P, D/2, 2) (cos, sin) rows -> (P, D/2, 2, 2) rows [[cos, cos], [-sin, sin]] for `apply_rope`."""
    cos, sin = table[..., 0], table[..., 1]
    return torch.stack([torch.stack([cos, cos], -1), torch.stack([-sin, sin], -1)], -2)


def apply_rope(x: torch.Tensor, rot: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs (x[2m], x[2m+1]) of `x` (B, S, H, D) by `rot` rows (S, D/2, 2, 2)
    of `rotation_table`, or per row by (B, S, D/2, 2, 2).

    x * (cos, cos) + swap(x) * (-sin, sin) is LlamaGen's (x0 cos - x1 sin, x1 cos + x0 sin)
    bit for bit (a + (-b) == a - b in IEEE arithmetic) in four kernels instead of seven.
    Computed in fp32 and cast back to x's dtype, as LlamaGen does. `fused` (the drafter):
    the second product and the sum as one addcmul, three kernels; it may round differently
    (a fused multiply-add), so the target keeps the four.
    """
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = rot[None, :, None] if rot.dim() == 4 else rot[:, :, None]
    if fused:
        out = torch.addcmul(xs * f[..., 0, :], xs.flip(-1), f[..., 1, :])
    else:
        out = xs * f[..., 0, :] + xs.flip(-1) * f[..., 1, :]
    return out.flatten(3).type_as(x)


def rope_table_1d(positions: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Plain 1-D rotary table (positions, head_dim // 2, 2) of (cos, sin): pair m of position p
    rotates by p / base**(2m / head_dim). For drafters of targets with 1-D positions (Chameleon)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), freqs)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
