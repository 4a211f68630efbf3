"""The CPU backend's small linear layers in graph mode: each matmul of a few rows written as a
multiply and a sum, which inductor compiles into a loop fused with its neighbours.

Why: a decoding step of a small model (the demo: 16 layers of width 128, 81 matmuls over 16-65
thousand weights each) multiplies 2-8 rows by every weight. Inside a model whose weights do not
fit the core's L2 cache, MKL's GEMM takes 26-37 us per such call (one thread, AMD EPYC: the
weights arrive at about 7 GB/s, a fifth of what a plain read of them gets), and oneDNN's packed
path (`backends.cpu_packing`) more, its fixed cost per call being larger. As
`(x[..., None, :] * W).sum(-1)` inductor reads each weight row once per input row in a vectorised
loop and fuses the norm or activation before it; the demo's compiled target forward with CFG
went from 5.39 to 3.35 ms at 1 token (2 rows) and from 5.28 to 4.51 ms at 4 tokens (8 rows)
(`results/cpu_speed/demo_verify_sweep_graph.json`). At 16 rows the reduction loses (8.8 against
11.9 ms in a first test: the horizontal sums grow with the rows), so it runs up to
`MAX_ROWS` rows and the layer's plain matmul beyond. Where a model's small weights stay in L2
from one call to the next (a one-layer drafter run once per draft level: 1 MB of them against
this core's 1 MiB L2), MKL's kernel is the faster one (the demo's chain3 draft: 1.07 ms plain,
1.33 ms reduced), so only a model with more than `L2_MULTIPLE` x L2 of small weights is reduced.

Only the compiled steps change (`torch.compiler.is_compiling()`); an eager step runs `F.linear`
as before. The compiled sum adds in another order than MKL, so logits move by fp32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backends.cpu_packing import MIN_PACKED_ELEMENTS, addmm_linear, cpu_linears
from backends.layer_swap import restore_class, swap_class

# rows of one matmul up to which the reduction wins (measured: 8 wins, 16 loses; see above)
MAX_ROWS = 8
# a model is reduced where its small weights exceed this many times the core's L2 cache
L2_MULTIPLE = 2
_L2_FALLBACK = 1 << 20


def l2_bytes() -> int:
    """The L2 cache of CPU 0 in bytes (Linux sysfs), else 1 MiB."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in sorted(base.glob("index*")):
            if (index / "level").read_text().strip() == "2" and (index / "type").read_text().strip() != "Instruction":
                size = (index / "size").read_text().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
                return int(size.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return _L2_FALLBACK


def _reduced(x: Tensor) -> bool:
    """Whether the matmul of x (..., in) runs as the reduction: in a compiled step, <= MAX_ROWS rows."""
    return torch.compiler.is_compiling() and x.numel() <= MAX_ROWS * x.size(-1)


def _reduce(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T as a multiply and a sum over the input features; x (..., in) -> (..., out)."""
    return (x.unsqueeze(-2) * weight).sum(-1)


class ReducedLinear(nn.Linear):
    """An `nn.Linear` whose matmul of at most MAX_ROWS rows, in a compiled step, is a multiply
    and a sum over the input features; x (..., in) -> (..., out)."""

    def forward(self, x: Tensor) -> Tensor:
        if not _reduced(x):
            return F.linear(x, self.weight, self.bias)
        out = _reduce(x, self.weight)
        return out if self.bias is None else out + self.bias

    def add_into(self, x: Tensor, inp: Tensor) -> Tensor:
        """x + self(inp) for a bias-free layer (the drafter's `add_linear`): the reduction's sum
        added in the same loop where it runs, else one addmm. x (..., out), inp (..., in)."""
        if _reduced(inp):
            return x + _reduce(inp, self.weight)
        return addmm_linear(x, inp, self.weight)


def small_linears(module: nn.Module) -> list[nn.Linear]:
    """The layers `reduce_small_linears` swaps: the CPU backend's linears (`cpu_linears`) below
    the packing threshold (`MIN_PACKED_ELEMENTS`)."""
    return [m for m in cpu_linears(module) if m.weight.numel() < MIN_PACKED_ELEMENTS]


def reduce_small_linears(module: nn.Module, min_bytes: int | None = None) -> int:
    """Make every layer of `small_linears(module)` a `ReducedLinear` (idempotent) where their
    weights total more than `min_bytes` (default: L2_MULTIPLE x `l2_bytes()`); returns how many
    layers read their weights reduced (0: the module is left as it is)."""
    layers = small_linears(module)
    floor = L2_MULTIPLE * l2_bytes() if min_bytes is None else min_bytes
    if sum(m.weight.numel() * m.weight.element_size() for m in layers) <= floor:
        return 0
    for layer in layers:
        swap_class(layer, ReducedLinear)
    return len(layers)


def restore_small_linears(module: nn.Module) -> int:
    """Undo `reduce_small_linears`; returns how many layers took their own classes back."""
    return sum(restore_class(layer, ReducedLinear) for layer in list(module.modules()))
