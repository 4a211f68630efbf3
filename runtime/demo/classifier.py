"""A small CNN classifier over the demo dataset: the demo's image-quality instrument.

It plays the role Inception plays for ImageNet FID: `predict` gives the class accuracy of
generated images (does an image of class c look like class c?) and `features` gives the
penultimate activations in which `runtime.metrics.frechet.frechet_distance` compares generated
and real image distributions.

Input: images (B, 3, 64, 64) float in [-1, 1] (the VQ's convention; `from_uint8` converts
(B, 64, 64, 3) uint8 arrays). Four conv stages (3x3 conv, BatchNorm, ReLU, 2x2 max-pool between
stages), global average pooling to `feature_dim` features, one linear layer to the classes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class ClassifierConfig:
    num_classes: int = 12
    image_size: int = 64
    widths: tuple[int, ...] = (16, 32, 64, 128)

    @property
    def feature_dim(self) -> int:
        return self.widths[-1]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["widths"] = list(self.widths)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ClassifierConfig":
        known = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in data.items() if k in known}
        if "widths" in kw:
            kw["widths"] = tuple(kw["widths"])
        return cls(**kw)


class DemoClassifier(nn.Module):
    """CNN over (B, 3, 64, 64) images in [-1, 1] -> class logits (B, num_classes)."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        c_in = 3
        for i, width in enumerate(config.widths):
            if i > 0:
                layers.append(nn.MaxPool2d(2))
            layers += [nn.Conv2d(c_in, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
            c_in = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(config.feature_dim, config.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features (B, feature_dim): globally averaged last conv stage."""
        return self.body(x).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted class ids (B,) long."""
        return self(x).argmax(dim=-1)

    @staticmethod
    def from_uint8(images: np.ndarray | torch.Tensor) -> torch.Tensor:
        """uint8 (B, H, W, 3) -> float32 (B, 3, H, W) in [-1, 1]."""
        t = torch.as_tensor(np.asarray(images))
        if t.dtype != torch.uint8 or t.dim() != 4 or t.shape[-1] != 3:
            raise ValueError(f"expected uint8 images (B, H, W, 3), got {tuple(t.shape)} {t.dtype}")
        return t.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
