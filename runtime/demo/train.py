"""Training of the embedded demo bundle: tokenizer, target GPT, drafter and quality classifier.

`train_demo(out_dir, DemoTrainConfig(...))` rebuilds the whole bundle from scratch on the CPU
(`runtime train demo`). Stages, each deterministic given the seed (up to the thread count's
effect on float summation order):

1. **VQ tokenizer** (`runtime.models.vq.VQModel`, small config, 4x downsample so a 64x64 image
   is a 16x16 = 256-token grid, LlamaGen-256's sequence length). Trained as a VQ-VAE on freshly
   rendered images: L1 + L2 reconstruction + the quantiser's codebook and commitment losses.
   The codebook is initialised by spherical k-means over the (untrained) encoder's outputs,
   and codes unused over a window of steps are restarted at random encoder outputs of the
   current batch during the first part of training, so nearly the whole codebook is in use.
2. **Tokenised dataset**: `n_token_images` training images (seed `seed`) and a validation set
   (seed `VAL_SEED`) encoded once with the trained tokenizer.
3. **Target** (`runtime.models.gpt.Transformer`, c2i, `GPT-demo` shape with overrides): next
   token cross-entropy, label dropout to the null class (inside the model) for CFG, AdamW with
   warm-up and cosine decay. Two choices buy sample quality within a CPU budget: the token
   embedding and output head start from the VQ codebook (`init_embeddings_from_codebook`),
   and the first half of the steps train on top-half prefixes (`train_gpt`).
4. **Drafter** (`runtime.models.drafter.Drafter`, EAGLE/LANTERN layout): teacher-forced on the
   trained target's post-norm hidden states over real tokens (10% of samples with the null
   class, so the CFG-unconditional branch is learned); embedding copied from the target and
   frozen; loss SmoothL1 + 0.1 x soft cross-entropy through the target's lm_head, uniform
   noise on the input hiddens (EAGLE's convention).
5. **Classifier** (`runtime.demo.classifier.DemoClassifier`) on freshly rendered images.

Weights of the target and drafter are stored in fp16 to keep the bundle small; every metric in
the manifest is measured after that round trip, i.e. on the weights that ship.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from runtime.demo.dataset import (CLASS_NAMES, IMAGE_SIZE, NUM_CLASSES, VAL_SEED, make_images,
                                  to_tensor_range)
from runtime.drafter_training import lr_at, set_lr
from runtime.models.configs import VQConfig
from runtime.models.vq import VQModel

# progress(stage, done, total, info): called after every step of every stage.
Progress = Callable[[str, int, int, dict[str, float]], None]


def _no_progress(stage: str, done: int, total: int, info: dict[str, float]) -> None:
    return None


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


def _images_tensor(seed: int, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Render dataset samples as the VQ input: (B, 3, 64, 64) float32 in [-1, 1], labels (B,)."""
    images, labels = make_images(seed, indices)
    return torch.from_numpy(to_tensor_range(images)), torch.from_numpy(labels)


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
             progress: Progress = _no_progress) -> VQTrainResult:
    """Train `vq` in place as a VQ-VAE on freshly rendered images (samples steps*batch of `seed`).

    Dead codes (unused over the last `restart_every` steps) are moved onto random encoder
    outputs of the current batch until `restart_until` of the steps have run.
    """
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    n_codes = vq.config.codebook_size
    vq.train()
    # k-means initialisation of the codebook over the untrained encoder's outputs.
    x0, _ = _images_tensor(seed, np.arange(10_000_000, 10_000_000 + 64))
    points = _encoder_directions(vq, x0)
    with torch.no_grad():
        vq.quantize.embedding.weight.copy_(spherical_kmeans(points, n_codes, 10, gen))

    opt = torch.optim.AdamW(vq.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    used = torch.zeros(n_codes, dtype=torch.bool)
    for step in range(steps):
        set_lr(opt, lr_at(step, steps, lr, warmup=max(1, steps // 20)))
        x, _ = _images_tensor(seed, np.arange(step * batch, (step + 1) * batch))
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
        x, _ = _images_tensor(VAL_SEED, np.arange(start, min(n, start + batch)))
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
                    progress: Progress = _no_progress, stage: str = "tokenize") -> tuple[torch.Tensor, torch.Tensor]:
    """Encode samples 0..n-1 of `seed`: tokens (n, 256) int64 in raster order, labels (n,)."""
    vq.eval()
    tokens = torch.empty(n, (IMAGE_SIZE // vq.downsample) ** 2, dtype=torch.long)
    labels = torch.empty(n, dtype=torch.long)
    for start in range(0, n, batch):
        stop = min(n, start + batch)
        x, y = _images_tensor(seed, np.arange(start, stop))
        tokens[start:stop] = vq.encode(x.contiguous(memory_format=torch.channels_last))[1]
        labels[start:stop] = y
        progress(stage, stop, n, {})
    return tokens, labels


# --------------------------------------------------------------------------------------------
# 3. Target GPT
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def init_embeddings_from_codebook(gpt: "Transformer", codebook: torch.Tensor, generator: torch.Generator,
                                  std: float = 0.02, jitter: float = 0.25) -> None:
    """Initialise the target's input embedding and output head from the VQ codebook.

    codebook: (V, C) l2-normalised code vectors. Row v of each matrix becomes
    codebook[v] @ R (R a random (C, dim) projection, scaled to `std` per entry), plus
    `jitter * std` of independent noise. Codes that decode to near-identical patches then
    start with near-identical embeddings and logits, so the model does not have to discover
    from co-occurrence alone which of the many near-interchangeable codes mean the same thing;
    training is free to pull them apart. (LlamaGen initialises both from N(0, 0.02), the head
    at zero.)
    """
    v, c = codebook.shape
    for weight in (gpt.tok_embeddings.weight, gpt.output.weight):
        proj = torch.randn(c, weight.shape[1], generator=generator) * std
        structured = codebook.float() @ proj  # entries ~ N(0, std^2) for unit-norm rows
        noise = torch.randn(weight.shape, generator=generator) * (jitter * std)
        weight.copy_((structured + noise).to(weight.dtype))


@dataclass
class GPTTrainResult:
    train_loss: float  # mean over the last 10% of steps
    val_loss: float  # token cross-entropy (nats) on the validation tokens, true labels
    steps: int
    seconds: float


def train_gpt(gpt: "Transformer", tokens: torch.Tensor, labels: torch.Tensor, val_tokens: torch.Tensor,
              val_labels: torch.Tensor, *, steps: int, batch: int, seed: int, lr: float = 2.5e-3,
              weight_decay: float = 0.05, prefix_fraction: float = 0.5,
              progress: Progress = _no_progress) -> GPTTrainResult:
    """Next-token training of `gpt` in place on (tokens (N, 256), labels (N,)) for `steps`
    minibatches, sampled as shuffled epochs.

    Curriculum: the first `prefix_fraction` of the steps train on the top half of each image
    (the first block_size/2 tokens, at their true positions) with twice the batch, which costs
    less than a full-length batch (attention is quadratic) yet shows twice the images; the
    patterns learnt there are the same at every row. The rest trains on whole images.
    """
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in gpt.named_parameters() if p.dim() >= 2 and "embedding" not in n]
    no_decay = [p for n, p in gpt.named_parameters() if p.dim() < 2 or "embedding" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    order = torch.randperm(len(tokens), generator=gen)
    cursor = 0
    losses: list[float] = []
    half = tokens.shape[1] // 2
    gpt.train()
    for step in range(steps):
        set_lr(opt, lr_at(step, steps, lr, warmup=max(1, steps // 25)))
        prefix = step < prefix_fraction * steps
        n = min(2 * batch, len(tokens)) if prefix else batch
        if cursor + n > len(order):
            order, cursor = torch.randperm(len(tokens), generator=gen), 0
        pick = order[cursor:cursor + n]
        cursor += n
        idx = tokens[pick, :half] if prefix else tokens[pick]
        logits, _ = gpt.forward_train(labels[pick], idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        progress("gpt", step + 1, steps, {"loss": losses[-1]})
    gpt.eval()
    tail = losses[-max(1, steps // 10):]
    return GPTTrainResult(train_loss=float(np.mean(tail)), val_loss=gpt_val_loss(gpt, val_tokens, val_labels),
                          steps=steps, seconds=time.perf_counter() - t0)


@torch.no_grad()
def gpt_val_loss(gpt: "Transformer", tokens: torch.Tensor, labels: torch.Tensor, batch: int = 64) -> float:
    """Mean token cross-entropy (nats) of `gpt` (eval mode: no label dropout) on tokens (N, 256)."""
    gpt.eval()
    total = 0.0
    for start in range(0, len(tokens), batch):
        idx = tokens[start:start + batch]
        logits, _ = gpt.forward_train(labels[start:start + batch], idx)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1), reduction="sum"))
    return total / tokens.numel()


# --------------------------------------------------------------------------------------------
# 4. Drafter
# --------------------------------------------------------------------------------------------

# EAGLE's uniform input-noise convention: hidden += (U[0,1) - 0.5) * std * 512 / seq_len.
DRAFTER_NOISE_STD = 0.2
DRAFTER_NULL_CLASS_PROB = 0.1


@torch.no_grad()
def teacher_hiddens(gpt: "Transformer", tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Target hidden states (B, S, dim) post-final-norm, S = block_size: position p (the class
    position for p = 0) is the state that predicted image token p."""
    gpt.eval()
    _, hidden = gpt.forward_train(labels, tokens)
    return hidden


def _drafter_inputs(gpt: "Transformer", tokens: torch.Tensor, labels: torch.Tensor,
                    gen: torch.Generator, null_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced hiddens for a batch, with a `null_prob` share of rows on the null class."""
    null = torch.rand(labels.shape, generator=gen) < null_prob
    cond = torch.where(null, torch.full_like(labels, gpt.config.num_classes), labels)
    return teacher_hiddens(gpt, tokens, cond), cond


@dataclass
class DrafterTrainResult:
    top1_vs_target: float  # drafter argmax == target argmax for the next token (val, true labels)
    vloss: float
    ploss: float
    steps: int
    seconds: float


def train_drafter(drafter: "Drafter", gpt: "Transformer", tokens: torch.Tensor, labels: torch.Tensor,
                  val_tokens: torch.Tensor, val_labels: torch.Tensor, *, steps: int, batch: int, seed: int,
                  lr: float = 1e-3, progress: Progress = _no_progress) -> DrafterTrainResult:
    """EAGLE/LANTERN drafter training on the frozen target's teacher-forced hidden states.

    Drafter position p pairs image token z_p with target hidden h_p (h_0 = the class
    position); its output at p regresses h_{p+1}, for p = 0..S-2.
    """
    from runtime.drafter_training import eagle_loss, freeze_for_training

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    params = freeze_for_training(drafter, gpt)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    seq = gpt.config.block_size
    order = torch.randperm(len(tokens), generator=gen)
    cursor = 0
    drafter.train()
    for step in range(steps):
        set_lr(opt, lr_at(step, steps, lr, warmup=max(1, steps // 25)))
        if cursor + batch > len(order):
            order, cursor = torch.randperm(len(tokens), generator=gen), 0
        pick = order[cursor:cursor + batch]
        cursor += batch
        idx = tokens[pick]
        hidden, _ = _drafter_inputs(gpt, idx, labels[pick], gen, DRAFTER_NULL_CLASS_PROB)
        noise = (torch.rand(hidden.shape, generator=gen) - 0.5) * (DRAFTER_NOISE_STD * 512 / seq)
        loss, vloss, ploss = eagle_loss(drafter, gpt, idx, hidden, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(params, 0.5)
        opt.step()
        progress("drafter", step + 1, steps, {"vloss": vloss.item(), "ploss": ploss.item()})
    drafter.eval()
    for p in gpt.parameters():
        p.requires_grad_(True)
    metrics = drafter_val_metrics(drafter, gpt, val_tokens, val_labels)
    return DrafterTrainResult(steps=steps, seconds=time.perf_counter() - t0, **metrics)


@torch.no_grad()
def drafter_val_metrics(drafter: "Drafter", gpt: "Transformer", tokens: torch.Tensor, labels: torch.Tensor,
                        batch: int = 32) -> dict[str, float]:
    """Teacher-forced agreement of the drafter with the target on validation tokens."""
    from runtime.models.drafter import drafter_loss

    drafter.eval()
    agree = count = 0
    vloss = ploss = 0.0
    for start in range(0, len(tokens), batch):
        idx = tokens[start:start + batch]
        hidden = teacher_hiddens(gpt, idx, labels[start:start + batch])
        out = drafter.forward_train(hidden, idx)[:, :-1]
        target = hidden[:, 1:]
        agree += int((gpt.logits(out).argmax(-1) == gpt.logits(target).argmax(-1)).sum())
        count += target.shape[0] * target.shape[1]
        _, v, p = drafter_loss(out, target, gpt.output, torch.ones(target.shape[:2]))
        vloss += float(v) * len(idx)
        ploss += float(p) * len(idx)
    return {"top1_vs_target": agree / count, "vloss": vloss / len(tokens), "ploss": ploss / len(tokens)}


# --------------------------------------------------------------------------------------------
# 5. Classifier
# --------------------------------------------------------------------------------------------


@dataclass
class ClassifierTrainResult:
    val_accuracy: float  # on real validation images
    steps: int
    seconds: float


def train_classifier(classifier: "DemoClassifier", *, steps: int, batch: int, seed: int, lr: float = 3e-3,
                     progress: Progress = _no_progress) -> ClassifierTrainResult:
    """Cross-entropy training on freshly rendered images (samples offset so they differ from
    the tokenizer's), then accuracy on 600 validation images.

    Half of every batch is blurred with a 3x3 box filter: generated images are VQ decodes,
    which lose the pixel noise and soften edges, and the classifier must not read that loss
    of detail as a class cue."""
    t0 = time.perf_counter()
    opt = torch.optim.AdamW(classifier.parameters(), lr=lr, weight_decay=1e-4)
    classifier.train()
    base = 20_000_000
    for step in range(steps):
        set_lr(opt, lr_at(step, steps, lr, warmup=max(1, steps // 20)))
        x, y = _images_tensor(seed, np.arange(base + step * batch, base + (step + 1) * batch))
        half = batch // 2
        x[:half] = F.avg_pool2d(F.pad(x[:half], (1, 1, 1, 1), mode="replicate"), 3, stride=1)
        loss = F.cross_entropy(classifier(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        progress("classifier", step + 1, steps, {"loss": loss.item()})
    classifier.eval()
    x, y = _images_tensor(VAL_SEED, np.arange(600))
    with torch.no_grad():
        acc = float((classifier.predict(x) == y).float().mean())
    return ClassifierTrainResult(val_accuracy=acc, steps=steps, seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# The whole bundle
# --------------------------------------------------------------------------------------------

# Sampling settings recorded in the manifest as the bundle's recommendation (`runtime run`
# defaults). lantern_k / lambda / delta are starting points, tuned from benchmark numbers.
RECOMMENDED_SAMPLING: dict[str, Any] = {
    "method": "lantern++",
    "tree": "naive_extend_57",
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "cfg": 3.0,
    "lantern_k": 32,
    "lantern_lambda": 2.0,
    "lantern_delta": 0.1,
}


@dataclass
class DemoTrainConfig:
    """Everything `runtime train demo` varies. Defaults: the full run that built the packaged
    bundle (3530 s with `--threads 1` on the 2-core machine while a second training shared it);
    `micro()` is the few-second smoke test."""

    seed: int = 0
    steps_vq: int = 1200
    steps_gpt: int = 1300
    steps_drafter: int = 200
    steps_classifier: int = 600
    batch_vq: int = 8
    batch_gpt: int = 16
    batch_drafter: int = 16
    batch_classifier: int = 32
    n_token_images: int = 12288  # training images tokenised for the target and drafter
    n_val_images: int = 256  # validation images (seed VAL_SEED) for the reported metrics
    n_sample_images: int = 48  # AR samples generated to measure quality (0: skip)
    n_real_images: int = 1200  # real reference images for the Frechet distance
    threads: int = 2
    gpt_layers: int = 4
    gpt_dim: int = 256
    gpt_heads: int = 8
    vq: VQConfig = field(default_factory=lambda: DEMO_VQ_CONFIG)

    @classmethod
    def micro(cls, seed: int = 0, threads: int = 2) -> "DemoTrainConfig":
        """A few steps of every stage on tiny data: exercises the whole path in seconds."""
        return cls(seed=seed, steps_vq=2, steps_gpt=2, steps_drafter=2, steps_classifier=2, batch_vq=4,
                   batch_gpt=4, batch_drafter=2, batch_classifier=8, n_token_images=16, n_val_images=8,
                   n_sample_images=0, n_real_images=24, threads=threads)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["vq"] = self.vq.to_dict()
        return d


def demo_gpt_config(cfg: DemoTrainConfig) -> "GPTConfig":
    """The target's config: `GPT-demo` resized; dropouts off (the data is never repeated
    often enough to overfit), label dropout kept for classifier-free guidance."""
    from runtime.models.configs import gpt_config

    return gpt_config("GPT-demo", image_size=IMAGE_SIZE, downsample=cfg.vq.downsample, num_classes=NUM_CLASSES,
                      vocab_size=cfg.vq.codebook_size, n_layer=cfg.gpt_layers, dim=cfg.gpt_dim,
                      n_head=cfg.gpt_heads, token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0,
                      class_dropout_prob=0.1)


def _n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def sample_quality(gpt: "Transformer", vq: VQModel, classifier: "DemoClassifier", *, n: int, seed: int,
                   n_real: int, sampling: dict[str, Any]) -> dict[str, Any]:
    """Class accuracy and FD of `n` AR samples (classes round-robin) at `sampling` settings,
    plus the same measures for VQ reconstructions of real images (the ceiling a perfect
    target could reach through this tokenizer)."""
    from runtime.core import MethodSpec, SamplingParams, generate
    from runtime.demo.dataset import EVAL_SEED, from_tensor_range
    from runtime.demo.quality import classify, real_features
    from runtime.metrics.frechet import frechet_distance

    real = real_features(classifier, n_real)
    # Reconstructions of held-out real images (indices past the reference set).
    x, y = _images_tensor(EVAL_SEED, np.arange(n_real, n_real + max(n, 2)))
    recon = from_tensor_range(vq.decode(vq.encode(x)[0]).numpy())
    preds, feats = classify(classifier, recon)
    out: dict[str, Any] = {"recon_class_accuracy": float((preds == y.numpy()).mean()),
                           "recon_fd": frechet_distance(feats, real), "n": n, "n_real": n_real}
    if n <= 0:
        return out
    spec = MethodSpec("ar", SamplingParams(temperature=sampling["temperature"], top_k=sampling["top_k"],
                                           top_p=sampling["top_p"], cfg=sampling["cfg"]))
    labels = np.arange(n) % NUM_CLASSES
    result = generate(gpt, None, spec, labels.tolist(), seed=seed)
    images = from_tensor_range(vq.decode_code(result.tokens).numpy())
    preds, feats = classify(classifier, images)
    out.update({"ar_class_accuracy": float((preds == labels).mean()), "ar_fd": frechet_distance(feats, real),
                "ar_settings": {k: sampling[k] for k in ("temperature", "top_k", "top_p", "cfg")}})
    return out


def _train_target_and_drafter(cfg: DemoTrainConfig, vq: VQModel, tokens: torch.Tensor, labels: torch.Tensor,
                              val_tokens: torch.Tensor, val_labels: torch.Tensor, progress: Progress
                              ) -> tuple["Transformer", GPTTrainResult, "Drafter", Any]:
    """The target (`cfg`'s shape, embeddings from `vq`'s codebook) and then its drafter, each
    trained and passed through the fp16 storage round trip, so later metrics see shipped weights.
    Draws from the global RNG as it stands (the caller seeds it)."""
    from runtime.demo.bundle import round_trip_
    from runtime.models.configs import DrafterConfig
    from runtime.models.drafter import Drafter
    from runtime.models.gpt import Transformer

    gpt_cfg = demo_gpt_config(cfg)
    gpt = Transformer(gpt_cfg)
    gpt.init_weights()
    init_embeddings_from_codebook(gpt, vq.codebook_vectors(), torch.Generator().manual_seed(cfg.seed + 1))
    gpt_res = train_gpt(gpt, tokens, labels, val_tokens, val_labels, steps=cfg.steps_gpt, batch=cfg.batch_gpt,
                        seed=cfg.seed, progress=progress)
    round_trip_(gpt, "gpt")
    drafter = Drafter(DrafterConfig.for_target(gpt_cfg))
    drafter_res = train_drafter(drafter, gpt, tokens, labels, val_tokens[:64], val_labels[:64],
                                steps=cfg.steps_drafter, batch=cfg.batch_drafter, seed=cfg.seed, progress=progress)
    round_trip_(drafter, "drafter")
    return gpt, gpt_res, drafter, drafter_res


def _source_tokens(model_dir: str | None, threads: int, progress: Progress) -> tuple[Any, int, int, torch.Tensor,
                                                                                       torch.Tensor]:
    """Load a bundle and re-tokenise its training data with its own VQ: (bundle, train seed,
    image count, tokens (N, 256), labels (N,)), the same tokens its target was trained on."""
    from runtime.demo.bundle import load_demo_bundle

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    bundle = load_demo_bundle(model_dir)
    data = bundle.manifest.get("training", {}).get("data", {})
    train_seed = int(data.get("train_seed", 0))
    n_images = int(data.get("n_token_images", DemoTrainConfig().n_token_images))
    tokens, labels = tokenize_images(bundle.vq, train_seed, n_images, progress=progress)
    return bundle, train_seed, n_images, tokens, labels


def train_demo(out_dir: str, cfg: DemoTrainConfig, *, command: str, overwrite: bool = False,
               progress: Progress = _no_progress) -> dict[str, Any]:
    """Train every part and write the bundle to `out_dir` (atomically). Returns the manifest."""
    from runtime.demo.bundle import save_demo_bundle
    from runtime.demo.classifier import ClassifierConfig, DemoClassifier
    from runtime.demo.dataset import dataset_hash

    t_start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    # Denormal arithmetic is orders of magnitude slower on x86; tiny gradients hit it.
    torch.set_flush_denormal(True)
    torch.manual_seed(cfg.seed)
    wall: dict[str, float] = {}

    vq = VQModel(cfg.vq).to(memory_format=torch.channels_last)
    vq_res = train_vq(vq, steps=cfg.steps_vq, batch=cfg.batch_vq, seed=cfg.seed, progress=progress)
    wall["vq"] = vq_res.seconds

    t = time.perf_counter()
    tokens, labels = tokenize_images(vq, cfg.seed, cfg.n_token_images, progress=progress)
    val_tokens, val_labels = tokenize_images(vq, VAL_SEED, cfg.n_val_images, progress=progress,
                                             stage="tokenize")
    wall["tokenize"] = time.perf_counter() - t

    gpt, gpt_res, drafter, drafter_res = _train_target_and_drafter(cfg, vq, tokens, labels, val_tokens,
                                                                   val_labels, progress)
    wall["gpt"], wall["drafter"] = gpt_res.seconds, drafter_res.seconds
    gpt_val_shipped = gpt_val_loss(gpt, val_tokens, val_labels)
    drafter_shipped = drafter_val_metrics(drafter, gpt, val_tokens[:64], val_labels[:64])

    classifier = DemoClassifier(ClassifierConfig(num_classes=NUM_CLASSES, image_size=IMAGE_SIZE))
    classifier = classifier.to(memory_format=torch.channels_last)
    cls_res = train_classifier(classifier, steps=cfg.steps_classifier, batch=cfg.batch_classifier,
                               seed=cfg.seed, progress=progress)
    wall["classifier"] = cls_res.seconds

    t = time.perf_counter()
    progress("evaluate", 0, 1, {})
    quality = sample_quality(gpt, vq, classifier, n=cfg.n_sample_images, seed=cfg.seed, n_real=cfg.n_real_images,
                             sampling=RECOMMENDED_SAMPLING)
    data_hash = dataset_hash(cfg.seed, cfg.n_token_images)
    progress("evaluate", 1, 1, {})
    wall["evaluate"] = time.perf_counter() - t
    wall["total"] = time.perf_counter() - t_start

    manifest: dict[str, Any] = {
        "name": "demo",
        "description": "LlamaGen-architecture c2i demo: procedural 64x64 shapes/patterns/textures, "
                       "16x16 VQ tokens, EAGLE/LANTERN drafter, quality classifier",
        "image_size": IMAGE_SIZE,
        "downsample": cfg.vq.downsample,
        "num_classes": NUM_CLASSES,
        "class_names": list(CLASS_NAMES),
        "recommended": dict(RECOMMENDED_SAMPLING),
        "params": {"gpt": _n_params(gpt), "vq": _n_params(vq), "drafter": _n_params(drafter),
                   "classifier": _n_params(classifier)},
        "training": {
            "command": command,
            "seed": cfg.seed,
            "config": cfg.to_dict(),
            "torch": torch.__version__,
            "data": {"generator": "runtime.demo.dataset", "train_seed": cfg.seed, "val_seed": VAL_SEED,
                     "n_token_images": cfg.n_token_images,
                     "sha256_first_n_token_images": data_hash},
            "vq_method": "VQ-VAE (L1 + L2 reconstruction + codebook + 0.25 x commitment losses); codebook "
                         "initialised by spherical k-means over the encoder's outputs; codes unused for 25 "
                         "steps restarted at random encoder outputs during the first 70% of steps",
            "gpt_method": "next-token cross-entropy; tok_embeddings and output head initialised from the VQ "
                          "codebook through a random projection (near-identical codes start near-identical); "
                          "first half of the steps on top-half prefixes at twice the batch; AdamW (0.9, 0.95), "
                          "warm-up + cosine; label dropout 0.1 for CFG",
            "drafter_method": "teacher-forced target hiddens over real tokens (10% null class); SmoothL1 + "
                              "0.1 x soft CE via the target lm_head; uniform input noise std 0.2 (EAGLE); "
                              "embed_tokens copied from the target and frozen",
            "steps": {"vq": cfg.steps_vq, "gpt": cfg.steps_gpt, "drafter": cfg.steps_drafter,
                      "classifier": cfg.steps_classifier},
            "wall_time_s": {k: round(v, 1) for k, v in wall.items()},
        },
        "metrics": {
            "vq": {"recon_l1": vq_res.recon_l1, "recon_mse": vq_res.recon_mse,
                   "codebook_usage": vq_res.codebook_usage},
            "gpt": {"train_loss": gpt_res.train_loss, "val_loss": gpt_val_shipped,
                    "val_loss_fp32": gpt_res.val_loss},
            "drafter": {"top1_vs_target": drafter_shipped["top1_vs_target"], "vloss": drafter_shipped["vloss"],
                        "ploss": drafter_shipped["ploss"]},
            "classifier": {"val_accuracy": cls_res.val_accuracy},
            "quality": quality,
        },
    }
    save_demo_bundle(out_dir, gpt=gpt, vq=vq, drafter=drafter, classifier=classifier, manifest=manifest,
                     overwrite=overwrite)
    return manifest


def retrain_drafter(model_dir: str | None, out_dir: str, *, steps: int, seed: int = 0, threads: int = 2,
                    batch: int = 16, lr: float = 1e-3, command: str, overwrite: bool = False,
                    progress: Progress = _no_progress) -> dict[str, Any]:
    """Train a fresh drafter for an existing bundle's frozen target and write the bundle with it.

    The training data are the bundle's own: the first `n_token_images` images of its training
    seed, tokenised by its VQ (the same tokens `train_demo` trained the target on). The VQ,
    target and classifier are copied unchanged; the manifest keeps the original training
    record and gains `training.drafter_retrain` (command, steps, wall time, metrics before).
    Deterministic for a given seed and thread count. Returns the new manifest.
    """
    from runtime.demo.bundle import round_trip_, save_demo_bundle
    from runtime.models.configs import DrafterConfig
    from runtime.models.drafter import Drafter

    t0 = time.perf_counter()
    bundle, train_seed, n_images, tokens, labels = _source_tokens(model_dir, threads, progress)
    val_tokens, val_labels = tokenize_images(bundle.vq, VAL_SEED, 64, progress=progress, stage="tokenize")
    before = drafter_val_metrics(bundle.drafter, bundle.gpt, val_tokens, val_labels)
    torch.manual_seed(seed + 1)
    drafter = Drafter(DrafterConfig.for_target(bundle.gpt.config))
    result = train_drafter(drafter, bundle.gpt, tokens, labels, val_tokens, val_labels, steps=steps,
                           batch=batch, seed=seed, lr=lr, progress=progress)
    round_trip_(drafter, "drafter")
    after = drafter_val_metrics(drafter, bundle.gpt, val_tokens, val_labels)

    manifest = copy.deepcopy(bundle.manifest)
    manifest.pop("storage_dtypes", None)
    manifest["metrics"]["drafter"] = after
    manifest.setdefault("training", {})["drafter_retrain"] = {
        "command": command, "steps": steps, "batch": batch, "lr": lr, "seed": seed, "threads": threads,
        "data": {"train_seed": train_seed, "n_token_images": n_images},
        "wall_time_s": round(time.perf_counter() - t0, 1), "drafter_seconds": round(result.seconds, 1),
        "metrics_before": before,
    }
    save_demo_bundle(out_dir, gpt=bundle.gpt, vq=bundle.vq, drafter=drafter, classifier=bundle.classifier,
                     manifest=manifest, overwrite=overwrite)
    return manifest


def retrain_target(model_dir: str | None, out_dir: str, *, layers: int, dim: int, heads: int, steps: int,
                   steps_drafter: int, seed: int = 0, threads: int = 2, command: str, overwrite: bool = False,
                   progress: Progress = _no_progress) -> dict[str, Any]:
    """Train a new target of another shape, and a drafter for it, on an existing bundle's tokens.

    The VQ, the training data (the bundle's own tokens, as `retrain_drafter` reads them) and
    the classifier are kept, so only the target's shape changes: quality and speed of the
    result compare directly with the source bundle's. The target and drafter are trained by
    the same recipe as in `train_demo`; the manifest keeps the source's record and gains
    `training.target_retrain` (command, shape, steps, wall time, the source's metrics).
    """
    from runtime.demo.bundle import save_demo_bundle

    t0 = time.perf_counter()
    bundle, train_seed, n_images, tokens, labels = _source_tokens(model_dir, threads, progress)
    source_cfg = bundle.manifest.get("training", {}).get("config", {})
    sizes = {k: int(source_cfg[k]) for k in ("n_val_images", "n_sample_images", "n_real_images", "batch_gpt",
                                             "batch_drafter") if k in source_cfg}
    cfg = DemoTrainConfig(seed=seed, threads=threads, steps_gpt=steps, steps_drafter=steps_drafter,
                          gpt_layers=layers, gpt_dim=dim, gpt_heads=heads, vq=bundle.vq.config, **sizes)
    val_tokens, val_labels = tokenize_images(bundle.vq, VAL_SEED, cfg.n_val_images, progress=progress,
                                             stage="tokenize")
    wall = {"tokenize": time.perf_counter() - t0}

    torch.manual_seed(seed)
    gpt, gpt_res, drafter, drafter_res = _train_target_and_drafter(cfg, bundle.vq, tokens, labels, val_tokens,
                                                                   val_labels, progress)
    wall["gpt"], wall["drafter"] = gpt_res.seconds, drafter_res.seconds

    t = time.perf_counter()
    progress("evaluate", 0, 1, {})
    quality = sample_quality(gpt, bundle.vq, bundle.classifier, n=cfg.n_sample_images, seed=seed,
                             n_real=cfg.n_real_images, sampling=RECOMMENDED_SAMPLING)
    progress("evaluate", 1, 1, {})
    wall["evaluate"] = time.perf_counter() - t
    wall["total"] = time.perf_counter() - t0

    manifest = copy.deepcopy(bundle.manifest)
    manifest.pop("storage_dtypes", None)
    source_metrics = {k: manifest["metrics"].get(k) for k in ("gpt", "drafter", "quality")}
    manifest["params"]["gpt"] = _n_params(gpt)
    manifest["params"]["drafter"] = _n_params(drafter)
    manifest["metrics"]["gpt"] = {"train_loss": gpt_res.train_loss,
                                  "val_loss": gpt_val_loss(gpt, val_tokens, val_labels),
                                  "val_loss_fp32": gpt_res.val_loss}
    manifest["metrics"]["drafter"] = drafter_val_metrics(drafter, gpt, val_tokens[:64], val_labels[:64])
    manifest["metrics"]["quality"] = quality
    manifest.setdefault("training", {}).pop("drafter_retrain", None)
    manifest["training"]["target_retrain"] = {
        "command": command, "shape": {"layers": layers, "dim": dim, "heads": heads},
        "steps": {"gpt": steps, "drafter": steps_drafter}, "seed": seed, "threads": threads,
        "data": {"train_seed": train_seed, "n_token_images": n_images},
        "wall_time_s": {k: round(v, 1) for k, v in wall.items()},
        "source_metrics": source_metrics,
    }
    save_demo_bundle(out_dir, gpt=gpt, vq=bundle.vq, drafter=drafter, classifier=bundle.classifier,
                     manifest=manifest, overwrite=overwrite)
    return manifest
