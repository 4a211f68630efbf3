"""Stages 1 and 2: the VQ tokenizer trained as a VQ-VAE (k-means codebook initialisation, dead-code
restarts), then the training and validation images encoded once with it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from runtime.demo.dataset import IMAGE_SIZE, VAL_SEED
from runtime.demo.train.inputs import Progress, images_tensor, no_progress
from runtime.training.drafter_training import lr_at, set_lr
from runtime.models.configs import VQConfig
from runtime.models.vq import VQModel

# The demo tokenizer: 16 -> 32 -> 32 channels over three levels (4x downsample), one residual
# block per level. Small because convolutions are the slowest part of CPU training.
DEMO_VQ_CONFIG = VQConfig(
    codebook_size=512,
    codebook_embed_dim=8,
    codebook_l2_norm=True,
    codebook_show_usage=True,
    commit_loss_beta=0.25,
    entropy_loss_ratio=0.0,
    encoder_ch_mult=(1, 2, 2),
    decoder_ch_mult=(1, 2, 2),
    z_channels=64,
    ch=16,
    num_res_blocks=1,
    norm_groups=8,
    dropout_p=0.0,
)


# --------------------------------------------------------------------------------------------
# 1. VQ tokenizer
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def _encoder_directions(vq: VQModel, x: torch.Tensor) -> torch.Tensor:
    """Pre-quantisation vectors of images x, l2-normalised as the quantiser compares them: (N, C)."""
    z = vq.quant_conv(vq.encoder(x))
    z = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    return F.normalize(z, dim=-1)


@torch.no_grad()
def spherical_kmeans(points: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> torch.Tensor:
    """k unit-norm centroids of unit-norm `points` (N, C) by cosine k-means; empty clusters are
    re-seeded at random points. Returns (k, C)."""
    centroids = points[torch.randperm(points.shape[0], generator=generator)[:k]].clone()
    for _ in range(iters):
        assign = (points @ centroids.T).argmax(dim=1)
        sums = torch.zeros_like(centroids).index_add_(0, assign, points)
        counts = torch.bincount(assign, minlength=k)
        empty = counts == 0
        if empty.any():
            sums[empty] = points[torch.randint(points.shape[0], (int(empty.sum()),), generator=generator)]
        centroids = F.normalize(sums, dim=-1)
    return centroids


@dataclass
class VQTrainResult:
    recon_l1: float  # mean |x - x_hat| on validation images, in [-1, 1] units
    recon_mse: float
    codebook_usage: float  # fraction of codes used on the validation images
    steps: int
    seconds: float


def train_vq(vq: VQModel, *, steps: int, batch: int, seed: int, lr: float = 3e-3,
             restart_every: int = 25, restart_until: float = 0.7,
             progress: Progress = no_progress) -> VQTrainResult:
    """Train `vq` in place as a VQ-VAE on freshly rendered images (samples steps*batch of `seed`).

    Dead codes (unused over the last `restart_every` steps) are moved onto random encoder
    outputs of the current batch until `restart_until` of the steps have run.
    """
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    n_codes = vq.config.codebook_size
    vq.train()
    # k-means initialisation of the codebook over the untrained encoder's outputs.
    x0, _ = images_tensor(seed, np.arange(10_000_000, 10_000_000 + 64))
    points = _encoder_directions(vq, x0)
    with torch.no_grad():
        vq.quantize.embedding.weight.copy_(spherical_kmeans(points, n_codes, 10, gen))

    opt = torch.optim.AdamW(vq.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    used = torch.zeros(n_codes, dtype=torch.bool)
    for step in range(steps):
        set_lr(opt, lr_at(step, steps, lr, warmup=max(1, steps // 20)))
        x, _ = images_tensor(seed, np.arange(step * batch, (step + 1) * batch))
        h = vq.quant_conv(vq.encoder(x))
        quant, (vq_loss, commit_loss, _, _), indices = vq.quantize(h)
        recon = vq.decode(quant)
        l1 = (recon - x).abs().mean()
        mse = F.mse_loss(recon, x)
        loss = l1 + mse + vq_loss + commit_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        used[indices] = True
        if (step + 1) % restart_every == 0:
            if step < restart_until * steps:
                _restart_dead_codes(vq, h.detach(), ~used, gen)
            used.zero_()
        progress("vq", step + 1, steps, {"l1": l1.item(), "mse": mse.item()})

    vq.eval()
    metrics = evaluate_vq(vq, n=256)
    return VQTrainResult(steps=steps, seconds=time.perf_counter() - t0, **metrics)


@torch.no_grad()
def _restart_dead_codes(vq: VQModel, h: torch.Tensor, dead: torch.Tensor, gen: torch.Generator) -> None:
    """Move the codebook rows flagged `dead` (n_codes,) onto random batch vectors of h (B, C, h, w)."""
    n_dead = int(dead.sum())
    if n_dead == 0:
        return
    z = F.normalize(h.permute(0, 2, 3, 1).reshape(-1, h.shape[1]), dim=-1)
    pick = torch.randint(z.shape[0], (n_dead,), generator=gen)
    vq.quantize.embedding.weight[dead] = z[pick]


@torch.no_grad()
def evaluate_vq(vq: VQModel, n: int = 256, batch: int = 64) -> dict[str, float]:
    """Reconstruction error and codebook usage on n validation images (seed VAL_SEED)."""
    vq.eval()
    l1 = mse = 0.0
    counts = torch.zeros(vq.config.codebook_size, dtype=torch.long)
    for start in range(0, n, batch):
        x, _ = images_tensor(VAL_SEED, np.arange(start, min(n, start + batch)))
        quant, tokens = vq.encode(x)
        recon = vq.decode(quant)
        l1 += float((recon - x).abs().mean()) * x.shape[0]
        mse += float(F.mse_loss(recon, x)) * x.shape[0]
        counts += torch.bincount(tokens.reshape(-1), minlength=counts.numel())
    return {"recon_l1": l1 / n, "recon_mse": mse / n,
            "codebook_usage": float((counts > 0).float().mean())}


# --------------------------------------------------------------------------------------------
# 2. Tokenised dataset
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def tokenize_images(vq: VQModel, seed: int, n: int, batch: int = 128,
                    progress: Progress = no_progress, stage: str = "tokenize") -> tuple[torch.Tensor, torch.Tensor]:
    """Encode samples 0..n-1 of `seed`: tokens (n, 256) int64 in raster order, labels (n,)."""
    vq.eval()
    tokens = torch.empty(n, (IMAGE_SIZE // vq.downsample) ** 2, dtype=torch.long)
    labels = torch.empty(n, dtype=torch.long)
    for start in range(0, n, batch):
        stop = min(n, start + batch)
        x, y = images_tensor(seed, np.arange(start, stop))
        tokens[start:stop] = vq.encode(x.contiguous(memory_format=torch.channels_last))[1]
        labels[start:stop] = y
        progress(stage, stop, n, {})
    return tokens, labels
