"""The model zoo: the released LlamaGen / LANTERN models the runtime loads, as data.

Parameter counts are computed, not typed in: each model is built on the `meta` device (shapes
only, no memory) and its parameters are summed. Buffers (the t2i `uncond_embedding`, the VQ usage
ring buffer) are not parameters and are not counted; the drafter count includes its (frozen,
stored) token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from runtime.models.configs import VQ_CONFIGS, DrafterConfig, gpt_config


@dataclass(frozen=True)
class ZooEntry:
    """One row of `runtime models`.

    token_grid: human-readable token grid(s), one per line (e.g. 16x16 and 24x24).
    checkpoints: the official files or Hugging Face repos this entry loads.
    build: builds the model; called under `torch.device("meta")` to count parameters.
    """

    name: str
    kind: str  # "gpt-c2i" | "gpt-t2i" | "vq" | "drafter"
    token_grid: str
    checkpoints: tuple[str, ...]
    build: Callable[[], nn.Module]

    def parameter_count(self) -> int:
        return count_parameters_meta(self.build)


def count_parameters_meta(build: Callable[[], nn.Module]) -> int:
    """Number of parameters of `build()`, constructed on the meta device (no allocation)."""
    with torch.device("meta"):
        module = build()
    return sum(p.numel() for p in module.parameters())


def format_params(n: int) -> str:
    """110.9M style; from one billion on, also the billions: `1411.0M (1.4B)`."""
    text = f"{n / 1e6:.1f}M"
    if n >= 1_000_000_000:
        text += f" ({n / 1e9:.1f}B)"
    return text


def _gpt(name: str, model_type: str, image_size: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from runtime.models.gpt import Transformer

        return Transformer(gpt_config(name, model_type=model_type, image_size=image_size))

    return build


def _vq(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from runtime.models.vq import VQModel

        return VQModel(VQ_CONFIGS[name])

    return build


def _drafter(target: str, image_size: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from runtime.models.drafter import Drafter

        return Drafter(DrafterConfig.for_target(gpt_config(target, model_type="t2i", image_size=image_size)))

    return build


def _c2i(name: str, short: str, sizes: tuple[int, ...], note: str = "") -> ZooEntry:
    grids = "\n".join(f"{s // 16}x{s // 16}" for s in sizes)
    files = tuple(f"c2i_{short}_{s}.pt{note}" for s in sizes)
    return ZooEntry(name, "gpt-c2i", grids, files, _gpt(name, "c2i", sizes[0]))


MODEL_ZOO: tuple[ZooEntry, ...] = (
    _c2i("GPT-B", "B", (256, 384)),
    _c2i("GPT-L", "L", (256, 384)),
    _c2i("GPT-XL", "XL", (384,)),
    _c2i("GPT-XXL", "XXL", (384,), note=" (FSDP)"),
    _c2i("GPT-3B", "3B", (384,), note=" (FSDP)"),
    ZooEntry("GPT-XL", "gpt-t2i", "16x16\n32x32",
             ("t2i_XL_stage1_256.pt", "t2i_XL_stage2_512.pt", "jadohu/LlamaGen-T2I (HF)",
              "jadohu/LlamaGen-T2I-2 (HF)"),
             _gpt("GPT-XL", "t2i", 256)),
    ZooEntry("VQ-16", "vq", "image/16", ("vq_ds16_c2i.pt", "vq_ds16_t2i.pt"), _vq("VQ-16")),
    ZooEntry("VQ-8", "vq", "image/8", ("vq_ds8_c2i.pt",), _vq("VQ-8")),
    ZooEntry("LANTERN-XL-256", "drafter", "16x16", ("jadohu/llamagen_drafter",),
             _drafter("GPT-XL", 256)),
    ZooEntry("LANTERN-XL-512", "drafter", "32x32", ("jadohu/llamagen2_drafter",),
             _drafter("GPT-XL", 512)),
)


def zoo_rows() -> list[dict[str, str]]:
    """The zoo as table rows: name, kind, params, token_grid, checkpoints (one per line)."""
    return [
        {"name": e.name, "kind": e.kind, "params": format_params(e.parameter_count()),
         "token_grid": e.token_grid, "checkpoints": "\n".join(e.checkpoints)}
        for e in MODEL_ZOO
    ]
