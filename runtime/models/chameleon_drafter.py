"""LANTERN's drafter for Chameleon-family targets (`cnets_anole.Model`: the layout of `jadohu/anole_drafter`).

Input at position p: `fc(cat(embed(token at p+1), target hidden at p))` (fc with bias), then
Chameleon decoder layers (each with its input norm, per-head q/k LayerNorm, rotate-half RoPE), no
final norm and no head: logits come from the target's (image-only) head. Keys equal LANTERN's
(`embed_tokens`, `fc`, `layers.N.self_attn.{q,k,v,o}_proj`, `...q_norm`, `...k_norm`,
`layers.N.mlp.{gate,up,down}_proj`, `layers.N.{input,post_attention}_layernorm`), so its
`pytorch_model.bin` loads with strict key and shape checks. `embed_tokens` covers the whole
vocabulary, as in the file; the core's tokens are image tokens, embedded through their rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from runtime.utils.errors import UserError
from runtime.models.chameleon import ChameleonConfig, ChameleonLayer, RotateHalfRope, RowTable
from runtime.models.kv_cache import StaticKVCache

ROPE_EXTRA = 64  # positions past the target's last one (drafts overshooting the image)


@dataclass(frozen=True)
class ChameleonDrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int  # the whole vocabulary, as LANTERN's embed_tokens
    rms_norm_eps: float = 1e-5
    rope_base: float = 10000.0
    bias: bool = True
    # the condition (prompt) positions it attends to, as trained: "all" (padding included, as
    # LANTERN's drafters) or "valid" (see DrafterConfig.condition_context)
    condition_context: str = "all"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_config(self, block_size: int) -> ChameleonConfig:
        return ChameleonConfig(full_vocab_size=self.vocab_size, vocab_size=1, dim=self.hidden_size,
                               n_layer=self.num_hidden_layers, n_head=self.num_attention_heads,
                               kv_heads=self.num_key_value_heads, ffn_hidden=self.intermediate_size,
                               block_size=block_size, norm_eps=self.rms_norm_eps, rope_base=self.rope_base)

    @classmethod
    def from_json(cls, cfg: Mapping[str, Any], source: str) -> "ChameleonDrafterConfig":
        try:
            heads = int(cfg["num_attention_heads"])
            made = cls(hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
                       num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                       num_hidden_layers=int(cfg.get("num_hidden_layers", 1)), vocab_size=int(cfg["vocab_size"]),
                       rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                       rope_base=float(cfg.get("rope_theta", 10000.0)), bias=bool(cfg.get("bias", True)),
                       condition_context=str(cfg.get("condition_context", "all")))
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"{source}: not a LANTERN Chameleon drafter config ({err}); fix config.json") from None
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            if getattr(made, name) < 1:
                raise UserError(f"{source}: {name} must be a positive integer, got {getattr(made, name)}")
        if made.hidden_size % heads or heads % made.num_key_value_heads:
            raise UserError(f"{source}: hidden_size, num_attention_heads and num_key_value_heads must divide one another")
        if made.condition_context not in ("all", "valid"):
            raise UserError(f"{source}: condition_context must be 'all' or 'valid', got {made.condition_context!r}")
        if cfg.get("swin_norm", False) or cfg.get("attention_bias", False):
            raise UserError(f"{source}: swin_norm / attention_bias drafters are not supported")
        return made


class ChameleonDrafter(nn.Module):
    """See the module docstring. `image_token_ids` maps the core's image tokens to vocabulary ids."""

    def __init__(self, config: ChameleonDrafterConfig, image_token_ids: torch.Tensor, block_size: int,
                 max_position: int) -> None:
        super().__init__()
        self.config = config
        layer_cfg = config.layer_config(block_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList(ChameleonLayer(layer_cfg) for _ in range(config.num_hidden_layers))
        self.register_buffer("image_token_ids", image_token_ids.to(torch.long).clone(), persistent=False)
        self.image_embed = RowTable(len(image_token_ids), config.hidden_size)
        self.rope = RotateHalfRope(config.head_dim, config.rope_base)
        self.max_position = max_position + ROPE_EXTRA
        self.refresh_image_rows()

    def refresh_image_rows(self) -> None:
        with torch.no_grad():
            self.image_embed.weight = self.embed_tokens.weight[self.image_token_ids.to(self.embed_tokens.weight.device)].clone()

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """(..., head_dim, 2): cos and sin (rotate-half layout) of positions (T,) or (B, T), fp32."""
        return torch.stack(self.rope(positions.clamp(max=self.max_position - 1)), dim=-1)

    def new_cache(self, batch: int, capacity: int, device: torch.device | str,
                  dtype: torch.dtype | None = None) -> StaticKVCache:
        cfg = self.config
        return StaticKVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, capacity,
                             device, dtype or self.fc.weight.dtype)

    def _inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        emb = self.image_embed(tokens)
        return self.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))

    def block_context(self, positions: torch.Tensor, block_mask: torch.Tensor, cache: StaticKVCache,
                      offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(RoPE rows, slots (B, T), additive mask (B, 1, T, capacity)), as `Drafter.block_context`."""
        t = block_mask.size(-2)
        return self.rope_rows(positions), cache.block_slots(t, offset), cache.additive_mask(block_mask, offset)

    def forward_block(self, tokens: torch.Tensor, hidden: torch.Tensor, rot: torch.Tensor, slots: torch.Tensor,
                      mask: torch.Tensor, cache: StaticKVCache | None) -> torch.Tensor:
        """(B, T) image tokens + (B, T, dim) target hidden -> (B, T, dim) predicted hidden states."""
        x = self._inputs(tokens, hidden)
        rope = (rot[..., 0], rot[..., 1])
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, layer=i, cache=cache, slots=slots, mask=mask)
        return x

    def forward_cached(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                       block_mask: torch.Tensor, cache: StaticKVCache, offset: int = 0) -> torch.Tensor:
        return self.forward_block(tokens, hidden, *self.block_context(positions, block_mask, cache, offset), cache)

    def forward_train(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: hidden (B, S, dim), image tokens (B, S) -> (B, S, dim), causal."""
        return self.forward_block(tokens, hidden, self.rope_rows(torch.arange(tokens.size(1), device=tokens.device)),
                                  None, None, None)


def is_lantern_chameleon_drafter(config: Mapping[str, Any]) -> bool:
    """LANTERN's Anole / Lumina-mGPT drafter config (model_type chameleon), not our LlamaGen-layout one."""
    return config.get("model_type") == "chameleon"


def load_chameleon_drafter(folder: str | Path, target: Any) -> ChameleonDrafter:
    """LANTERN's Chameleon drafter from `folder` (config.json + pytorch_model.bin / model.safetensors),
    strictly: every key present with its shape, nothing extra; its width and vocabulary must be the target's."""
    from runtime.models.loading import read_hf_weights, read_json

    folder = Path(folder)
    cfg = ChameleonDrafterConfig.from_json(read_json(folder / "config.json"), str(folder / "config.json"))
    tcfg = target.config
    if cfg.hidden_size != tcfg.dim or cfg.vocab_size != tcfg.full_vocab_size:
        raise UserError(f"{folder}: drafter hidden_size {cfg.hidden_size} / vocab_size {cfg.vocab_size} do not "
                        f"match the target's {tcfg.dim} / {tcfg.full_vocab_size}; use the drafter trained for it")
    model = ChameleonDrafter(cfg, target.image_token_ids.cpu(), tcfg.block_size, tcfg.max_position)
    state = read_hf_weights(folder)
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        problem = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UserError(f"{folder}: not a LANTERN Chameleon drafter of this config ({problem})")
    for key, value in state.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise UserError(f"{folder}: {key} has shape {tuple(value.shape)}, the config says {tuple(own[key].shape)}")
    model.load_state_dict(state)
    model.refresh_image_rows()
    return model.eval()
