"""Import the reference LANTERN code (jadohu/LANTERN @ 3a56e45, exported unmodified to
$LANTERN_REFERENCE (default $REFHARNESS_WORK/LANTERN)) on a CPU-only machine, without editing any of its files.

Workarounds applied here (all outside the reference's decoding logic):
  1. `models/__init__.py` imports the Lumina-mGPT model (and its heavy dependencies). We register
     an empty package object for `models` whose __path__ points at LANTERN/models, so
     `models.ea_model_llamagen` etc. import without running that __init__.
  2. `models.base_models.llamagen.t5` (T5Embedder: flan-t5-xl on device='cuda', ftfy, bs4) is
     replaced by a stub whose `get_text_embeddings(prompts)` returns fixed caption embeddings
     (right-padded, as T5 + its tokenizer return them) looked up by prompt string from
     `CAPTIONS`, which the harness fills from captions.npz. The same file feeds the runtime.
  3. `torch.cuda.synchronize` is made a no-op (only reached in unused timing helpers).
"""
from __future__ import annotations

import os
import sys
import types

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.environ.get("REFHARNESS_WORK", os.path.join(os.getcwd(), "refharness-work"))  # models, results, caches
LANTERN = os.environ.get("LANTERN_REFERENCE", os.path.join(WORK, "LANTERN"))  # the checkout

# prompt string -> (emb (120, 2048) float32, mask (120,) int64), right-padded like T5's output
CAPTIONS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


class StubT5Embedder:
    """Stands in for models.base_models.llamagen.t5.T5Embedder (no T5 model, no CUDA)."""

    def __init__(self, device=None, dir_or_name=None, **kwargs):
        self.device = torch.device("cpu")
        self.model_max_length = kwargs.get("model_max_length", 120)

    def get_text_embeddings(self, texts):
        embs, masks = zip(*(CAPTIONS[t] for t in texts))
        return torch.stack(embs), torch.stack(masks)


def install() -> None:
    if "models" in sys.modules and getattr(sys.modules["models"], "_refharness", False):
        return
    if LANTERN not in sys.path:
        sys.path.insert(0, LANTERN)
    pkg = types.ModuleType("models")
    pkg.__path__ = [os.path.join(LANTERN, "models")]
    pkg._refharness = True
    sys.modules["models"] = pkg
    t5 = types.ModuleType("models.base_models.llamagen.t5")
    t5.T5Embedder = StubT5Embedder
    sys.modules["models.base_models.llamagen.t5"] = t5
    torch.cuda.synchronize = lambda *a, **k: None


def load_captions(path: str) -> list[str]:
    """Fill CAPTIONS from captions.npz (emb (n,120,2048) right-padded, mask (n,120)); returns the
    prompt keys "caption_0".. in order."""
    data = np.load(path)
    emb, mask = torch.from_numpy(data["emb"]).float(), torch.from_numpy(data["mask"]).long()
    keys = []
    for i in range(emb.shape[0]):
        key = f"caption_{i}"
        CAPTIONS[key] = (emb[i], mask[i])
        keys.append(key)
    return keys


def add_settings(ap) -> None:
    """The measurement settings both sides take (reference_run.py, runtime_run.py): one set of
    defaults, so the two decode the same images with the same method settings."""
    ap.add_argument("--images", type=int, default=2, help="captions 0..N-1, one image each")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each method (image 0)")
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--lantern-k", type=int, default=1000)
    ap.add_argument("--lantern-delta", type=float, default=0.1)
    ap.add_argument("--lantern-lambda", type=float, default=2.0)
    ap.add_argument("--tree", default="naive_extend_57")
    ap.add_argument("--threads", type=int, default=1)

