"""CLIP score of text-to-image generations with open_clip and local weights.

CLIP score of an image and its prompt = 100 * max(cos(image embedding, text embedding), 0), the
definition of Hessel et al. (2021) that torchmetrics and the t2i papers use; a run's figure is
the mean over its images, with a bootstrap interval over images. The model is an open_clip model
name (e.g. ViT-L-14) or a model-config JSON file, and its weights a local file read by the safe
checkpoint loader; open_clip's BPE tokenizer ships inside the package, so nothing is downloaded.
Needs the `eval` extra (open_clip_torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.utils.errors import UserError
from runtime.metrics.fidelity import INSTALL_HINT, torchvision_mismatch
from runtime.metrics.images import ImageSet
from runtime.metrics.intervals import Estimate, estimate


def _open_clip() -> Any:
    try:
        import open_clip
    except ImportError as err:
        raise UserError(f"CLIP score needs open_clip ({err}); {INSTALL_HINT.replace('torch-fidelity', 'open_clip')}"
                        ) from None
    except (RuntimeError, AttributeError, OSError) as err:  # a torchvision built for another torch
        raise UserError(torchvision_mismatch("open_clip", err)) from None
    return open_clip


@dataclass
class ClipModel:
    model: torch.nn.Module
    preprocess: Any
    tokenizer: Any
    name: str


def load_clip(model: str, weights: str | Path, *, trust: bool = False,
              device: torch.device | str = "cpu") -> ClipModel:
    """An open_clip model by name or config JSON (`model`) with the state dict in `weights`."""
    open_clip = _open_clip()
    from runtime.models.loading import read_checkpoint

    name = model
    config = Path(model)
    if config.suffix == ".json":
        if not config.is_file():
            raise UserError(f"--clip-model {model}: config file not found")
        open_clip.add_model_config(config)
        name = config.stem
    if name not in open_clip.list_models():
        raise UserError(f"--clip-model {model}: not an open_clip model name (e.g. ViT-L-14, ViT-B-32) nor a "
                        "model-config .json file")
    state = read_checkpoint(weights, trust=trust)
    net, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None, device="cpu")
    try:
        net.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise UserError(f"--clip-weights {weights} do not fit open_clip {name} ({first}); give that model's "
                        "open_clip_pytorch_model.bin or .safetensors") from None
    try:
        tokenizer = open_clip.get_tokenizer(name)
    except Exception as err:  # noqa: BLE001 - a hub tokenizer would need the network
        raise UserError(f"open_clip {name}'s tokenizer cannot load offline ({type(err).__name__}); use a model "
                        "with open_clip's built-in tokenizer (ViT-B-32, ViT-L-14, ViT-H-14, ...)") from None
    return ClipModel(net.to(device).eval(), preprocess, tokenizer, name)


@torch.no_grad()
def clip_scores(clip: ClipModel, images: ImageSet, prompts: list[str], *, batch_size: int = 64) -> np.ndarray:
    """Per-image CLIP scores (N,) of `images` against `prompts` (one per image, in order)."""
    from PIL import Image

    if len(prompts) != len(images):
        raise UserError(f"CLIP score needs one prompt per image: {len(prompts)} prompts for {len(images)} images")
    device = next(clip.model.parameters()).device
    scores, start = [], 0
    for batch in images.batches(batch_size):
        pixels = torch.stack([clip.preprocess(Image.fromarray(im)) for im in batch]).to(device)
        text = clip.tokenizer(prompts[start:start + len(batch)]).to(device)
        img = torch.nn.functional.normalize(clip.model.encode_image(pixels).float(), dim=-1)
        txt = torch.nn.functional.normalize(clip.model.encode_text(text).float(), dim=-1)
        scores.append((100 * (img * txt).sum(-1).clamp(min=0)).double().cpu().numpy())
        start += len(batch)
    return np.concatenate(scores)


def clip_score(scores: np.ndarray, reps: int = 20, seed: int = 0) -> Estimate:
    """The mean CLIP score with its bootstrap interval over images."""
    return estimate(lambda idx: float(scores[idx].mean()), len(scores), reps, seed)
