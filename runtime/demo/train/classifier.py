"""Stage 5: the quality classifier, on freshly rendered images (half of each batch blurred)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from runtime.demo.dataset import VAL_SEED
from runtime.demo.train.inputs import Progress, images_tensor, no_progress
from runtime.training.drafter_training import lr_at, set_lr

# --------------------------------------------------------------------------------------------
# 5. Classifier
# --------------------------------------------------------------------------------------------


@dataclass
class ClassifierTrainResult:
    val_accuracy: float  # on real validation images
    steps: int
    seconds: float


def train_classifier(classifier: "DemoClassifier", *, steps: int, batch: int, seed: int, lr: float = 3e-3,
                     progress: Progress = no_progress) -> ClassifierTrainResult:
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
        x, y = images_tensor(seed, np.arange(base + step * batch, base + (step + 1) * batch))
        half = batch // 2
        x[:half] = F.avg_pool2d(F.pad(x[:half], (1, 1, 1, 1), mode="replicate"), 3, stride=1)
        loss = F.cross_entropy(classifier(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        progress("classifier", step + 1, steps, {"loss": loss.item()})
    classifier.eval()
    x, y = images_tensor(VAL_SEED, np.arange(600))
    with torch.no_grad():
        acc = float((classifier.predict(x) == y).float().mean())
    return ClassifierTrainResult(val_accuracy=acc, steps=steps, seconds=time.perf_counter() - t0)
