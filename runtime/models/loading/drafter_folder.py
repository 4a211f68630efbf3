"""LANTERN drafter folders: `config.json` (LANTERN's fields, plus our explicit target geometry)
and `model.safetensors` or `pytorch_model.bin`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from runtime.utils.atomic import atomic_path
from runtime.utils.errors import UserError
from runtime.models.config_checks import check_llamagen_fields
from runtime.models.configs import DrafterConfig, check_positive
from runtime.models.loading.files import first_line, state_of, read_json, write_json, write_safetensors
from runtime.models.loading.hf_llamagen import read_hf_weights

# LANTERN's `input_type` -> (target block_size, target cls_token_num).
DRAFTER_INPUT_TYPES: dict[str, tuple[int, int]] = {"t2i": (256, 120), "t2i2": (1024, 120), "c2i": (576, 1)}


def drafter_config_from_json(cfg: Mapping[str, Any], source: str = "config.json") -> DrafterConfig:
    """DrafterConfig from a LANTERN drafter `config.json` dict.

    The target geometry comes from explicit `block_size` / `cls_token_num` fields when present
    (our own folders write them), else from LANTERN's `input_type`. `condition_context` (which
    condition positions the drafter was trained to attend to) defaults to "all", as LANTERN's
    drafters and this project's were trained.
    """
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    for field in required:
        if field not in cfg:
            raise UserError(f"{source}: missing field {field!r} for a drafter config")
    check_llamagen_fields({"num_hidden_layers": 1, **cfg}, source, "drafter")
    try:
        if "block_size" in cfg and "cls_token_num" in cfg:
            block_size, cls_token_num = int(cfg["block_size"]), int(cfg["cls_token_num"])
        else:
            input_type = cfg.get("input_type")
            if input_type not in DRAFTER_INPUT_TYPES:
                raise UserError(f"{source}: input_type {input_type!r} is not one of "
                                f"{', '.join(DRAFTER_INPUT_TYPES)} (or give block_size and cls_token_num)")
            block_size, cls_token_num = DRAFTER_INPUT_TYPES[input_type]
        n_head = int(cfg["num_attention_heads"])
        check_positive("field", **{k: int(cfg[k]) for k in required})
        return DrafterConfig(
            hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
            num_attention_heads=n_head, num_key_value_heads=int(cfg.get("num_key_value_heads") or n_head),
            num_hidden_layers=int(cfg.get("num_hidden_layers", 1)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), vocab_size=int(cfg["vocab_size"]),
            bias=bool(cfg.get("bias", True)), qkv_bias=bool(cfg.get("qkv_bias", False)),
            rope_base=float(cfg.get("rope_base", cfg.get("rope_theta", 10000.0))),
            block_size=block_size, cls_token_num=cls_token_num,
            rope=str(cfg.get("rope", "llamagen-2d")), max_position=int(cfg.get("rope_max_position", 4096)),
            condition_context=str(cfg.get("condition_context", "all")),
        )
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise UserError(f"{source}: invalid drafter config ({first_line(err)}); fix config.json") from None


def drafter_config_to_json(cfg: DrafterConfig) -> dict[str, Any]:
    """LANTERN-style `config.json` dict for `cfg`, plus explicit block_size / cls_token_num."""
    input_type = next((name for name, geom in DRAFTER_INPUT_TYPES.items()
                       if geom == (cfg.block_size, cfg.cls_token_num)), None)
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "num_hidden_layers": cfg.num_hidden_layers, "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size, "bias": cfg.bias, "qkv_bias": cfg.qkv_bias, "rope_base": cfg.rope_base,
        "block_size": cfg.block_size, "cls_token_num": cfg.cls_token_num,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "condition_context": cfg.condition_context,
    }
    if input_type is not None:
        out["input_type"] = input_type
    if cfg.rope != "llamagen-2d":  # absent for LlamaGen drafters: their files stay LANTERN's
        out.update(rope=cfg.rope, rope_max_position=cfg.max_position)
    return out


def load_drafter_folder(folder: str | os.PathLike[str]) -> tuple[DrafterConfig, dict[str, Tensor]]:
    """(DrafterConfig, state dict) from a drafter folder: `config.json` + `model.safetensors` or
    `pytorch_model.bin` (LANTERN's `jadohu/llamagen_drafter` layout)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"drafter folder not found: {folder}; pass the folder holding config.json")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UserError(f"{folder}: no config.json; a drafter folder holds config.json and "
                        "model.safetensors or pytorch_model.bin")
    cfg = drafter_config_from_json(read_json(config_path), source=str(config_path))
    return cfg, read_hf_weights(folder)


def save_drafter_folder(folder: str | os.PathLike[str], config: DrafterConfig,
                        weights: nn.Module | Mapping[str, Tensor], *, fmt: str = "safetensors") -> Path:
    """Write a drafter folder LANTERN's layout: `config.json` + `model.safetensors` (fmt
    "safetensors") or `pytorch_model.bin` (fmt "bin"). Files are written atomically."""
    if fmt not in ("safetensors", "bin"):
        raise ValueError(f"fmt must be 'safetensors' or 'bin', got {fmt!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = state_of(weights)
    if fmt == "safetensors":
        write_safetensors(folder / "model.safetensors", state)
    else:
        with atomic_path(folder / "pytorch_model.bin") as tmp:
            torch.save(state, tmp)
    write_json(folder / "config.json", drafter_config_to_json(config))
    return folder
