"""Stage 4: the EAGLE/LANTERN drafter, teacher-forced on the frozen target's hidden states, and its
agreement with the target."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from runtime.demo.train.inputs import Progress, no_progress
from runtime.training.drafter_training import lr_at, set_lr

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
                  lr: float = 1e-3, progress: Progress = no_progress) -> DrafterTrainResult:
    """EAGLE/LANTERN drafter training on the frozen target's teacher-forced hidden states.

    Drafter position p pairs image token z_p with target hidden h_p (h_0 = the class
    position); its output at p regresses h_{p+1}, for p = 0..S-2.
    """
    from runtime.training.drafter_training import eagle_loss, freeze_for_training

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
