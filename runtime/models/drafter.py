"""EAGLE/LANTERN drafter for LlamaGen targets (`cnets_llamagen.Model` layout).

Input at position p is concat(embed(token at p+1), target hidden at p) -> `fc` -> decoder
layers (layer 0 has no input norm) -> a predicted target hidden state for p+1. There is no
final norm and no head: logits come from the target's `output` (lm_head).

Positions are the target's sequence positions (slot == position, as in the target cache).
The RoPE table is offset by cls_token_num - 1 (EAGLE's one-step shift): position p holds
the token sampled from target position p, which is image token p - (cls_token_num - 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.configs import DrafterConfig
from runtime.models.gpt import ROPE_EXTRA_ROWS
from runtime.models.kv_cache import StaticKVCache
from runtime.models.layers import RMSNorm, SwiGLU, add_linear, attach_fused_linear, attend
from runtime.models.rope import apply_rope, rope_table_1d, rope_table_2d, rotation_table


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                     cfg.num_key_value_heads, cfg.head_dim)
        h = cfg.hidden_size
        # q, k and v in one matmul; the state dict keeps q_proj / k_proj / v_proj
        self.qkv = attach_fused_linear(self, "qkv", h, {"q_proj": self.n_head * self.head_dim,
                                                        "k_proj": self.kv_heads * self.head_dim,
                                                        "v_proj": self.kv_heads * self.head_dim}, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, residual: torch.Tensor, **attn_kw) -> torch.Tensor:
        """residual + attention(x): the residual add rides on the output projection's matmul."""
        b, t, _ = x.shape
        heads = self.n_head + self.kv_heads
        qk, v = self.qkv.whole(x).split([heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q, k = apply_rope(qk.view(b, t, heads, self.head_dim), freqs, fused=True).split([self.n_head, self.kv_heads], dim=2)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **attn_kw)
        return add_linear(residual, out.transpose(1, 2).reshape(b, t, -1), self.o_proj)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int) -> None:
        super().__init__()
        # the drafter's arithmetic is its own (no reference to match bit for bit), so it takes
        # the fewer-kernel forms: fused norms, gate/up in one matmul, residual adds in the matmuls
        if index != 0:  # EAGLE drops the input norm of the first layer: fc output goes straight in
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=True)
        self.self_attn = DrafterAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size,
                          names=("gate_proj", "up_proj", "down_proj"), fused=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=True)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, **attn_kw) -> torch.Tensor:
        h_in = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        h = self.self_attn(h_in, freqs, residual=x, **attn_kw)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


class Drafter(nn.Module):
    """The drafter. `embed_tokens` is frozen (a copy of the target's input embedding)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * h, h, bias=config.bias)
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_hidden_layers))
        if config.rope == "1d":
            table = rope_table_1d(config.max_position + ROPE_EXTRA_ROWS, config.head_dim, config.rope_base)
        else:
            grid = int(round(config.block_size**0.5))
            table = rope_table_2d(grid, config.head_dim, config.rope_base, max(config.cls_token_num - 1, 0),
                                  ROPE_EXTRA_ROWS + 1)
        self.rope_rot = rotation_table(table)

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotation rows (`rotation_table`) for positions (T,) or (B, T)."""
        if self.rope_rot.device != positions.device:
            self.rope_rot = self.rope_rot.to(positions.device)
        # clamped: a finished image of a batch keeps stepping past the table (its output is unused)
        return self.rope_rot[positions.clamp(max=self.rope_rot.size(0) - 1)]

    def _inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens(tokens)
        return self.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))

    def forward_train(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: hidden (B, S, dim), tokens (B, S) at positions 0..S-1 -> (B, S, dim)."""
        x = self._inputs(tokens, hidden)
        freqs = self.rope_rows(torch.arange(x.size(1), device=x.device))
        for i, layer in enumerate(self.layers):
            x = layer(x, freqs, layer=i, cache=None, slots=None, mask=None)
        return x

    def new_cache(self, batch: int, capacity: int, device: torch.device | str,
                  dtype: torch.dtype | None = None) -> StaticKVCache:
        cfg = self.config
        return StaticKVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim,
                             capacity, device, dtype or self.fc.weight.dtype)

    def forward_cached(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                       block_mask: torch.Tensor, cache: StaticKVCache, offset: int = 0) -> torch.Tensor:
        """A block of T (token, hidden) pairs at `positions` (T,) or (B, T) through the cache, uncommitted.

        tokens: (B, T) long; hidden: (B, T, dim) (target hidden states, or the drafter's own
        predictions inside a tree); block_mask: (T, T) or per row (B, T, T) bool. Returns (B, T, dim).
        """
        return self.forward_block(tokens, hidden, *self.block_context(positions, block_mask, cache, offset), cache)

    def block_context(self, positions: torch.Tensor, block_mask: torch.Tensor, cache: StaticKVCache,
                      offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What `forward_block` needs for a block of T = block_mask.size(-2) tokens: RoPE rows
        (..., T, head_dim/2, 2, 2), cache slots (B, T) and the additive mask (B, 1, T, capacity).

        A caller that runs several blocks against one cache length (the levels of a static
        tree) builds these once for all of them and passes slices (see `StaticTreePolicy`).
        """
        t = block_mask.size(-2)
        return self.rope_rows(positions), cache.block_slots(t, offset), cache.additive_mask(block_mask, offset)

    def forward_block(self, tokens: torch.Tensor, hidden: torch.Tensor, rot: torch.Tensor,
                      slots: torch.Tensor, mask: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """`forward_cached` with its context (`block_context`) given: (B, T) tokens, (B, T, dim)
        hidden -> (B, T, dim), keys and values written at `slots`."""
        x = self._inputs(tokens, hidden)
        for i, layer in enumerate(self.layers):
            x = layer(x, rot, layer=i, cache=cache, slots=slots, mask=mask)
        return x


def drafter_loss(pred: torch.Tensor, target: torch.Tensor, head: nn.Module, mask: torch.Tensor,
                 p_weight: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE/LANTERN loss: SmoothL1(pred, target) + p_weight * soft cross-entropy.

    pred, target: (B, S, dim); mask: (B, S) float, 1 where a target exists. `head` is the
    target's frozen lm_head. Returns (loss, vloss, ploss).
    """
    m = mask[..., None].float()
    denom = m.sum() + 1e-5
    with torch.no_grad():
        p_t = torch.softmax(head(target).float(), dim=-1)
    logq = torch.log_softmax(head(pred).float(), dim=-1)
    ploss = -(m * (p_t * logq).sum(-1, keepdim=True)).sum() / denom
    vloss = (m * F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1, keepdim=True)).sum() / denom
    return vloss + p_weight * ploss, vloss, ploss
