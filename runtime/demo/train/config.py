"""What a demo training run varies (`DemoTrainConfig`), the target's config it implies, and the
sampling settings a bundle recommends."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.demo.dataset import IMAGE_SIZE, NUM_CLASSES
from runtime.demo.train.tokenizer import DEMO_VQ_CONFIG
from runtime.models.configs import VQConfig

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
