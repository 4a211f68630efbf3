"""Building blocks shared by the LlamaGen GPT and the EAGLE/LANTERN drafter."""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Callable
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.utils.errors import UserError
from runtime.models.kv_cache import StaticKVCache

# Which scaled-dot-product-attention kernel `attend` asks for (`--attention`):
#   "auto": PyTorch picks (flash / memory-efficient / math, whatever fits the inputs);
#   "math": the math kernel only, as LlamaGen's sampling forces it. In bf16 the fused kernels
#           accumulate differently, and tokens part from the reference after 15-20 tokens.
# One process-wide setting, read when a step runs or is traced: a captured graph keeps the kernel
# it was captured with (the CPU's compiled steps replay without dynamo's guard check, CUDA graphs
# replay as recorded), so set it before building the decoder. fp32 results agree between the two
# up to rounding.
ATTENTION_KERNELS: tuple[str, ...] = ("auto", "math")
_attention_kernel = "auto"


def check_attention_kernel(name: str) -> None:
    """Refuse a kernel setting other than ATTENTION_KERNELS, in one line."""
    if name not in ATTENTION_KERNELS:
        raise UserError(f"--attention {name!r} is not a kernel setting; choose "
                        f"{' or '.join(ATTENTION_KERNELS)} (math: LlamaGen's reference kernel)")


def set_attention_kernel(name: str) -> str:
    """Make every `attend` call use kernel `name` ("auto" or "math"); returns the previous one."""
    global _attention_kernel
    check_attention_kernel(name)
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
    """y = x * rsqrt(mean(x^2) + eps), computed in fp32, cast back, then scaled by `weight`.

    `fused`: the same function in four kernels instead of six, as
    sqrt(D) * x / hypot(||x||, sqrt(D * eps)) (one norm, one hypot, one addcdiv, then the
    weight). It rounds differently, so only the drafter uses it; the target computes LlamaGen's
    arithmetic bit for bit.
    """

    def __init__(self, dim: int, eps: float = 1e-5, fused: bool = False) -> None:
        super().__init__()
        self.eps, self.fused, self.scale = eps, fused, dim**0.5
        self.weight = nn.Parameter(torch.ones(dim))
        if fused:  # fp32 constants, kept out of the state dict
            self.register_buffer("_floor", torch.tensor((dim * eps) ** 0.5), persistent=False)
            self.register_buffer("_zero", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.fused:
            norm = torch.hypot(torch.linalg.vector_norm(xf, dim=-1, keepdim=True), self._floor)
            normed = torch.addcdiv(self._zero, xf, norm, value=self.scale)
        else:
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def add_linear(x: torch.Tensor, inp: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """x + linear(inp) as one matmul that accumulates into x (addmm), for a bias-free
    `linear`; x (..., out), inp (..., in). Rounds as a fused add does, so the drafter uses it
    and the target keeps LlamaGen's separate add."""
    accumulate = getattr(linear, "add_into", None)  # a layer a backend prepared (`prepare_inference`)
    if accumulate is not None:
        return accumulate(x, inp)
    lead = x.shape[:-1]
    out = torch.addmm(x.reshape(-1, x.size(-1)), inp.reshape(-1, inp.size(-1)), linear.weight.t())
    return out.view(*lead, x.size(-1))


def prefix_mask(cond_mask: torch.Tensor, s: int) -> torch.Tensor:
    """Causal (B, s, s) mask of a sequence starting with a left-padded condition (B, cls): padded
    condition columns removed, the diagonal kept (a padded query sees itself, so no row is empty)."""
    cls = cond_mask.size(1)
    eye = torch.eye(s, dtype=torch.bool, device=cond_mask.device)
    causal = torch.ones(s, s, dtype=torch.bool, device=cond_mask.device).tril()
    cols = torch.ones(cond_mask.size(0), s, dtype=torch.bool, device=cond_mask.device)
    cols[:, :cls] = cond_mask
    return (causal[None] & cols[:, None, :]) | eye[None]


def reference_prefix_mask(cond_mask: torch.Tensor, s: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, s, s) bool: the keys each query of a sequence that starts with a left-padded condition
    (B, cls) attends to, as LANTERN's reference LlamaGen target computes it
    (`models/kv_variants/modeling_llamagen_kv.py`, whose states LANTERN's t2i drafters were
    trained on).

    The reference adds two additive masks: the causal one in fp32 (`finfo(float32).min` above the
    diagonal) and the caption padding one in the model dtype (`finfo(dtype).min` on padded
    columns), sums them in fp32 (two minima overflow to -inf) and takes a softmax in fp32. A row's
    weight lands on the entries equal to its maximum: a valid query sees the valid keys up to
    itself (as in official LlamaGen); a padded query sees the padded keys up to itself and, in fp32
    only, every valid key after it (there fp32's and the dtype's minimum are the same number; in
    bf16 / fp16 the dtype's minimum is the larger one and wins). The minimum swamps the scores, so
    the reference spreads such a row uniformly over its keys; LlamaGen's caption positions carry no
    rotary (q = k = 0), so a boolean mask over the same keys gives the same uniform weights.
    """
    cls = cond_mask.size(1)
    device = cond_mask.device
    f32 = torch.float32
    causal = torch.full((s, s), torch.finfo(f32).min, dtype=f32, device=device).triu(1)
    pad = torch.zeros(cond_mask.size(0), s, dtype=f32, device=device)
    pad[:, :cls] = torch.where(cond_mask, 0.0, float(torch.finfo(dtype).min))
    combined = causal[None] + pad[:, None, :]
    return combined == combined.amax(-1, keepdim=True)


PrefixRule = Callable[[torch.Tensor, int, torch.dtype], torch.Tensor]


def run_prefix(model: Any, x: torch.Tensor, cache: StaticKVCache, cond_mask: torch.Tensor | None,
               rule: PrefixRule | None = None) -> torch.Tensor:
    """Prefill: the condition's embeddings x (B, cls, dim) at positions 0..cls-1 into an empty
    cache through `model.forward_cached`, padded positions marked invalid for every later query;
    returns hidden (B, cls, dim).

    `rule(cond_mask, cls, dtype)` -> (B, cls, cls) bool says what each condition query sees
    (`reference_prefix_mask`); without one a padded key is hidden from every query, padded ones
    included.
    """
    cls = x.size(1)
    if cond_mask is None:
        block = torch.ones(cls, cls, dtype=torch.bool, device=x.device).tril()
    elif rule is None:
        block = prefix_mask(cond_mask, cls)
        cache.mark_prefix(cond_mask)
    else:
        block = rule(cond_mask, cls, x.dtype)
    hidden = model.forward_cached(x, torch.arange(cls, device=x.device), block, cache)
    if cond_mask is not None and rule is not None:
        cache.mark_prefix(cond_mask)
    cache.advance(cls)
    return hidden


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer: int,
           cache: StaticKVCache | None, slots: torch.Tensor | None,
           mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention, through the static cache when one is given.

    q: (B, H, T, D); k, v: (B, KV, T, D) for the T new tokens (already rotated).
    With a cache, k and v are stored at `slots` and attention reads all `capacity` slots
    under `mask` (B, 1, T, capacity), bool or additive (`StaticKVCache.additive_mask`, built once per forward). Without one, `mask` is (B, 1, T, T) or None (causal).
    Returns (B, H, T, D).
    """
    if cache is not None:
        cache.write(layer, slots, k, v)
        k, v = cache.k[layer], cache.v[layer]
        # the decoding backend's own attention over its cache (`StaticKVCache.attention`), which
        # returns None for inputs it does not serve; the "math" setting always takes SDPA's
        out = cache.attention(q, k, v, mask) if cache.attention is not None and _attention_kernel == "auto" else None
        if out is not None:
            return out
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


class FusedLinear(nn.Linear):
    """Several Linear layers over the same input as one matmul (one kernel instead of one
    per part plus a concatenation); `forward` returns the parts.

    Build it with `attach_fused_linear`, which makes it attribute `attr` of its owner. The
    state dict keeps one entry per part, named as the separate layers were
    (`{owner prefix}{part}.weight`, `.bias`), so checkpoints keep their layout and key checks
    see the names they always saw; loading concatenates the parts back. The join is the
    owner's load hook because PyTorch hands a child module only the keys under its own
    prefix, where the parts' names are not.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, attr: str) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts, self.attr = dict(parts), attr
        self.register_state_dict_post_hook(FusedLinear._split_state)

    @staticmethod
    def _split_state(module: "FusedLinear", state: dict, prefix: str, _meta: Any) -> None:
        owner = prefix[: len(prefix) - len(module.attr) - 1]  # "...self_attn.qkv." -> "...self_attn."
        for kind in ("weight", "bias"):
            whole = state.pop(prefix + kind, None)
            if whole is not None:
                for name, part in zip(module.parts, whole.split(list(module.parts.values()), dim=0)):
                    state[f"{owner}{name}.{kind}"] = part

    def _join_state(self, _owner: nn.Module, state: dict, prefix: str, *_: Any) -> None:
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in self.parts]
            if all(k in state for k in keys):
                state[f"{prefix}{self.attr}.{kind}"] = torch.cat([state.pop(k) for k in keys], dim=0)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The parts side by side (..., sum of part sizes), in the order given."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return self.whole(x).split(list(self.parts.values()), dim=-1)


def attach_fused_linear(owner: nn.Module, attr: str, in_features: int, parts: dict[str, int],
                        bias: bool) -> FusedLinear:
    """`owner.<attr>` = a FusedLinear of `parts` (name -> output size), its state-dict entries
    named `<part>.weight` / `.bias` under the owner, as separate layers would be."""
    fused = FusedLinear(in_features, parts, bias, attr)
    setattr(owner, attr, fused)
    owner.register_load_state_dict_pre_hook(fused._join_state)
    return fused


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x). Names are parameterised so the drafter can keep HF names.

    `fused`: gate and up as one matmul (`FusedLinear`; the state dict still holds them
    separately). The target keeps two matmuls: a fused one rounds differently on some BLAS
    kernels, and the target must compute what the reference LlamaGen computes bit for bit.
    """

    def __init__(self, dim: int, hidden: int, names: tuple[str, str, str] = ("w1", "w3", "w2"),
                 fused: bool = False) -> None:
        super().__init__()
        gate, up, down = names
        self.names, self.fused = names, fused
        if fused:
            attach_fused_linear(self, "gate_up", dim, {gate: hidden, up: hidden}, bias=False)
        else:
            setattr(self, gate, nn.Linear(dim, hidden, bias=False))
            setattr(self, up, nn.Linear(dim, hidden, bias=False))
        setattr(self, down, nn.Linear(hidden, dim, bias=False))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x; with `residual`, residual + MLP(x), the add riding on the down
        projection's matmul (`add_linear`)."""
        gate_name, up_name, down_name = self.names
        if self.fused:
            gate, up = self.gate_up(x)
        else:
            gate, up = getattr(self, gate_name)(x), getattr(self, up_name)(x)
        if residual is not None:
            return add_linear(residual, F.silu(gate) * up, getattr(self, down_name))
        return getattr(self, down_name)(F.silu(gate) * up)
