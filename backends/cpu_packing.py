"""Prepacked weights for the CPU backend's linear layers.

Why: a verify or draft step multiplies a few rows (M = rows x tree tokens, 1-120) by every
weight. PyTorch's `F.linear` hands an fp32 matmul to MKL, whose GEMM for 2 <= M <= 16 streams
the weights at a third to a half the rate its M = 1 GEMV does (measured on the XL shape's
matrices, one thread, AMD EPYC: 1280 x 3840 at M = 4 took 2.05 ms against 0.84 ms at M = 1).
A weight reordered once into a blocked layout reads at the memory's rate instead: fp32 weights,
and bf16 ones where the CPU has AVX512-BF16, into the panels of `backends.cpu_kernels` (its own
kernel: the full read rate at 1-8 rows, and ahead of the libraries' kernels up to 116); the rest,
and everything where that kernel cannot be built, into oneDNN's layout, whose matmul reads them
at the GEMV's rate up to M ~ 8.

How: `pack_linears(module)` reorders the weight of every `nn.Linear` large enough to gain
(`MIN_PACKED_ELEMENTS`) and swaps the layer's class for a subclass whose matmul is
`packed_linear` (`backends.layer_swap`); parameters, state-dict keys and hooks stay as they were.
The packed copy sits in a table keyed by the weight's storage, checked against the weight's
version counter on every call, so a weight changed in place (training) silently falls back to
`F.linear` until packed again. Under `torch.compile` the matmul is the custom op
`lantern_cpu::packed_linear` (inductor calls it as an extern kernel; a packed tensor cannot be a
graph input). Costs: a second copy of the packed weights in memory, so a model is packed only
where the host has room. The layers below the threshold are `backends.cpu_small_linear`'s.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backends.layer_swap import restore_class, swap_class
from runtime.utils.host_memory import host_free_bytes

log = logging.getLogger(__name__)

# weights of fewer elements lose: below ~ 256 x 768 the oneDNN call's fixed cost (about 10 us)
# exceeds what the layout saves (the demo's 128 x 384 layers: 17 us packed against 9 us)
MIN_PACKED_ELEMENTS = 1 << 17
# the row count oneDNN's layout is chosen for: 16 serves M = 1-116 within a few % of the best
PACK_ROWS_HINT = 16
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class _Packed:
    weight: weakref.ref[Tensor]
    version: int
    packed: Tensor  # oneDNN layout (torch._mkldnn), or the row kernel's panels (`rows`)
    rows: bool = False  # packed for `backends.cpu_kernels` (`Kernel.packs` its dtype)


# storage address -> packed copy; an entry dies with its weight (`weakref.finalize`)
_TABLE: dict[tuple[int, torch.dtype, tuple[int, ...]], _Packed] = {}


def _key(weight: Tensor) -> tuple[int, torch.dtype, tuple[int, ...]]:
    return weight.data_ptr(), weight.dtype, tuple(weight.shape)


def _lookup(weight: Tensor) -> _Packed | None:
    entry = _TABLE.get(_key(weight))
    if entry is None or entry.version != weight._version or entry.weight() is None:
        return None
    return entry


def _row_kernel() -> Any:
    from backends.cpu_kernels import load

    return load()


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    entry = _lookup(weight)
    if entry is not None and entry.rows:
        if x.dtype != weight.dtype:  # the kernel multiplies in the weight's dtype only
            return F.linear(x, weight, bias)
        return cast(Tensor, _row_kernel().matmul(x, entry.packed, weight.size(0), bias))
    rows = x.numel() // max(x.size(-1), 1)
    if entry is None or (rows == 1 and x.dtype == torch.float32):
        return F.linear(x, weight, bias)
    if rows == 2:
        # oneDNN's 2-row kernel streams the weights at ~60 % of its 3-4-row one (13.5 against
        # 22 GB/s on a 4096 x 16384 fp32 weight); two zero rows cost less than that
        flat = x.reshape(2, x.size(-1))
        out: Tensor = torch.ops.mkldnn._linear_pointwise(torch.cat([flat, torch.zeros_like(flat)]), entry.packed,
                                                         bias, "none", [], "")
        return out[:2].view(*x.shape[:-1], -1)
    out = torch.ops.mkldnn._linear_pointwise(x, entry.packed, bias, "none", [], "")
    return out


@torch.library.custom_op("lantern_cpu::packed_linear", mutates_args=())
def _packed_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _linear(x, weight, bias)


@_packed_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.size(0)))


@torch.library.custom_op("lantern_cpu::packed_add_linear", mutates_args=())
def _packed_add_linear_op(x: Tensor, inp: Tensor, weight: Tensor) -> Tensor:
    return _add_linear(x, inp, weight)


@_packed_add_linear_op.register_fake
def _(x: Tensor, inp: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(x)


def addmm_linear(x: Tensor, inp: Tensor, weight: Tensor) -> Tensor:
    """x + inp @ weight.T as one addmm (the plain form of a layer's `add_into`); x (..., out),
    inp (..., in)."""
    lead = x.shape[:-1]
    return torch.addmm(x.reshape(-1, x.size(-1)), inp.reshape(-1, inp.size(-1)), weight.t()).view(*lead, -1)


def _add_linear(x: Tensor, inp: Tensor, weight: Tensor) -> Tensor:
    entry = _lookup(weight)
    if entry is None:
        return addmm_linear(x, inp, weight)
    if entry.rows:
        if inp.dtype != weight.dtype:
            return addmm_linear(x, inp, weight)
        return cast(Tensor, _row_kernel().matmul(inp, entry.packed, weight.size(0), x))
    summed: Tensor = torch.ops.mkldnn._linear_pointwise.binary(inp, x, entry.packed, None, "add")
    return summed


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` through the weight's packed copy where it has a current one;
    x (..., in) -> (..., out)."""
    if torch.compiler.is_compiling():
        return cast(Tensor, _packed_linear_op(x, weight, bias))
    return _linear(x, weight, bias)


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose matmul reads the weight's packed copy (`pack_linears` swaps a
    layer's class to this, or to a subclass of both for an `nn.Linear` subclass)."""

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.weight, self.bias)

    def add_into(self, x: Tensor, inp: Tensor) -> Tensor:
        """x + self(inp), the add a post-op of the matmul, as `torch.addmm(x, inp, W.t())` rounds
        (the drafter's `add_linear`); bias-free layers only. x (..., out), inp (..., in)."""
        if torch.compiler.is_compiling():
            return cast(Tensor, _packed_add_linear_op(x, inp, self.weight))
        return _add_linear(x, inp, self.weight)


def available() -> tuple[bool, str]:
    """Whether this PyTorch can pack (oneDNN built in), and why not."""
    if not torch.backends.mkldnn.is_available():
        return False, "this PyTorch was built without oneDNN (mkldnn)"
    return True, ""


def cpu_linears(module: nn.Module) -> list[nn.Linear]:
    """The `nn.Linear`s of `module` whose weights are fp32 / bf16 on the CPU: what the CPU backend
    prepares, packed (`packable`) or reduced (`backends.cpu_small_linear`) by size."""
    return [m for m in module.modules() if isinstance(m, nn.Linear) and m.weight.device.type == "cpu"
            and m.weight.dtype in PACKABLE_DTYPES]


def packable(module: nn.Module) -> list[nn.Linear]:
    """The layers of `module` that `pack_linears` packs: `cpu_linears` with at least
    MIN_PACKED_ELEMENTS weights."""
    return [m for m in cpu_linears(module) if m.weight.numel() >= MIN_PACKED_ELEMENTS]


def pack_linears(module: nn.Module) -> int:
    """Pack every layer of `packable(module)` that has no current packed copy; returns how many
    layers read packed weights now. Idempotent; leaves the module as it is where this PyTorch
    cannot pack or the host lacks the memory for the copies (logged)."""
    ok, why = available()
    layers = packable(module)
    if not ok or not layers:
        if layers:
            log.info("linear layers not packed: %s", why)
        return 0
    todo = [m for m in layers if _lookup(m.weight) is None]
    need = sum(m.weight.numel() * m.weight.element_size() for m in todo)
    room = host_free_bytes()
    if todo and room is not None and need > room // 2:
        log.warning("linear layers not packed: their packed copies need %.1f GB and %.1f GB is free; "
                    "steps run on the unpacked weights (slower at 2-16 rows)", need / 1e9, room / 1e9)
        return 0
    kernel = _row_kernel() if todo else None
    for layer in todo:
        weight = layer.weight.detach()
        if kernel is not None and kernel.packs(weight.dtype):
            rows, packed = True, kernel.pack(weight)
        else:
            rows, packed = False, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        key = _key(weight)
        _TABLE[key] = _Packed(weakref.ref(layer.weight), layer.weight._version, packed, rows)
        weakref.finalize(layer.weight, _TABLE.pop, key, None)
    for layer in layers:
        swap_class(layer, PackedLinear)
    return len(layers)


def unpack_linears(module: nn.Module) -> int:
    """Undo `pack_linears` on `module`: its layers take their own classes back and their packed
    copies are dropped (a baseline in the same process); returns how many layers it restored."""
    restored = 0
    for layer in module.modules():
        if isinstance(layer, PackedLinear):
            _TABLE.pop(_key(layer.weight), None)
            restored += restore_class(layer, PackedLinear)
    return restored


def packed_count(module: nn.Module) -> int:
    """How many layers of `module` read a current packed copy now."""
    return sum(1 for m in module.modules() if isinstance(m, PackedLinear) and _lookup(m.weight) is not None)
