"""A padded caption's prefill equals LANTERN's reference target (`modeling_llamagen_kv.py`).

The reference builds its attention mask as the sum of a causal mask in fp32 and HF's
`_expand_mask` of the caption padding in the model dtype, and takes an fp32 softmax over the
scores plus that sum. The functions here restate that arithmetic independently of the runtime's
`reference_prefix_mask`, run the tiny t2i target's own layers through it, and compare every
position's hidden state, padded ones included (the drafter reads them).
"""

import math
import sys
from pathlib import Path

import pytest
import torch

import runtime.models.gpt as gpt_module
from runtime.models.layers import reference_prefix_mask

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import caption, tiny_pair  # noqa: E402


def hf_additive_mask(valid: torch.Tensor, s: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, s, s) fp32: `_make_causal_mask(..., torch.float32)` + `_expand_mask(mask, dtype)`,
    the padding mask covering the first valid.size(1) columns, every later column valid."""
    b, cls = valid.shape
    causal = torch.full((s, s), torch.finfo(torch.float32).min)
    causal.masked_fill_(torch.ones(s, s, dtype=torch.bool).tril(), 0)
    full = torch.ones(b, s)
    full[:, :cls] = valid.float()
    inverted = (1.0 - full[:, None, None, :].expand(b, 1, s, s)).to(dtype)
    expanded = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)
    return expanded + causal[None, None]


def reference_attend(q, k, v, *, layer, cache, slots, mask):
    """Explicit-matmul attention of the reference: scores in the model dtype, mask added, fp32 softmax."""
    assert cache is None
    if k.size(1) != q.size(1):
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1))
    weights = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def reference_hidden(model, x: torch.Tensor, valid: torch.Tensor, monkeypatch) -> torch.Tensor:
    """Post-norm hidden states (B, s, D) of inputs x (B, s, D) through the model's layers, the
    reference's attention and mask in place of the runtime's."""
    s = x.size(1)
    mask = hf_additive_mask(valid, s, x.dtype)
    monkeypatch.setattr(gpt_module, "attend", reference_attend)
    freqs = model.rotary(torch.arange(s))
    for i, layer in enumerate(model.layers):
        x = layer(x, freqs, layer=i, cache=None, slots=None, mask=mask)
    monkeypatch.undo()
    return model.norm(x)


def t2i_target(dtype: torch.dtype):
    target, _ = tiny_pair(model_type="t2i", vocab=8)
    return target.eval().to(dtype)


def test_mask_by_hand():
    valid = torch.tensor([[False, False, True, True]])
    # fp32: both minima are the same number, so a padded query's row maximum is shared by the
    # padded keys up to it and the valid keys after it
    fp32 = reference_prefix_mask(valid, 5, torch.float32)[0].int().tolist()
    assert fp32 == [[1, 0, 1, 1, 1],
                    [1, 1, 1, 1, 1],
                    [0, 0, 1, 0, 0],
                    [0, 0, 1, 1, 0],
                    [0, 0, 1, 1, 1]]
    # bf16 / fp16: the padding minimum is the larger one: a padded query sees the padded keys up to itself
    for dtype in (torch.bfloat16, torch.float16):
        low = reference_prefix_mask(valid, 5, dtype)[0].int().tolist()
        assert low[:2] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
        assert low[2:] == fp32[2:]
    # no padding: causal
    assert torch.equal(reference_prefix_mask(torch.ones(1, 3, dtype=torch.bool), 4, torch.float32)[0],
                       torch.ones(4, 4, dtype=torch.bool).tril())


def test_caption_positions_carry_no_rotary():
    """Why a boolean mask reproduces the reference's uniform rows: q = k = 0 at caption positions."""
    target = t2i_target(torch.float32)
    cls = target.config.cls_token_num
    assert not target.freqs_cis[:cls].any()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])  # tol: of the largest state
def test_prefill_equals_reference_at_every_position(dtype, tol, monkeypatch):
    target = t2i_target(dtype)
    conds, valid = caption(target, n=3)
    valid[1, :] = True  # one caption unpadded
    valid[2, :4] = False  # one padded more than the others
    conds = conds * valid[..., None]
    with torch.no_grad():
        x = target.embed_prefix(conds.to(dtype))
        expected = reference_hidden(target, x, valid, monkeypatch)
        got = target.prefill(conds.to(dtype), target.new_cache(3, 64, "cpu"), valid)
    assert got.dtype == expected.dtype
    assert (got.float() - expected.float()).abs().max() < tol * expected.float().abs().max()
    padded = expected[~valid].float().abs().max()
    if dtype == torch.float32:
        assert padded > 0.1  # the valid caption keys reach the padded queries
    else:
        # LlamaGen's caption MLP has no bias, so a zeroed caption row embeds to 0, and in bf16 a
        # padded query sees only padded keys: its state stays 0, what the released drafter read
        assert padded == 0


def test_fp32_padded_states_differ_from_self_only(monkeypatch):
    """The test above can fail: hiding every padded key (the rule before) gives other padded states."""
    target = t2i_target(torch.float32)
    conds, valid = caption(target, n=1)
    with torch.no_grad():
        ref = target.prefill(conds, target.new_cache(1, 64, "cpu"), valid)
        monkeypatch.setattr(type(target), "prefix_rule", None)
        hidden_keys = target.prefill(conds, target.new_cache(1, 64, "cpu"), valid)
    assert torch.allclose(ref[valid], hidden_keys[valid], atol=1e-6)  # valid positions never see padding
    assert (ref[~valid] - hidden_keys[~valid]).abs().max() > 0.1


def test_teacher_forced_forward_equals_reference(monkeypatch):
    """`forward_train` (drafter training data from the target) applies the same rule to the whole
    sequence: in fp32 a padded caption query also sees the image tokens after it."""
    target = t2i_target(torch.float32)
    conds, valid = caption(target, n=2)
    idx = torch.randint(0, 8, (2, target.config.block_size), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, hidden = target.forward_train(conds, idx, valid)
        x = torch.cat([target.embed_prefix(conds), target.tok_embeddings(idx[:, :-1])], dim=1)
        expected = reference_hidden(target, x, valid, monkeypatch)
    assert (hidden - expected).abs().max() < 1e-5
