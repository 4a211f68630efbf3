"""Chameleon's VQ-VAE image decoder (the taming VQGAN layout of Meta's `vqgan.ckpt`).

`transformers` ships Chameleon's VQ encoder and codebook but not its decoder, so generated tokens
need this module: codebook lookup -> `post_quant_conv` -> decoder, with taming's parameter names
(`decoder.conv_in`, `decoder.mid.block_1`, `decoder.up.{i}.block.{j}`, ...) so Meta's checkpoint
(and an HF folder holding `model.vqmodel.decoder.*`) loads directly. The blocks are the runtime's
VQ blocks (`runtime/models/vq.py`), which compute what taming's do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch import Tensor, nn

from runtime.utils.errors import UserError
from runtime.models.vq import AttnBlock, ResnetBlock, Upsample, group_norm, swish


@dataclass(frozen=True)
class ChameleonVQConfig:
    codebook_size: int = 8192
    embed_dim: int = 256
    z_channels: int = 256
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    resolution: int = 512
    attn_resolutions: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, vq: Mapping[str, Any]) -> "ChameleonVQConfig":
        """From `transformers`' `vq_config` (or the old names of LANTERN's configs: ch, ch_mult, n_embed)."""
        def pick(*names: str, default: Any = None) -> Any:
            return next((vq[n] for n in names if n in vq and vq[n] is not None), default)

        return cls(codebook_size=int(pick("num_embeddings", "n_embed", default=8192)),
                   embed_dim=int(pick("embed_dim", default=256)),
                   z_channels=int(pick("latent_channels", "z_channels", default=256)),
                   ch=int(pick("base_channels", "ch", default=128)),
                   ch_mult=tuple(int(m) for m in pick("channel_multiplier", "ch_mult", default=(1, 1, 2, 2, 4))),
                   num_res_blocks=int(pick("num_res_blocks", default=2)),
                   resolution=int(pick("resolution", default=512)),
                   attn_resolutions=tuple(int(r) for r in pick("attn_resolutions", default=()) or ()))

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


class _Level(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.ModuleList()
        self.attn = nn.ModuleList()


class _Mid(nn.Module):
    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, groups=groups)
        self.attn_1 = AttnBlock(channels, groups=groups)
        self.block_2 = ResnetBlock(channels, channels, groups=groups)


class TamingDecoder(nn.Module):
    """(B, z_channels, h, w) -> (B, 3, h*D, w*D); `up.{i}` is level i (0 = full resolution)."""

    def __init__(self, cfg: ChameleonVQConfig, groups: int = 32) -> None:
        super().__init__()
        levels = len(cfg.ch_mult)
        block_in = cfg.ch * cfg.ch_mult[-1]
        res = cfg.resolution // cfg.downsample
        self.conv_in = nn.Conv2d(cfg.z_channels, block_in, 3, 1, 1)
        self.mid = _Mid(block_in, groups)
        up: list[_Level] = []
        for i in reversed(range(levels)):
            level = _Level()
            out = cfg.ch * cfg.ch_mult[i]
            for _ in range(cfg.num_res_blocks + 1):
                level.block.append(ResnetBlock(block_in, out, groups=groups))
                block_in = out
                if res in cfg.attn_resolutions:
                    level.attn.append(AttnBlock(block_in, groups=groups))
            if i != 0:
                level.upsample = Upsample(block_in)
                res *= 2
            up.insert(0, level)
        self.up = nn.ModuleList(up)
        self.norm_out = group_norm(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, 3, 3, 1, 1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for i in reversed(range(len(self.up))):
            level = self.up[i]
            for j, block in enumerate(level.block):
                h = block(h)
                if len(level.attn):
                    h = level.attn[j](h)
            if i != 0:
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(size, dim)


class ChameleonVQ(nn.Module):
    """What the runtime needs of a VQ: `decode_code`, `codebook_vectors`, `downsample`, `config.codebook_size`."""

    def __init__(self, config: ChameleonVQConfig, row_width: int = 0) -> None:
        super().__init__()
        self.config = config
        self.row_width = row_width  # > 0: tokens come in rows of row_width - 1 codes + a row-end token
        self.quantize = _Codebook(config.codebook_size, config.embed_dim)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.z_channels, 1)
        self.decoder = TamingDecoder(config)

    @property
    def downsample(self) -> int:
        return self.config.downsample

    def decode_code(self, indices: Tensor, shape: Sequence[int] | None = None) -> Tensor:
        """Codebook indices (B, h*w) raster order (square grid) -> images (B, 3, h*D, w*D), about [-1, 1].
        With `row_width`, each row's last token (the row-end token) is dropped first."""
        if self.row_width:
            indices = indices.reshape(indices.shape[0], -1, self.row_width)[..., :-1].reshape(indices.shape[0], -1)
        b, n = indices.shape[0], indices[0].numel()
        g = math.isqrt(n)
        if g * g != n:
            raise ValueError(f"decode_code: {n} tokens per image are not a square grid")
        quant = self.quantize.embedding(indices.reshape(b, g, g)).permute(0, 3, 1, 2).contiguous()
        return self.decoder(self.post_quant_conv(quant))

    def codebook_vectors(self, normalized: bool = False) -> Tensor:
        """The raw codebook (codebook_size, embed_dim): what LANTERN ranks by L2 distance."""
        return self.quantize.embedding.weight.detach()

    def load_parts(self, state: Mapping[str, Tensor], source: str) -> None:
        """Load `quantize.embedding.weight`, `post_quant_conv.*` and `decoder.*` from `state`
        (other keys, e.g. the encoder's, are ignored); every key this module holds must be there."""
        own = self.state_dict()
        missing = sorted(k for k in own if k not in state)
        if missing:
            raise UserError(f"{source}: the VQ decoder's weights are missing ({missing[0]} and {len(missing) - 1} "
                            "more); give Chameleon's vqgan.ckpt with --vq-ckpt")
        for key in own:
            if tuple(state[key].shape) != tuple(own[key].shape):
                raise UserError(f"{source}: {key} has shape {tuple(state[key].shape)}, the VQ config says "
                                f"{tuple(own[key].shape)}")
        self.load_state_dict({k: state[k] for k in own})
