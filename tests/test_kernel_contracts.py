"""Device contracts checked on the CPU: every tensor a decoding step hands to fused attention meets
the layout rules of the kernels the CUDA and Gaudi paths may select, for every method, tree and
batch size, in bf16 and fp32; and the bf16 path runs end to end on the CPU close to fp32.

The rules (docs/selfcheck.md, "Kernel contracts"), the strictest of PyTorch's fused SDPA kernels
(flash, memory-efficient, cuDNN) and Habana's fused SDPA:
  * q, k, v and the mask have a contiguous last dimension (stride 1);
  * every other stride and the storage offset are multiples of 16 bytes (vectorised loads);
  * the head dimension is a multiple of 8 elements (16 bytes in bf16) and at most 256;
  * the mask is bool or of q's dtype, broadcast only over heads (its batch and query strides
    are real rows, each starting 16-byte aligned: the H200 "misaligned address" fault was a
    bf16 mask row at a 534-byte offset).
A step that broke one would run here (the CPU's kernels do not care) and fault on a GPU.

Exactness is not tested in bf16: a tree verify multiplies a (rows x tokens) block where AR
multiplies one row, and bf16 rounds the two differently often enough to flip near-tied greedy
choices; exactness holds where the kernels agree (fp32 here, `tests/test_core_exactness.py`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import runtime.models.layers as layers

CASES = {
    "ar": {},
    "sd": {"depth": 3},
    "eagle2": {"depth": 3, "top_k_draft": 4, "total_tokens": 16},
    "ddd": {"top_k_draft": 4, "total_tokens": 16, "ddd_max_depth": 4},
    "lantern": {"depth": 3, "top_k_draft": 4, "total_tokens": 16, "lantern_delta": 0.3},
    "lantern++ chain3": {"tree": "chain3", "lantern_lambda": 5.0},
    "lantern++ naive_extend_57": {"tree": "naive_extend_57", "lantern_lambda": 2.0},
    "sjd": {},
}


def violations(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> list[str]:
    """The rules above broken by one fused-attention call (empty when it is sound)."""
    bad = []
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("mask", mask),) if mask is not None else ()):
        size = t.element_size()
        if t.stride(-1) != 1:
            bad.append(f"{name} last dim stride {t.stride(-1)}")
        for dim, (extent, stride) in enumerate(zip(t.shape[:-1], t.stride()[:-1])):
            if extent > 1 and stride != 0 and (stride * size) % 16:
                bad.append(f"{name} stride {stride} ({stride * size} B) of dim {dim} {tuple(t.shape)}")
        if (t.storage_offset() * size) % 16:
            bad.append(f"{name} storage offset {t.storage_offset() * size} B")
    head = q.size(-1)
    if head % 8 or head > 256:
        bad.append(f"head dim {head}")
    if mask is not None:
        if mask.dtype not in (torch.bool, q.dtype):
            bad.append(f"mask {mask.dtype} with q {q.dtype}")
        if mask.size(0) > 1 and mask.stride(0) == 0 or mask.size(-2) > 1 and mask.stride(-2) == 0:
            bad.append("mask broadcast over batch or queries (a kernel reads its rows)")
    return bad


@pytest.fixture
def recorded(monkeypatch) -> list[tuple[str, list[str]]]:
    """Every SDPA call of the decoding core, as (shapes, violations)."""
    calls: list[tuple[str, list[str]]] = []
    real = F.scaled_dot_product_attention

    def checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, **kw: Any) -> torch.Tensor:
        calls.append((f"q {tuple(q.shape)} kv {tuple(k.shape)} mask "
                      f"{None if attn_mask is None else tuple(attn_mask.shape)}", violations(q, k, v, attn_mask)))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    class Functional:  # torch.nn.functional as `layers` sees it, with SDPA recorded
        def __getattr__(self, name: str) -> Any:
            return checked if name == "scaled_dot_product_attention" else getattr(F, name)

    monkeypatch.setattr(layers, "F", Functional())
    return calls


@pytest.fixture(scope="module")
def bundles() -> dict[torch.dtype, Any]:
    from runtime.demo.bundle import load_demo_bundle

    return {dtype: load_demo_bundle(None, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_every_attention_call_meets_the_fused_kernels_contract(bundles, recorded, case, batch, dtype):
    from runtime.core import MethodSpec, SamplingParams, generate

    bundle = bundles[dtype]
    method = case.split()[0]
    spec = MethodSpec(method=method, sampling=SamplingParams(cfg=3.0), lantern_k=32, **CASES[case])
    generate(bundle.gpt, bundle.drafter if method not in ("ar", "sjd") else None, spec, [1, 5, 7][:batch], seed=3,
             vq=bundle.vq, batch_size=batch)
    assert recorded, "no attention call was seen: the check would pass vacuously"
    broken = [(shapes, bad) for shapes, bad in recorded if bad]
    assert not broken, f"{len(broken)} of {len(recorded)} calls break the contract, first: {broken[0]}"


def test_the_contract_check_catches_a_misaligned_mask_row():
    q = torch.zeros(2, 2, 3, 8, dtype=torch.bfloat16)
    mask = torch.zeros(2, 1, 3, 267, dtype=torch.bfloat16)  # 534-byte rows: the H200 fault
    assert any("534 B" in v for v in violations(q, q, q, mask))
    padded = torch.zeros(2, 1, 3, 272, dtype=torch.bfloat16)
    assert violations(q, q, q, padded) == []
    assert any("last dim stride" in v for v in violations(q.transpose(-1, -2).contiguous().transpose(-1, -2), q, q,
                                                           None))
    assert any("storage offset" in v for v in violations(torch.zeros(100, dtype=torch.bfloat16)[1:97].view(2, 2, 3, 8),
                                                         q, q, None))
    assert any("mask torch.float32" in v for v in violations(q, q, q, torch.zeros(2, 1, 3, 8)))


def test_bf16_logits_on_the_cpu_stay_within_bf16_rounding_of_fp32(bundles):
    """The demo target's whole-image forward in bf16 against fp32 on the same tokens: a dtype fault
    (an fp32-only op, a mask that overflows bf16) shows here before a GPU does."""
    idx = torch.randint(0, bundles[torch.float32].gpt.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    cond = torch.tensor([1, 4])
    logits = {}
    with torch.no_grad():
        for dtype, bundle in bundles.items():
            logits[dtype] = bundle.gpt.forward_train(cond, idx[:, :bundle.gpt.config.block_size])[0].float()
    ref, low = logits[torch.float32], logits[torch.bfloat16]
    assert torch.isfinite(low).all()
    err = (low - ref).abs().max() / ref.std()
    assert err < 0.15, f"bf16 logits differ from fp32 by {err:.3f} of their spread"
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
