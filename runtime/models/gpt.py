"""LlamaGen GPT (class- and text-conditional), numerically faithful to the official model.

State-dict keys equal LlamaGen's (`tok_embeddings`, `cls_embedding.*`, `layers.N.attention.wqkv`,
`layers.N.feed_forward.w1/w2/w3`, `norm`, `output`), so official checkpoints load unchanged.

Two entry points:
- `forward_train(cond, idx)`: teacher-forced full sequence, as LlamaGen trains.
- `prefill` / `forward_cached`: inference through a `StaticKVCache`, any block of tokens at
  any RoPE positions under any block mask (a tree), without shape changes between steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.configs import GPTConfig
from runtime.models.kv_cache import StaticKVCache
from runtime.models.layers import RMSNorm, SwiGLU, attend, reference_prefix_mask
from runtime.models.target import CachedDecoding
from runtime.models.rope import apply_rope, rope_table_2d, rotation_table

# Zero RoPE rows after the last image token: room for draft tokens that overshoot the image.
ROPE_EXTRA_ROWS = 64


class LabelEmbedder(nn.Module):
    """c2i condition: class id -> (B, 1, dim). Id `num_classes` is the null (unconditional) class."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float) -> None:
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), dim)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape, device=labels.device) < self.dropout_prob
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels).unsqueeze(1)


class CaptionMLP(nn.Module):
    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """t2i condition: T5 features (B, 120, caption_dim) -> (B, 120, dim).

    `uncond_embedding` (120, caption_dim) is a persistent random buffer (never trained): the
    null caption for classifier-free guidance.
    """

    def __init__(self, caption_dim: int, dim: int, token_num: int, dropout_prob: float) -> None:
        super().__init__()
        self.cap_proj = CaptionMLP(caption_dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)
        self.dropout_prob = dropout_prob

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(caption.size(0), device=caption.device) < self.dropout_prob
            caption = torch.where(drop[:, None, None], self.uncond_embedding.to(caption.dtype), caption)
        return self.cap_proj(caption)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        total = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, total, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.resid_dropout = cfg.resid_dropout_p

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, *, layer: int,
                cache: StaticKVCache | None, slots: torch.Tensor | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        kv = self.kv_heads * self.head_dim
        qk, v = self.wqkv(x).split([self.n_head * self.head_dim + kv, kv], dim=-1)
        # q and k heads rotated by one call (the same elementwise arithmetic, half the kernels)
        qk = apply_rope(qk.view(b, t, self.n_head + self.kv_heads, self.head_dim), freqs)
        q, k = qk.split([self.n_head, self.kv_heads], dim=2)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                     layer=layer, cache=cache, slots=slots, mask=mask)
        out = self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return F.dropout(out, self.resid_dropout, self.training)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = SwiGLU(cfg.dim, cfg.ffn_hidden)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_dropout = cfg.ffn_dropout_p

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, **attn_kw) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs, **attn_kw)
        ffn = F.dropout(self.feed_forward(self.ffn_norm(h)), self.ffn_dropout, self.training)
        return h + ffn


class Transformer(CachedDecoding, nn.Module):
    """The LlamaGen GPT. Logits are returned in fp32; hidden states are post-final-norm."""

    # a padded caption position's hidden state is what LANTERN's t2i drafters were trained on
    prefix_rule = staticmethod(reference_prefix_mask)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        if config.model_type == "c2i":
            self.cls_embedding: nn.Module = LabelEmbedder(config.num_classes, config.dim,
                                                          config.class_dropout_prob)
        else:
            self.cls_embedding = CaptionEmbedder(config.caption_dim, config.dim,
                                                 config.cls_token_num, config.class_dropout_prob)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # Plain attribute, not a buffer: stays fp32 under .to(bf16) and out of the state dict.
        self.freqs_cis = rope_table_2d(config.grid_size, config.head_dim, config.rope_base,
                                       config.cls_token_num, ROPE_EXTRA_ROWS)
        self.rope_rot = rotation_table(self.freqs_cis)

    # -- helpers ---------------------------------------------------------------------------
    def init_weights(self) -> None:
        """LlamaGen init: N(0, 0.02) for Linear/Embedding, zero output head."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=self.config.initializer_range)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.zeros_(self.output.weight)

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotation rows (`rotation_table`) for sequence positions (T,) or (B, T) -> (..., head_dim/2, 2, 2) fp32."""
        if self.rope_rot.device != positions.device:
            self.rope_rot = self.rope_rot.to(positions.device)
        # clamped: a finished image of a batch keeps stepping past the table (its output is unused)
        return self.rope_rot[positions.clamp(max=self.rope_rot.size(0) - 1)]

    @property
    def max_position(self) -> int:
        """Largest sequence position the RoPE table covers, plus one."""
        return self.freqs_cis.size(0)

    def embed_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """c2i: labels (B,) long; t2i: T5 features (B, cls_token_num, caption_dim). -> (B, cls, dim)."""
        emb = self.cls_embedding(cond)
        return emb[:, : self.config.cls_token_num].to(self.tok_embeddings.weight.dtype)

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """The unconditional counterpart of `cond` (same batch size) for classifier-free guidance."""
        if self.config.model_type == "c2i":
            return torch.full_like(cond, self.config.num_classes)
        unc = self.cls_embedding.uncond_embedding
        return unc[None].expand(cond.size(0), -1, -1).to(cond.dtype)

    def null_condition_mask(self, cond_mask: torch.Tensor) -> torch.Tensor:
        """The null condition's validity mask: LlamaGen's null caption keeps the caption's padding."""
        return cond_mask

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden).float()

    # -- training --------------------------------------------------------------------------
    def forward_train(self, cond: torch.Tensor, idx: torch.Tensor,
                      cond_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced forward.

        cond: labels (B,) or captions (B, cls, caption_dim); idx: (B, block_size) image tokens;
        cond_mask: (B, cls) bool caption validity (t2i, left-padded) or None.
        Returns logits (B, block_size, V) fp32 predicting idx, and hidden states
        (B, cls + block_size - 1, dim) after the final norm.
        """
        cls = self.config.cls_token_num
        x = torch.cat([self.embed_condition(cond), self.tok_embeddings(idx[:, :-1])], dim=1)
        x = F.dropout(x, self.config.token_dropout_p, self.training)
        s = x.size(1)
        freqs = self.rope_rows(torch.arange(s, device=x.device))
        mask = None
        if cond_mask is not None:
            mask = reference_prefix_mask(cond_mask, s, x.dtype)[:, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, freqs, layer=i, cache=None, slots=None, mask=mask)
        hidden = self.norm(x)
        return self.logits(hidden)[:, cls - 1:], hidden

    # -- inference -------------------------------------------------------------------------
    # new_cache / prefill / forward_cached: CachedDecoding (runtime/models/target.py)
    def embed_prefix(self, cond: torch.Tensor) -> torch.Tensor:
        return self.embed_condition(cond)

    def rotary(self, positions: torch.Tensor) -> torch.Tensor:
        return self.rope_rows(positions)
