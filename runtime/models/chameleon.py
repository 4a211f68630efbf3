"""Chameleon-family targets (Anole, Lumina-mGPT) for the decoding core.

A thin adapter: the decoder layers are Chameleon's (pre-norm, per-head LayerNorm on q and k,
1-D rotary embedding in the rotate-half convention, SwiGLU), written on the runtime's static KV
cache and `attend` so verify steps take tree masks, commit accepted paths and capture as graphs like
the LlamaGen GPT's. Parameter names are those of `transformers`' `ChameleonForConditionalGeneration`
without the `model.` prefix, so its state dict loads directly (`from_hf_state_dict`).

What the core sees (the `Transformer` interface):
- an **image-only vocabulary**: core token k is the k-th image token of the model's vocabulary
  (`image_token_ids[k]`, the BPE id of VQ code k: for Chameleon's vocabulary, k + 4). `logits`
  returns only the image tokens' logits, which is what masking every other token to -inf before
  the softmax (the reference generation scripts) gives; `tok_embeddings` embeds image tokens.
- conditions are **prompts**: token ids (B, L) of the full vocabulary, left-padded, with a mask
  (B, L) True on real tokens; a prompt ends with the begin-of-image token, so the last prompt
  position predicts image token 0. `config.cls_token_num` is L, fixed per decoder (`for_prompts`).
- the unconditional prompt for classifier-free guidance is `[bos, boi]`, left-padded to L
  (`null_condition`, `null_condition_mask`), as Anole's and LANTERN's generation code build it
  (Lumina-mGPT: its image start `[boi, size, size]`).
- Lumina-mGPT's rows: with `row_width` set, the image vocabulary holds the row-end token too and
  `constrain` (which the decoder applies after CFG) forces it at each row's end and forbids it
  elsewhere, as Lumina's logits processors do.
Positions are slots (slot == position, padding included): RoPE depends on position differences
only, so a padded prompt attends as an unpadded one does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from runtime.utils.errors import UserError
from runtime.models.layers import RMSNorm, SwiGLU, attend, prefix_mask
from runtime.models.target import CachedDecoding


@dataclass(frozen=True)
class ChameleonConfig:
    """The target's shape. `vocab_size` is the image vocabulary the core decodes over; the
    model's whole vocabulary is `full_vocab_size`. `block_size` image tokens per image (a square grid)."""

    full_vocab_size: int
    vocab_size: int
    dim: int
    n_layer: int
    n_head: int
    kv_heads: int
    ffn_hidden: int
    block_size: int
    cls_token_num: int = 2
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    max_position: int = 4096
    bos_token_id: int = 0
    pad_token_id: int = 1
    boi_token_id: int = 8197
    model_type: str = "chameleon"
    num_classes: int = 0
    # Lumina-mGPT's layout: each image row of `row_width - 1` codes ends with the row-end token
    # (core id `newline`), forced there and forbidden elsewhere; 0 / -1: a plain square grid
    row_width: int = 0
    newline: int = -1
    # the unconditional prompt (vocabulary ids), left-padded; () = [bos, boi] (Anole)
    null_prompt: tuple[int, ...] = ()
    # Chameleon's per-head LayerNorm on q and k; False: the Llama layer (Emu3's, Janus's language model)
    qk_norm: bool = True
    # the model family, for names and messages: anole, lumina, emu3, janus
    family: str = "anole"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def grid_size(self) -> int:
        return self.row_width or int(round(self.block_size ** 0.5))


class RotateHalfRope:
    """Chameleon's 1-D rotary embedding (rotate-half layout): (cos, sin), each (..., head_dim) fp32,
    for positions (T,) or (B, T). The frequencies stay fp32 whatever the model's dtype and move to
    the positions' device on first use."""

    def __init__(self, head_dim: int, base: float) -> None:
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions[..., None].float() * self.inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HeadLayerNorm(nn.Module):
    """Chameleon's q/k norm: LayerNorm statistics over head_dim, each head with its own weight
    and bias (heads, head_dim)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(heads, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., heads, head_dim)
        return F.layer_norm(x, (x.shape[-1],), None, None, eps=1e-5) * self.weight + self.bias


class ChameleonAttention(nn.Module):
    def __init__(self, cfg: ChameleonConfig) -> None:
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.q_norm: nn.Module = HeadLayerNorm(cfg.n_head, cfg.head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm: nn.Module = HeadLayerNorm(cfg.kv_heads, cfg.head_dim) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], **attn_kw: Any) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = (r.to(q.dtype) for r in rope)  # (T, hd) or (B, T, hd) -> broadcast over heads
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = attend(q, k, v, **attn_kw)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class ChameleonLayer(nn.Module):
    def __init__(self, cfg: ChameleonConfig) -> None:
        super().__init__()
        self.self_attn = ChameleonAttention(cfg)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_hidden, names=("gate_proj", "up_proj", "down_proj"))
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], **attn_kw: Any) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, **attn_kw)
        return h + self.mlp(self.post_attention_layernorm(h))


class RowTable(nn.Module):
    """Rows `ids` of a (V, D) table, kept as a non-persistent buffer `weight` (n, D): the image
    tokens' embedding (`forward` embeds) or head (`project` gives logits)."""

    weight: torch.Tensor  # the buffer (n, D)

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, dim), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class RowHead(RowTable):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


class PromptedDecoding(CachedDecoding):
    """What a target conditioned on token prompts shares (the Chameleon family, Janus): the prompt
    length, the prompt's embedding, the rotary table and the teacher-forced forward. A subclass
    provides `config` (a ChameleonConfig), `embed_tokens` (the whole vocabulary), `tok_embeddings`
    (image tokens), `layers`, `norm`, `rope` and `logits`."""

    @property
    def row_end(self) -> int:
        """Lumina-mGPT's and Emu3's row-end token (`config.newline`) where rows have one, else -1."""
        return int(self.config.newline) if self.config.row_width else -1  # type: ignore[attr-defined]

    def for_prompts(self, length: int) -> Any:
        """Fix the prompt length L (`config.cls_token_num`) that decoders built next will use."""
        if length < 2:
            raise UserError(f"a prompt holds at least bos and the image start (2 tokens), got {length}")
        self.config = replace(self.config, cls_token_num=length)  # type: ignore[has-type]
        return self

    @property
    def max_position(self) -> int:
        return self.config.max_position  # type: ignore[has-type]

    def embed_prefix(self, cond: torch.Tensor) -> torch.Tensor:
        """The prompt token ids (B, L) embedded; L must be the decoder's prompt length."""
        length = self.config.cls_token_num  # type: ignore[has-type]
        if cond.size(1) != length:
            raise ValueError(f"prompt length {cond.size(1)} != the decoder's {length} (for_prompts)")
        return self.embed_tokens(cond)  # type: ignore[attr-defined]

    def rotary(self, positions: torch.Tensor) -> Any:
        return self.rope(positions)  # type: ignore[attr-defined]

    def forward_train(self, cond: torch.Tensor, idx: torch.Tensor,
                      cond_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: prompt (B, L) (+ mask), image tokens idx (B, S) (core ids) -> image
        logits (B, S, V) fp32 predicting idx, and post-norm hidden (B, L + S - 1, dim)."""
        length = cond.size(1)
        x = torch.cat([self.embed_tokens(cond), self.tok_embeddings(idx[:, :-1])], dim=1)  # type: ignore[attr-defined]
        s = x.size(1)
        mask = None if cond_mask is None else prefix_mask(cond_mask, s)[:, None]
        rope = self.rope(torch.arange(s, device=x.device))  # type: ignore[attr-defined]
        for i, layer in enumerate(self.layers):  # type: ignore[attr-defined]
            x = layer(x, rope, layer=i, cache=None, slots=None, mask=mask)
        hidden = self.norm(x)  # type: ignore[attr-defined]
        return self.logits(hidden)[:, length - 1:], hidden  # type: ignore[attr-defined]


class ChameleonTarget(PromptedDecoding, nn.Module):
    """A Chameleon decoder with an image-only output vocabulary; see the module docstring."""

    def __init__(self, config: ChameleonConfig, image_token_ids: torch.Tensor) -> None:
        super().__init__()
        if image_token_ids.shape != (config.vocab_size,):
            raise ValueError(f"image_token_ids must hold vocab_size ({config.vocab_size}) ids")
        self.config = config
        self.embed_tokens = nn.Embedding(config.full_vocab_size, config.dim)
        self.layers = nn.ModuleList(ChameleonLayer(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.full_vocab_size, bias=False)
        self.register_buffer("image_token_ids", image_token_ids.to(torch.long).clone(), persistent=False)
        self.rope = RotateHalfRope(config.head_dim, config.rope_base)
        self.tok_embeddings = RowTable(config.vocab_size, config.dim)
        self.output = RowHead(config.vocab_size, config.dim)
        # the decoder applies `constrain` to its logits when set (Lumina's row-end tokens)
        self.constrain = self._row_ends if config.newline >= 0 else None
        # (2, V) fp32: the logits at a row end (only the row-end token) and what is added elsewhere
        # (-inf on it); a plain attribute, so it stays fp32 like the logits and is made once
        self._row_rule: torch.Tensor | None = None
        if config.newline >= 0:
            forced = torch.full((config.vocab_size,), float("-inf"))
            forced[config.newline] = 0.0
            self._row_rule = torch.stack([forced, torch.where(forced == 0, float("-inf"), 0.0)])
        self.refresh_image_rows()

    # -- construction ------------------------------------------------------------------------
    def refresh_image_rows(self) -> None:
        """Copy the image tokens' rows of the embedding and the head into `tok_embeddings` /
        `output` (after loading weights; `.to()` moves and casts them with the model)."""
        with torch.no_grad():
            ids = self.image_token_ids.to(self.embed_tokens.weight.device)
            self.tok_embeddings.weight = self.embed_tokens.weight[ids].clone()
            self.output.weight = self.lm_head.weight[ids].clone()

    @classmethod
    def from_hf_state_dict(cls, config: ChameleonConfig, state: Mapping[str, torch.Tensor],
                           image_token_ids: torch.Tensor, source: str = "<state dict>") -> "ChameleonTarget":
        """Build from `ChameleonForConditionalGeneration.state_dict()` keys (`model.layers...`,
        `lm_head.weight`); the VQ model's keys are not the target's and are skipped."""
        model = cls(config, image_token_ids)
        mine = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()
                if not k.startswith("model.vqmodel.")}
        own = model.state_dict()
        missing = sorted(set(own) - set(mine))
        unexpected = sorted(set(mine) - set(own))
        if missing or unexpected:
            problem = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
            raise UserError(f"{source}: not a Chameleon decoder of this shape ({problem}); check the model folder")
        for key, value in mine.items():
            if tuple(value.shape) != tuple(own[key].shape):
                raise UserError(f"{source}: {key} has shape {tuple(value.shape)}, the config says "
                                f"{tuple(own[key].shape)}; check config.json")
        model.load_state_dict(mine)
        model.refresh_image_rows()
        return model.eval()

    # -- the core's interface ----------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> (..., vocab_size) fp32 logits of the image tokens."""
        return self.output(hidden).float()

    @property
    def null_prompt(self) -> tuple[int, ...]:
        cfg = self.config
        return cfg.null_prompt or (cfg.bos_token_id, cfg.boi_token_id)

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """The unconditional prompt (Anole: `[bos, boi]`; Lumina-mGPT: `[boi, size, size]`),
        left-padded to the prompt length, per row of `cond`."""
        null = torch.full_like(cond, self.config.pad_token_id)
        for j, token in enumerate(reversed(self.null_prompt)):
            null[:, -1 - j] = token
        return null

    def null_condition_mask(self, cond_mask: torch.Tensor) -> torch.Tensor:
        """The unconditional prompt's mask: its last len(null prompt) positions are real."""
        mask = torch.zeros_like(cond_mask)
        mask[:, -len(self.null_prompt):] = True
        return mask

    def _row_ends(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Lumina-mGPT's rule: at image index i with (i + 1) % row_width == 0 only the row-end
        token; elsewhere anything but it. logits (B, T, V), index (B, T) -> (B, T, V)."""
        if self._row_rule.device != logits.device:
            self._row_rule = self._row_rule.to(logits.device)
        row_end = ((index + 1) % self.config.row_width == 0)[..., None]
        return torch.where(row_end, self._row_rule[0], logits + self._row_rule[1])

    # new_cache / prefill / forward_cached: CachedDecoding (runtime/models/target.py); for_prompts,
    # embed_prefix, rotary, forward_train: PromptedDecoding


def config_from_hf(hf: Any, image_token_ids: torch.Tensor, block_size: int) -> ChameleonConfig:
    """A ChameleonConfig from a `transformers` ChameleonConfig (or its dict), for images of
    `block_size` tokens. Refuses what the adapter does not compute (swin_norm, attention bias)."""
    get = hf.get if isinstance(hf, dict) else (lambda key, default=None: getattr(hf, key, default))
    if get("swin_norm", False):
        raise UserError("this Chameleon checkpoint uses swin_norm (the 30B layout); only the 7B layout "
                        "(swin_norm false: Anole, Lumina-mGPT) is supported")
    if get("attention_bias", False) or get("mlp_bias", False):
        raise UserError("this Chameleon config has attention or MLP biases, which the adapter does not compute")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        value = get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"Chameleon config.json: {key} must be a positive integer, got {value!r}; fix the "
                            "model folder's config.json")
    heads, kv = get("num_attention_heads"), get("num_key_value_heads", None) or get("num_attention_heads")
    if not isinstance(kv, int) or kv < 1 or get("hidden_size") % heads or heads % kv:
        raise UserError("Chameleon config.json: hidden_size, num_attention_heads and num_key_value_heads must divide "
                        "one another; fix the model folder's config.json")
    rope = get("rope_parameters", None) or {}
    base = float(rope.get("rope_theta", get("rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0)
    vocab_map = get("vocabulary_map", None) or {}
    return ChameleonConfig(
        full_vocab_size=int(get("vocab_size")), vocab_size=int(image_token_ids.numel()),
        dim=int(get("hidden_size")), n_layer=int(get("num_hidden_layers")), n_head=int(get("num_attention_heads")),
        kv_heads=int(get("num_key_value_heads", None) or get("num_attention_heads")),
        ffn_hidden=int(get("intermediate_size")), block_size=block_size,
        norm_eps=float(get("rms_norm_eps", 1e-5)), rope_base=base,
        max_position=int(get("max_position_embeddings", 4096)),
        bos_token_id=int(vocab_map.get("<s>", 0)), pad_token_id=int(vocab_map.get("<pad>", 1)),
        boi_token_id=int(vocab_map.get("<racm3:break>", 8197)))
