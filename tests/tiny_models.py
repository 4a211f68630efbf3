"""Tiny random LlamaGen targets and drafters for core tests (CPU, milliseconds per token).

Small vocabularies keep drafts frequently accepted, so acceptance paths are exercised even
though the drafter is untrained.
"""

from __future__ import annotations

import torch

from pathlib import Path
from typing import Any

from runtime.models.configs import VQ_CONFIGS, DrafterConfig, gpt_config
from runtime.models.drafter import Drafter
from runtime.models.gpt import Transformer
from runtime.models.vq import VQModel


def save_tiny_official(folder: Path, gpt_name: str = "gpt.pt", vq_name: str = "vq.pt", **extra: Any) -> Transformer:
    """GPT-tiny (4x4 tokens at 64 px, vocab 16384) and a VQ-16 saved as LlamaGen saves them
    ({"model": state dict, **extra}) in `folder`; returns the GPT (seeded, so every caller gets
    the same weights)."""
    torch.manual_seed(0)
    gpt = Transformer(gpt_config("GPT-tiny", image_size=64, vocab_size=16384))
    gpt.init_weights()
    torch.nn.init.normal_(gpt.output.weight, std=0.02)
    torch.save({"model": gpt.state_dict(), **extra}, folder / gpt_name)
    torch.save({"model": VQModel(VQ_CONFIGS["VQ-16"]).state_dict()}, folder / vq_name)
    return gpt


def tiny_pair(*, model_type: str = "c2i", vocab: int = 8, grid: int = 4, seed: int = 0,
              sharpness: float = 0.3) -> tuple[Transformer, Drafter]:
    """A target (block_size grid**2, `vocab` codes) and a drafter sharing its embeddings.

    `sharpness` is the std of the output head: larger means peakier target distributions.
    """
    torch.manual_seed(seed)
    cfg = gpt_config("GPT-tiny", model_type=model_type, image_size=grid * 16, downsample=16,
                     vocab_size=vocab, num_classes=4, caption_dim=16,
                     cls_token_num=1 if model_type == "c2i" else 5)
    target = Transformer(cfg)
    target.init_weights()
    torch.nn.init.normal_(target.output.weight, std=sharpness)
    drafter = Drafter(DrafterConfig.for_target(cfg))
    drafter.embed_tokens.weight.data.copy_(target.tok_embeddings.weight.data)
    return target.eval(), drafter.eval()


def caption(target: Transformer, n: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random caption features (n, cls, caption_dim) and their mask."""
    g = torch.Generator().manual_seed(seed)
    cfg = target.config
    emb = torch.randn(n, cfg.cls_token_num, cfg.caption_dim, generator=g)
    mask = torch.ones(n, cfg.cls_token_num, dtype=torch.bool)
    mask[:, :2] = False
    return emb * mask[..., None], mask
