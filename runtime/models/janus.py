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

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.chameleon import ChameleonConfig, ChameleonLayer, PromptedDecoding, RotateHalfRope, RowTable
from runtime.models.layers import RMSNorm


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


class JanusTarget(PromptedDecoding, nn.Module):
    """Janus's language model with its image embedding and head; see the module docstring.
    Prompt length, prompt embedding, rotary table and teacher-forced forward: `PromptedDecoding`."""

    # the core mixes a draft's guidance before `logits` only where the head is linear
    linear_head = False

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

    @classmethod
    def from_hf_state_dict(cls, config: ChameleonConfig, state: Mapping[str, torch.Tensor], *, embed_dim: int,
                           projection: int, aligner_layers: int, source: str = "<state dict>") -> "JanusTarget":
        """Build from `JanusForConditionalGeneration.state_dict()` keys; the understanding path
        (vision model, aligner, text head) and the VQ model are not the target's and are skipped."""
        model = cls(config, embed_dim=embed_dim, projection=projection, aligner_layers=aligner_layers)
        renames = (("model.language_model.", ""), ("model.generation_embeddings.", "generation_embeddings."),
                   ("model.generation_aligner.", "generation_aligner."), ("model.generation_head.", "output."))
        from runtime.models.loading import load_state_dict_strict

        mine: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            for prefix, new in renames:
                if key.startswith(prefix):
                    mine[new + key[len(prefix):]] = value
                    break
        load_state_dict_strict(model, mine, source, hint="not a Janus model of this config; check the model folder")
        model.refresh_image_rows()
        return model.eval()

    # -- the core's interface ----------------------------------------------------------------
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
