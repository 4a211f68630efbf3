"""Sample quality of a trained target: class accuracy and FD of AR samples, and of VQ reconstructions."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from runtime.demo.dataset import NUM_CLASSES
from runtime.demo.train.inputs import images_tensor
from runtime.models.vq import VQModel

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
    x, y = images_tensor(EVAL_SEED, np.arange(n_real, n_real + max(n, 2)))
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
