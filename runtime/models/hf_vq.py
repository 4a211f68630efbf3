"""The VQ decoders of Janus and Emu3, as `transformers` ships them, behind the runtime's VQ
interface (`decode_code`, `codebook_vectors`, `downsample`, `config.codebook_size`).

The decoders run once per image, after decoding, so they are `transformers`' own modules
(`JanusVQVAE`, `Emu3VQVAE`) with the folder's `model.vqmodel.*` weights: images equal the
model's own `decode_image_tokens`. Output images are (B, 3, H, W) in about [-1, 1], the
runtime's convention (Janus's processor maps them to pixels as (x + 1) / 2; Emu3's VQ decoder
is trained to the same range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor, nn



@dataclass(frozen=True)
class HFVQConfig:
    codebook_size: int
    embed_dim: int


class TransformersVQ(nn.Module):
    """A `JanusVQVAE` or `Emu3VQVAE` decoding a (rows x cols) grid of codes; with `row_width`,
    each row of tokens ends with a row-end token that is dropped first (Emu3)."""

    def __init__(self, family: str, module: nn.Module, rows: int, cols: int, row_width: int = 0) -> None:
        super().__init__()
        self.family, self.vq, self.rows, self.cols, self.row_width = family, module, rows, cols, row_width
        weight = module.quantize.embedding.weight
        self.config = HFVQConfig(codebook_size=int(weight.shape[0]), embed_dim=int(weight.shape[1]))

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.vq.config.channel_multiplier) - 1)

    def decode_code(self, indices: Tensor, shape: Any = None) -> Tensor:
        """Codes (B, rows * cols) raster order (+ a row-end token per row with `row_width`) ->
        images (B, 3, rows * downsample, cols * downsample)."""
        b = indices.shape[0]
        if self.row_width:
            indices = indices.reshape(b, -1, self.row_width)[..., :-1]
        indices = indices.reshape(b, self.rows, self.cols).long()
        if self.family == "janus":
            return self.vq.decode(indices.reshape(b, -1))
        return self.vq.decode(indices)

    def codebook_vectors(self, normalized: bool = False) -> Tensor:
        """The codebook (codebook_size, embed_dim) LANTERN ranks by L2 distance; `normalized`: each
        row L2-normalised (Janus's decoder reads the normalised entries)."""
        weight = self.vq.quantize.embedding.weight.detach()
        return torch.nn.functional.normalize(weight, dim=-1) if normalized else weight


def build_vq(family: str, vq_config: Mapping[str, Any], state: Mapping[str, Tensor], rows: int, cols: int,
             row_width: int, source: str) -> TransformersVQ:
    """The family's VQ module from its `vq_config` and the folder's `model.vqmodel.*` weights."""
    import transformers

    if family == "janus":
        config = transformers.JanusVQVAEConfig(**{k: v for k, v in vq_config.items() if k != "model_type"})
        config.num_patches = rows
        module = transformers.JanusVQVAE(config)
    else:
        config = transformers.Emu3VQVAEConfig(**{k: v for k, v in vq_config.items() if k != "model_type"})
        module = transformers.Emu3VQVAE(config)
    from runtime.models.loading import load_state_dict_strict

    parts = {k[len("model.vqmodel."):]: v for k, v in state.items() if k.startswith("model.vqmodel.")}
    load_state_dict_strict(module, parts, f"{source} (model.vqmodel.*)",
                           hint="the folder must hold the whole model, VQ included, as its vq_config describes")
    return TransformersVQ(family, module.eval(), rows, cols, row_width)
