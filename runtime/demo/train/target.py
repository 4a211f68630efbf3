"""Stage 3: the target GPT (embeddings from the VQ codebook, top-half-prefix curriculum) and its
validation loss."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from runtime.demo.train.inputs import Progress, no_progress
from runtime.training.drafter_training import lr_at, set_lr

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
              progress: Progress = no_progress) -> GPTTrainResult:
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
