"""What every training stage shares: the progress callback and the rendered images it trains on."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from runtime.demo.dataset import make_images, to_tensor_range

# progress(stage, done, total, info): called after every step of every stage.
Progress = Callable[[str, int, int, dict[str, float]], None]


def no_progress(stage: str, done: int, total: int, info: dict[str, float]) -> None:
    return None


def images_tensor(seed: int, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Render dataset samples as the VQ input: (B, 3, 64, 64) float32 in [-1, 1], labels (B,)."""
    images, labels = make_images(seed, indices)
    return torch.from_numpy(to_tensor_range(images)), torch.from_numpy(labels)
