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
    kind: str  # "demo" | "gpt-c2i" | "gpt-t2i" | "vq" | "drafter" | "chameleon" | "chameleon-drafter" | "janus" | "emu3"
    token_grid: str
    checkpoints: tuple[str, ...]
    build: Callable[[], nn.Module] | None = None
    count: Callable[[], int] | None = None  # instead of `build`: a count read from the files themselves

    def parameter_count(self) -> int:
        if self.count is not None:
            return self.count()
        assert self.build is not None
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


def _demo_parameters() -> int:
    """Parameters of the packaged demo target, read from its safetensors header (no weights loaded)."""
    from safetensors import safe_open

    from runtime.assets import default_bundle_path

    with safe_open(str(default_bundle_path() / "gpt.safetensors"), framework="pt") as f:
        return sum(int(torch.Size(f.get_slice(k).get_shape()).numel()) for k in f.keys())


# Chameleon-7B (Anole, Lumina-mGPT): 32 layers of width 4096, SwiGLU 11008, 65,536 tokens of which
# 8,192 are image codes; LANTERN's Anole drafter is one such layer over the same vocabulary
_CHAMELEON_7B = dict(full_vocab_size=65536, vocab_size=8192, dim=4096, n_layer=32, n_head=32, kv_heads=32,
                     ffn_hidden=11008)


def _chameleon(block_size: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from runtime.models.chameleon import ChameleonConfig, ChameleonTarget

        cfg = ChameleonConfig(**_CHAMELEON_7B, block_size=block_size)
        return ChameleonTarget(cfg, torch.arange(cfg.vocab_size))

    return build


def _chameleon_drafter() -> nn.Module:
    from runtime.models.chameleon_drafter import ChameleonDrafter, ChameleonDrafterConfig

    cfg = ChameleonDrafterConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                 num_key_value_heads=32, num_hidden_layers=1, vocab_size=65536)
    return ChameleonDrafter(cfg, torch.arange(8192), block_size=1024, max_position=4096)


# Janus-Pro's generation path (language model + generation embedding, aligner and head; the
# understanding encoder and the VQ model are not counted) and Emu3-Gen's decoder, transformers' layouts
_JANUS_PRO = {"1B": dict(full_vocab_size=102400, dim=2048, n_layer=24, n_head=16, kv_heads=16, ffn_hidden=5632),
              "7B": dict(full_vocab_size=102400, dim=4096, n_layer=30, n_head=32, kv_heads=32, ffn_hidden=11008)}
_EMU3_GEN = dict(full_vocab_size=184622, dim=4096, n_layer=32, n_head=32, kv_heads=8, ffn_hidden=14336)


def _janus(size: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from runtime.models.chameleon import ChameleonConfig
        from runtime.models.janus import JanusTarget

        shape = _JANUS_PRO[size]
        cfg = ChameleonConfig(**shape, vocab_size=16384, block_size=576, qk_norm=False, family="janus")
        return JanusTarget(cfg, embed_dim=8, projection=shape["dim"], aligner_layers=2)

    return build


def _emu3() -> nn.Module:
    from runtime.models.chameleon import ChameleonConfig, ChameleonTarget

    cfg = ChameleonConfig(**_EMU3_GEN, vocab_size=32769, block_size=90 * 91, qk_norm=False, family="emu3",
                          row_width=91, newline=32768)
    return ChameleonTarget(cfg, torch.arange(cfg.vocab_size))


MODEL_ZOO: tuple[ZooEntry, ...] = (
    ZooEntry("demo", "demo", "16x16", ("embedded (the default model)",),
             count=_demo_parameters),
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
    ZooEntry("Anole-7B", "chameleon", "32x32", ("GAIR/Anole-7b-v0.1 (HF, transformers Chameleon layout)",),
             _chameleon(1024)),
    ZooEntry("Lumina-mGPT-7B-768", "chameleon", "48x48+eol",
             ("Alpha-VLLM/Lumina-mGPT-7B-768 (HF)",), _chameleon(48 * 49)),
    ZooEntry("LANTERN-Anole", "chameleon-drafter", "32x32", ("jadohu/anole_drafter",), _chameleon_drafter),
    ZooEntry("Janus-Pro-1B", "janus", "24x24", ("deepseek-community/Janus-Pro-1B (HF)",), _janus("1B")),
    ZooEntry("Janus-Pro-7B", "janus", "24x24", ("deepseek-community/Janus-Pro-7B (HF)",), _janus("7B")),
    ZooEntry("Emu3-Gen", "emu3", "90x90+eol", ("BAAI/Emu3-Gen-hf (HF)",), _emu3),
)


def zoo_rows() -> list[dict[str, str]]:
    """The zoo as table rows: name, kind, params, token_grid, checkpoints (one per line)."""
    return [
        {"name": e.name, "kind": e.kind, "params": format_params(e.parameter_count()),
         "token_grid": e.token_grid, "checkpoints": "\n".join(e.checkpoints)}
        for e in MODEL_ZOO
    ]
