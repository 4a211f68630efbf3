"""HF-converted LlamaGen folders (jadohu/LlamaGen-T2I, LlamaGen-T2I-2): key renames both ways,
the GPTConfig from / to an HF `config.json`, and the weights of an HF folder."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from runtime.utils.errors import UserError
from runtime.models.config_checks import check_llamagen_fields
from runtime.models.configs import GPTConfig, check_positive, find_multiple
from runtime.models.loading.files import first_line, read_safetensors, read_checkpoint, read_json
from runtime.models.loading.strict import HARMLESS_EXTRA, shape_text

# (official suffix inside layers.N, HF suffix inside model.layers.N); wqkv is handled apart.
_LAYER_RENAMES = (
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
)
_TOP_RENAMES = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OFFICIAL_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_llamagen_to_official(state: Mapping[str, Tensor], source: str = "HF state dict") -> dict[str, Tensor]:
    """Rename an HF-Llama-named LlamaGen state dict to LlamaGen's own key names.

    q/k/v_proj rows are concatenated into `wqkv` in (q, k, v) order with no RoPE permutation
    (LANTERN's converted models keep LlamaGen's interleaved 2D RoPE).
    """
    top = {hf: off for off, hf in _TOP_RENAMES}
    layer = {hf: off for off, hf in _LAYER_RENAMES}
    out: dict[str, Tensor] = {}
    qkv: dict[int, dict[str, Tensor]] = {}
    for key, value in state.items():
        if HARMLESS_EXTRA.search(key):
            continue
        if key in top:
            out[top[key]] = value
        elif key.startswith("model.cls_embedding."):
            out[key[len("model."):]] = value
        elif (m := _HF_LAYER.match(key)) is not None:
            n, rest = int(m.group(1)), m.group(2)
            proj = re.fullmatch(r"self_attn\.([qkv])_proj\.weight", rest)
            if proj is not None:
                qkv.setdefault(n, {})[proj.group(1)] = value
            elif rest in layer:
                out[f"layers.{n}.{layer[rest]}"] = value
            else:
                raise UserError(f"{source}: unexpected key {key!r} (found shape {shape_text(value)}) "
                                "in an HF LlamaGen state dict")
        else:
            raise UserError(f"{source}: unexpected key {key!r} (found shape {shape_text(value)}) "
                            "in an HF LlamaGen state dict")
    for n, parts in sorted(qkv.items()):
        missing = [p for p in "qkv" if p not in parts]
        if missing:
            raise UserError(f"{source}: missing key 'model.layers.{n}.self_attn.{missing[0]}_proj.weight' "
                            f"(found {', '.join(p + '_proj' for p in parts)} only)")
        out[f"layers.{n}.attention.wqkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


def official_to_hf_llamagen(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of `hf_llamagen_to_official`. q has as many rows as wqkv has columns (LlamaGen's
    attention width equals its hidden size); k and v split the remaining rows evenly."""
    top = dict(_TOP_RENAMES)
    layer = dict(_LAYER_RENAMES)
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if HARMLESS_EXTRA.search(key):
            continue
        if key in top:
            out[top[key]] = value
        elif key.startswith("cls_embedding."):
            out["model." + key] = value
        elif (m := _OFFICIAL_LAYER.match(key)) is not None:
            n, rest = int(m.group(1)), m.group(2)
            if rest == "attention.wqkv.weight":
                dim = value.shape[1]
                kv = (value.shape[0] - dim) // 2
                q, k, v = torch.split(value, [dim, kv, kv], dim=0)
                for name, part in (("q", q), ("k", k), ("v", v)):
                    out[f"model.layers.{n}.self_attn.{name}_proj.weight"] = part.contiguous()
            elif rest in layer:
                out[f"model.layers.{n}.{layer[rest]}"] = value
            else:
                raise KeyError(f"no HF name for LlamaGen key {key!r}")
        else:
            raise KeyError(f"no HF name for LlamaGen key {key!r}")
    return out


def _multiple_of_for(dim: int, intermediate: int) -> int | None:
    for multiple in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if find_multiple(int(2 * 4 * dim / 3), multiple) == intermediate:
            return multiple
    return None


def gpt_config_from_hf(config_json: Mapping[str, Any] | str | os.PathLike[str]) -> GPTConfig:
    """GPTConfig from an HF LlamaGen `config.json` (a path or the parsed dict)."""
    source = "config.json"
    if not isinstance(config_json, Mapping):
        source = str(config_json)
        config_json = read_json(config_json)
    cfg = config_json
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size", "block_size")
    for field in required:
        if field not in cfg:
            raise UserError(f"{source}: missing field {field!r} for an HF LlamaGen model config")
    check_llamagen_fields(cfg, source)
    model_type = cfg.get("input_type", "t2i")
    if model_type not in ("c2i", "t2i"):
        raise UserError(f"{source}: input_type {model_type!r} is not 'c2i' or 't2i'")
    try:
        dim = int(cfg["hidden_size"])
        intermediate = int(cfg["intermediate_size"])
        check_positive("field", hidden_size=dim, intermediate_size=intermediate,
                       **{k: int(cfg[k]) for k in ("num_hidden_layers", "num_attention_heads", "vocab_size",
                                                   "block_size")})
        multiple_of = cfg.get("multiple_of") or _multiple_of_for(dim, intermediate)
        if multiple_of is None or find_multiple(int(2 * 4 * dim / 3), int(multiple_of)) != intermediate:
            raise UserError(f"{source}: intermediate_size {intermediate} is not LlamaGen's SwiGLU width for "
                            f"hidden_size {dim} (expected {find_multiple(int(8 * dim / 3), 256)})")
        n_head = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_head)
        return GPTConfig(
            dim=dim, n_layer=int(cfg["num_hidden_layers"]), n_head=n_head,
            n_kv_head=None if n_kv == n_head else n_kv, multiple_of=int(multiple_of),
            rope_base=float(cfg.get("rope_base", cfg.get("rope_theta", 10000.0))),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            num_classes=int(cfg.get("num_classes", 1000)),
            caption_dim=int(cfg.get("caption_dim", 2048)),
            class_dropout_prob=float(cfg.get("class_dropout_p", 0.1)),
            model_type=model_type, vocab_size=int(cfg["vocab_size"]),
            cls_token_num=int(cfg.get("cls_token_num", 120 if model_type == "t2i" else 1)),
            block_size=int(cfg["block_size"]),
        )
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise UserError(f"{source}: invalid HF LlamaGen config ({first_line(err)}); fix config.json") from None


def hf_config_from_gpt(cfg: GPTConfig) -> dict[str, Any]:
    """An HF LlamaGen `config.json` dict for `cfg` (LANTERN's field names; inverse of
    `gpt_config_from_hf`)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden, "multiple_of": cfg.multiple_of,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads, "rms_norm_eps": cfg.norm_eps, "vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size, "cls_token_num": cfg.cls_token_num, "input_type": cfg.model_type,
        "caption_dim": cfg.caption_dim, "num_classes": cfg.num_classes,
        "class_dropout_p": cfg.class_dropout_prob, "rope_base": cfg.rope_base, "rope_theta": cfg.rope_base,
        "attention_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": cfg.cls_token_num + cfg.block_size,
    }


def is_hf_folder(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def confined_name(name: object, named_in: Path) -> str:
    """A file name a folder's own file gives (a shard of a sharded index), refused unless it is a
    plain relative path inside that folder: no absolute path, no `..`, not empty."""
    from pathlib import PurePosixPath

    parts = PurePosixPath(str(name)).parts if isinstance(name, str) else ()
    if not parts or PurePosixPath(str(name)).is_absolute() or ".." in parts or "\\" in str(name):
        raise UserError(f"{named_in}: names the file {name!r}, which is not a file inside its folder; the folder "
                        "is damaged or hostile (re-download the model)")
    return str(name)


def read_hf_weights(folder: Path) -> dict[str, Tensor]:
    """Weights of an HF folder: `model.safetensors`, a sharded safetensors index, or
    `pytorch_model.bin` (loaded with weights_only=True)."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    binary = folder / "pytorch_model.bin"
    if single.is_file():
        return read_safetensors(single)
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: missing 'weight_map'")
        state: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values()), key=str):
            shard_path = folder / confined_name(shard, index)
            if not shard_path.is_file():
                raise UserError(f"{index}: shard {shard} not found in {folder}")
            state.update(read_safetensors(shard_path))
        return state
    if binary.is_file():
        return read_checkpoint(binary)
    raise UserError(f"{folder}: no weights found (expected model.safetensors or pytorch_model.bin)")


def load_hf_llamagen_folder(folder: str | os.PathLike[str]) -> tuple[GPTConfig, dict[str, Tensor]]:
    """(GPTConfig, official-named state dict) from an HF LlamaGen folder (config.json + weights)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"model folder not found: {folder}; check the path")
    cfg = gpt_config_from_hf(folder / "config.json")
    state = hf_llamagen_to_official(read_hf_weights(folder), source=str(folder))
    return cfg, state
