"""Janus / Janus-Pro as a target of the decoding core: a thin adapter over the layout of
`transformers`' `JanusForConditionalGeneration` (`model.language_model.*`: a Llama decoder;
`model.generation_embeddings` / `generation_aligner` / `generation_head`: the image path).

What differs from a Chameleon-family target (`runtime.models.chameleon`):
- image tokens have their **own embedding**, `generation_aligner(generation_embeddings(k))`: a
  function of the id only, so it is computed once for the V codes into `tok_embeddings` (V, D);
- their logits come from **`generation_head`**, Linear -> GELU -> Linear with biases: not linear in
  the hidden state, so `linear_head` is False and drafts mix guidance after the head, not before;
- the **unconditional prompt** is the prompt itself with every token but bos and the image start
  replaced by the pad token, attended as the prompt is (Janus's `generate(generation_mode="image")`).

The language model's layers are the Llama layer (`ChameleonLayer` without the q/k norm). Prompts,
positions and the KV cache follow `ChameleonTarget`: left-padded prompts whose last token is the
image start, slot == position.

Shapes: B rows, L prompt length, S image tokens, D the language model's width, V the codebook.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from runtime.errors import UserError
from runtime.models.chameleon import ChameleonConfig, ChameleonLayer, RotateHalfRope, RowTable
from runtime.models.layers import RMSNorm, prefix_mask
from runtime.models.target import CachedDecoding


class JanusAligner(nn.Module):
    """`generation_aligner`: fc1, then (GELU, Linear) per hidden layer; (..., E) -> (..., D)."""

    def __init__(self, embed_dim: int, dim: int, layers: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, dim)
        self.hidden_layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(1, layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        for layer in self.hidden_layers:
            x = layer(F.gelu(x))
        return x


class JanusHead(nn.Module):
    """`generation_head`: (..., D) -> proj_out -> GELU -> vision_head -> (..., V)."""

    def __init__(self, dim: int, projection: int, codes: int) -> None:
        super().__init__()
        self.proj_out = nn.Linear(dim, projection)
        self.vision_head = nn.Linear(projection, codes)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vision_head(F.gelu(self.proj_out(hidden)))


class JanusTarget(CachedDecoding, nn.Module):
    """Janus's language model with its image embedding and head; see the module docstring."""

    # the core mixes a draft's guidance before `logits` only where the head is linear
    linear_head = False
    constrain = None

    def __init__(self, config: ChameleonConfig, *, embed_dim: int, projection: int, aligner_layers: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.full_vocab_size, config.dim)
        self.layers = nn.ModuleList(ChameleonLayer(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.generation_embeddings = nn.Embedding(config.vocab_size, embed_dim)
        self.generation_aligner = JanusAligner(embed_dim, config.dim, aligner_layers)
        self.output = JanusHead(config.dim, projection, config.vocab_size)
        self.rope = RotateHalfRope(config.head_dim, config.rope_base)
        self.tok_embeddings = RowTable(config.vocab_size, config.dim)
        self.refresh_image_rows()

    def refresh_image_rows(self) -> None:
        """`tok_embeddings` (V, D) = the aligner over every code's generation embedding (after
        loading weights)."""
        with torch.no_grad():
            self.tok_embeddings.weight = self.generation_aligner(self.generation_embeddings.weight).detach().clone()

    def for_prompts(self, length: int) -> "JanusTarget":
        """Fix the prompt length L (`config.cls_token_num`) that decoders built next will use."""
        if length < 2:
            raise UserError(f"a Janus prompt holds at least bos and the image start (2 tokens), got {length}")
        self.config = replace(self.config, cls_token_num=length)
        return self

    @classmethod
    def from_hf_state_dict(cls, config: ChameleonConfig, state: Mapping[str, torch.Tensor], *, embed_dim: int,
                           projection: int, aligner_layers: int, source: str = "<state dict>") -> "JanusTarget":
        """Build from `JanusForConditionalGeneration.state_dict()` keys; the understanding path
        (vision model, aligner, text head) and the VQ model are not the target's and are skipped."""
        model = cls(config, embed_dim=embed_dim, projection=projection, aligner_layers=aligner_layers)
        renames = (("model.language_model.", ""), ("model.generation_embeddings.", "generation_embeddings."),
                   ("model.generation_aligner.", "generation_aligner."), ("model.generation_head.", "output."))
        mine: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            for prefix, new in renames:
                if key.startswith(prefix):
                    mine[new + key[len(prefix):]] = value
                    break
        own = model.state_dict()
        missing, unexpected = sorted(set(own) - set(mine)), sorted(set(mine) - set(own))
        if missing or unexpected:
            problem = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
            raise UserError(f"{source}: not a Janus model of this shape ({problem}); check the model folder")
        for key, value in mine.items():
            if tuple(value.shape) != tuple(own[key].shape):
                raise UserError(f"{source}: {key} has shape {tuple(value.shape)}, the config says "
                                f"{tuple(own[key].shape)}; check config.json")
        model.load_state_dict(mine)
        model.refresh_image_rows()
        return model.eval()

    # -- the core's interface ----------------------------------------------------------------
    @property
    def max_position(self) -> int:
        return self.config.max_position

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., V) fp32 image logits through `generation_head` (not linear)."""
        return self.output(hidden).float()

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """The prompt with every token but bos and the image start replaced by pad (Janus's rule)."""
        cfg = self.config
        keep = (cond == cfg.bos_token_id) | (cond == cfg.boi_token_id)
        return torch.where(keep, cond, torch.full_like(cond, cfg.pad_token_id))

    def null_condition_mask(self, cond_mask: torch.Tensor) -> torch.Tensor:
        """The prompt's own mask: Janus attends the pad tokens it put in (left padding stays masked)."""
        return cond_mask.clone()

    def embed_prefix(self, cond: torch.Tensor) -> torch.Tensor:
        """Prompt token ids (B, L) -> (B, L, D); L must be the decoder's prompt length."""
        if cond.size(1) != self.config.cls_token_num:
            raise ValueError(f"prompt length {cond.size(1)} != the decoder's {self.config.cls_token_num} (for_prompts)")
        return self.embed_tokens(cond)

    def rotary(self, positions: torch.Tensor) -> Any:
        return self.rope(positions)

    def forward_train(self, cond: torch.Tensor, idx: torch.Tensor,
                      cond_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: prompt (B, L) (+ mask), image tokens idx (B, S) -> image logits (B, S, V)
        fp32 predicting idx, and post-norm hidden (B, L + S - 1, D)."""
        length = cond.size(1)
        x = torch.cat([self.embed_tokens(cond), self.tok_embeddings(idx[:, :-1])], dim=1)
        s = x.size(1)
        mask = None if cond_mask is None else prefix_mask(cond_mask, s)[:, None]
        rope = self.rope(torch.arange(s, device=x.device))
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, layer=i, cache=None, slots=None, mask=mask)
        hidden = self.norm(x)
        return self.logits(hidden)[:, length - 1:], hidden
