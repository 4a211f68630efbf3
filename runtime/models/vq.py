"""LlamaGen's VQ image tokenizer (`VQ-16`, `VQ-8`, and small variants of the same class).

Numerically faithful to `tokenizer/tokenizer_image/vq_model.py` of FoundationVision/LlamaGen and
state-dict compatible with its checkpoints (`vq_ds16_c2i.pt`, ...): module names, buffer names and
the order of operations are the official ones.

Shapes (D = 2**(len(ch_mult) - 1) downsample, C = codebook_embed_dim, h = H/D, w = W/D):
    image  (B, 3, H, W) in [-1, 1]
    quant  (B, C, h, w), rows of the l2-normalised codebook
    tokens (B, h*w) int64, raster order (token k sits at row k // w, column k % w), which is the
    order LlamaGen's GPT generates and its 2D RoPE assumes.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.utils.errors import UserError
from runtime.models.configs import VQ_CONFIGS, VQConfig

# Length of the ring buffer of recent code indices kept for the usage statistic; the official
# checkpoints store it as the float buffer `quantize.codebook_used`.
CODEBOOK_USAGE_WINDOW = 65536


def swish(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def group_norm(channels: int, groups: int) -> nn.GroupNorm:
    if channels % groups:
        raise ValueError(f"GroupNorm: {channels} channels are not divisible by {groups} groups")
    return nn.GroupNorm(num_groups=groups, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """norm1 -> swish -> conv1 -> norm2 -> swish -> dropout -> conv2, plus a (1x1) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, *, groups: int, dropout: float = 0.0):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.norm1 = group_norm(in_channels, groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.norm2 = group_norm(out_channels, groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(self.dropout(swish(self.norm2(h))))
        if self.in_channels != self.out_channels:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the h*w positions of a feature map, with a residual."""

    def __init__(self, channels: int, *, groups: int):
        super().__init__()
        self.norm = group_norm(channels, groups)
        self.q = nn.Conv2d(channels, channels, kernel_size=1)
        self.k = nn.Conv2d(channels, channels, kernel_size=1)
        self.v = nn.Conv2d(channels, channels, kernel_size=1)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        # Explicit bmm + softmax, as the reference does (an SDPA kernel rounds differently).
        q = q.reshape(b, c, h * w).permute(0, 2, 1)  # (b, hw, c)
        k = k.reshape(b, c, h * w)  # (b, c, hw)
        weights = torch.bmm(q, k) * (int(c) ** (-0.5))  # (b, hw_q, hw_k)
        weights = F.softmax(weights, dim=2)
        v = v.reshape(b, c, h * w)
        out = torch.bmm(v, weights.permute(0, 2, 1)).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Pad right/bottom by one zero, then a stride-2 3x3 conv (halves h and w)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Upsample(nn.Module):
    """Nearest-neighbour x2, then a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Encoder(nn.Module):
    """(B, in_channels, H, W) -> (B, z_channels, H/D, W/D); attention only at the last level."""

    def __init__(self, *, in_channels: int = 3, ch: int = 128, ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
                 num_res_blocks: int = 2, z_channels: int = 256, groups: int = 32, dropout: float = 0.0):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.num_res_blocks = num_res_blocks
        self.conv_in = nn.Conv2d(in_channels, ch, kernel_size=3, stride=1, padding=1)

        in_ch_mult = (1,) + tuple(ch_mult)
        self.conv_blocks = nn.ModuleList()
        block_in = ch
        for level in range(self.num_resolutions):
            block = nn.Module()
            block.res = nn.ModuleList()
            block.attn = nn.ModuleList()
            block_in = ch * in_ch_mult[level]
            block_out = ch * ch_mult[level]
            for _ in range(num_res_blocks):
                block.res.append(ResnetBlock(block_in, block_out, groups=groups, dropout=dropout))
                block_in = block_out
                if level == self.num_resolutions - 1:
                    block.attn.append(AttnBlock(block_in, groups=groups))
            if level != self.num_resolutions - 1:
                block.downsample = Downsample(block_in)
            self.conv_blocks.append(block)

        self.mid = nn.ModuleList([
            ResnetBlock(block_in, block_in, groups=groups, dropout=dropout),
            AttnBlock(block_in, groups=groups),
            ResnetBlock(block_in, block_in, groups=groups, dropout=dropout),
        ])
        self.norm_out = group_norm(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, z_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level, block in enumerate(self.conv_blocks):
            for i in range(self.num_res_blocks):
                h = block.res[i](h)
                if len(block.attn) > 0:
                    h = block.attn[i](h)
            if level != self.num_resolutions - 1:
                h = block.downsample(h)
        for layer in self.mid:
            h = layer(h)
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    """(B, z_channels, h, w) -> (B, out_channels, h*D, w*D); `conv_blocks.0` is the deepest level."""

    def __init__(self, *, z_channels: int = 256, ch: int = 128, ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
                 num_res_blocks: int = 2, out_channels: int = 3, groups: int = 32, dropout: float = 0.0):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.num_res_blocks = num_res_blocks
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, kernel_size=3, stride=1, padding=1)
        self.mid = nn.ModuleList([
            ResnetBlock(block_in, block_in, groups=groups, dropout=dropout),
            AttnBlock(block_in, groups=groups),
            ResnetBlock(block_in, block_in, groups=groups, dropout=dropout),
        ])

        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(self.num_resolutions)):
            block = nn.Module()
            block.res = nn.ModuleList()
            block.attn = nn.ModuleList()
            block_out = ch * ch_mult[level]
            for _ in range(num_res_blocks + 1):
                block.res.append(ResnetBlock(block_in, block_out, groups=groups, dropout=dropout))
                block_in = block_out
                if level == self.num_resolutions - 1:
                    block.attn.append(AttnBlock(block_in, groups=groups))
            if level != 0:
                block.upsample = Upsample(block_in)
            self.conv_blocks.append(block)

        self.norm_out = group_norm(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, out_channels, kernel_size=3, stride=1, padding=1)

    @property
    def last_layer(self) -> Tensor:
        """Weight of the final conv (GAN losses balance their gradient against it)."""
        return self.conv_out.weight

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(z)
        for layer in self.mid:
            h = layer(h)
        for i_block, block in enumerate(self.conv_blocks):
            for i in range(self.num_res_blocks + 1):
                h = block.res[i](h)
                if len(block.attn) > 0:
                    h = block.attn[i](h)
            if i_block != self.num_resolutions - 1:
                h = block.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


def entropy_loss(affinity: Tensor, temperature: float = 0.01) -> Tensor:
    """LlamaGen's codebook entropy regulariser: per-sample entropy minus batch-mean entropy.

    affinity: (N, codebook_size) negative squared distances.
    """
    flat = affinity.reshape(-1, affinity.shape[-1]) / temperature
    probs = F.softmax(flat, dim=-1)
    log_probs = F.log_softmax(flat + 1e-5, dim=-1)
    avg_probs = probs.mean(dim=0)
    avg_entropy = -torch.sum(avg_probs * torch.log(avg_probs + 1e-5))
    sample_entropy = -torch.mean(torch.sum(probs * log_probs, dim=-1))
    return sample_entropy - avg_entropy


class VectorQuantizer(nn.Module):
    """Nearest-neighbour quantiser over a codebook of `n_e` vectors of size `e_dim`.

    The codebook weight `embedding.weight` (n_e, e_dim) is stored un-normalised; with
    `l2_norm` both the inputs and the codebook rows are l2-normalised at use, so the chosen
    code is the one with the largest cosine similarity and the output rows have unit norm.
    """

    def __init__(self, n_e: int, e_dim: int, beta: float, entropy_loss_ratio: float,
                 l2_norm: bool, show_usage: bool):
        super().__init__()
        self.n_e = n_e
        self.e_dim = e_dim
        self.beta = beta
        self.entropy_loss_ratio = entropy_loss_ratio
        self.l2_norm = l2_norm
        self.show_usage = show_usage
        self.embedding = nn.Embedding(n_e, e_dim)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / n_e, 1.0 / n_e)
            if l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, p=2, dim=-1))
        if show_usage:
            self.register_buffer("codebook_used", torch.zeros(CODEBOOK_USAGE_WINDOW))

    def codebook(self) -> Tensor:
        """The codebook as used for lookup: (n_e, e_dim), l2-normalised rows when `l2_norm`."""
        weight = self.embedding.weight
        return F.normalize(weight, p=2, dim=-1) if self.l2_norm else weight

    def forward(self, z: Tensor) -> tuple[Tensor, tuple[Tensor | None, Tensor | None, Tensor | None, float], Tensor]:
        """Quantise z (B, e_dim, h, w).

        Returns (z_q (B, e_dim, h, w): the selected codebook rows, with straight-through gradients
        to z when z requires grad,
        (vq_loss, commit_loss, entropy_loss, codebook_usage) -- the losses are None in eval mode,
        indices (B*h*w,) int64 in (b, h, w) row-major order).
        """
        z = torch.einsum("b c h w -> b h w c", z).contiguous()
        z_flat = z.view(-1, self.e_dim)
        if self.l2_norm:
            z = F.normalize(z, p=2, dim=-1)
            z_flat = F.normalize(z_flat, p=2, dim=-1)
        embedding = self.codebook()

        # Squared distance expanded as z^2 + e^2 - 2 z.e, exactly as the reference, so ties and
        # near-ties resolve to the same code.
        d = (torch.sum(z_flat**2, dim=1, keepdim=True) + torch.sum(embedding**2, dim=1)
             - 2 * torch.einsum("bd,dn->bn", z_flat, torch.einsum("n d -> d n", embedding)))
        indices = torch.argmin(d, dim=1)
        z_q = embedding[indices].view(z.shape)

        vq_loss = commit_loss = ent_loss = None
        usage = 0.0
        if self.show_usage and self.training:
            recent = indices[-CODEBOOK_USAGE_WINDOW:].to(self.codebook_used.dtype)
            n = recent.shape[0]
            self.codebook_used[:-n] = self.codebook_used[n:].clone()
            self.codebook_used[-n:] = recent
            usage = len(torch.unique(self.codebook_used)) / self.n_e
        if self.training:
            vq_loss = torch.mean((z_q - z.detach()) ** 2)
            commit_loss = self.beta * torch.mean((z_q.detach() - z) ** 2)
            ent_loss = self.entropy_loss_ratio * entropy_loss(-d)

        if z.requires_grad:
            # Straight-through estimator. Skipped without autograd so that inference returns the
            # codebook rows exactly (z + (z_q - z) is off by rounding), equal to decode_code's input.
            z_q = z + (z_q - z).detach()
        # contiguous: a permuted (channels-last) view would send the decoder convs down another
        # kernel path and make decode(quant) differ in rounding from decode_code(indices).
        z_q = torch.einsum("b h w c -> b c h w", z_q).contiguous()
        return z_q, (vq_loss, commit_loss, ent_loss, usage), indices

    def get_codebook_entry(self, indices: Tensor, shape: Sequence[int] | None = None,
                           channel_first: bool = True) -> Tensor:
        """Codebook rows for `indices` (any shape).

        Without `shape`: (*indices.shape, e_dim). With `shape` = (B, C, h, w) (channel_first) the
        rows are laid out as (B, C, h, w); otherwise `shape` is the final (B, h, w, C) view.
        """
        z_q = self.codebook()[indices]
        if shape is not None:
            if channel_first:
                z_q = z_q.reshape(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2).contiguous()
            else:
                z_q = z_q.view(*shape)
        return z_q


class VQModel(nn.Module):
    """LlamaGen VQ tokenizer: encoder -> quant_conv -> quantizer -> post_quant_conv -> decoder.

    Use `encode` to tokenise images, `decode_code` to turn generated tokens into images and
    `codebook_vectors` for codebook-proximity sets. `forward` is the training forward.
    """

    def __init__(self, config: VQConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(ch=config.ch, ch_mult=config.encoder_ch_mult, num_res_blocks=config.num_res_blocks,
                               z_channels=config.z_channels, groups=config.norm_groups, dropout=config.dropout_p)
        self.decoder = Decoder(ch=config.ch, ch_mult=config.decoder_ch_mult, num_res_blocks=config.num_res_blocks,
                               z_channels=config.z_channels, groups=config.norm_groups, dropout=config.dropout_p)
        self.quantize = VectorQuantizer(config.codebook_size, config.codebook_embed_dim, config.commit_loss_beta,
                                        config.entropy_loss_ratio, config.codebook_l2_norm,
                                        config.codebook_show_usage)
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, 1)

    @property
    def downsample(self) -> int:
        """Pixels per token along each side (16 for VQ-16)."""
        return 2 ** (len(self.config.encoder_ch_mult) - 1)

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Tokenise images x (B, 3, H, W) in [-1, 1].

        Returns (quant (B, C, h, w), tokens (B, h*w) int64 in raster order).
        """
        h = self.quant_conv(self.encoder(x))
        quant, _, indices = self.quantize(h)
        return quant, indices.view(x.shape[0], -1)

    def decode(self, quant: Tensor) -> Tensor:
        """quant (B, C, h, w) -> image (B, 3, h*D, w*D), roughly in [-1, 1] (not clamped)."""
        return self.decoder(self.post_quant_conv(quant))

    def decode_code(self, indices: Tensor, shape: Sequence[int] | None = None) -> Tensor:
        """Tokens -> image (B, 3, h*D, w*D).

        indices: (B, h*w) raster order (square grid assumed), (B, h, w), or any shape with
        B*h*w elements when `shape` = (B, C, h, w) is given (LlamaGen's `qzshape`).
        """
        if shape is None:
            shape = self._latent_shape(indices)
        quant = self.quantize.get_codebook_entry(indices.reshape(-1), shape, channel_first=True)
        return self.decode(quant)

    def _latent_shape(self, indices: Tensor) -> tuple[int, int, int, int]:
        c = self.config.codebook_embed_dim
        if indices.dim() == 3:
            return (indices.shape[0], c, indices.shape[1], indices.shape[2])
        if indices.dim() == 2:
            g = math.isqrt(indices.shape[1])
            if g * g == indices.shape[1]:
                return (indices.shape[0], c, g, g)
        raise ValueError(f"decode_code: cannot infer a square token grid from indices of shape "
                         f"{tuple(indices.shape)}; pass shape=(B, {c}, h, w)")

    def codebook_vectors(self, normalized: bool = True) -> Tensor:
        """The codebook (codebook_size, embed_dim), detached.

        normalized=True gives the rows the quantiser actually uses (l2-normalised when
        `codebook_l2_norm`); normalized=False gives the raw stored weight, which is what LANTERN
        ranked by L2 distance to build its proximity sets.
        """
        weight = self.quantize.codebook() if normalized else self.quantize.embedding.weight
        return weight.detach()

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[Tensor | None, Tensor | None, Tensor | None, float]]:
        """Training forward: x (B, 3, H, W) -> (reconstruction (B, 3, H, W),
        (vq_loss, commit_loss, entropy_loss, codebook_usage)), as LlamaGen's `VQModel.forward`."""
        h = self.quant_conv(self.encoder(x))
        quant, losses, _ = self.quantize(h)
        return self.decode(quant), losses


def vq_model(name: str = "VQ-16", **overrides: object) -> VQModel:
    """Build a named VQ tokenizer (`VQ-16`, `VQ-8`) with optional config overrides."""
    if name not in VQ_CONFIGS:
        raise UserError(f"unknown VQ model {name!r}; choose one of {', '.join(VQ_CONFIGS)}")
    return VQModel(replace(VQ_CONFIGS[name], **overrides))
