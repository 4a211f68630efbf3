"""Loading and saving weights: official LlamaGen checkpoints, HF-converted LlamaGen-T2I folders,
LANTERN drafter folders and the project's own safetensors bundles.

Every problem with a user's file is a `UserError` with one line that names the file, and for
state-dict problems the key and both shapes. Pickled checkpoints are read with
`weights_only=True`; a file that needs arbitrary pickled objects (e.g. an `argparse.Namespace`
saved under "args") is refused unless the user passes `--trust-checkpoint`.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import Tensor, nn

from runtime.atomic import atomic_path, atomic_write_bytes, atomic_write_text
from runtime.errors import UserError
from runtime.models.configs import DrafterConfig, GPTConfig, VQ_CONFIGS, check_positive, find_multiple, gpt_config

if TYPE_CHECKING:  # gpt.py / drafter.py are imported lazily so this module imports on its own
    from runtime.models.drafter import Drafter
    from runtime.models.gpt import Transformer
    from runtime.models.vq import VQModel

TRUST_FLAG = "--trust-checkpoint"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_SUFFIX = ".safetensors"

# Wrapper keys tried in this order, as LlamaGen's sample scripts do ("ema" is deliberately not
# preferred: the official scripts load "model").
WRAPPER_KEYS = ("model", "module", "state_dict")
# Prefixes added by DDP wrapping / torch.compile, stripped when every key carries them.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


# --------------------------------------------------------------------------------------------
# Reading checkpoint files
# --------------------------------------------------------------------------------------------


def read_checkpoint(path: str | os.PathLike[str], *, trust: bool = False) -> dict[str, Tensor]:
    """Read a state dict from a `.pt/.pth/.bin/.ckpt` or `.safetensors` file, on the CPU.

    Pickled files are unwrapped: `"model"`, then `"module"`, then `"state_dict"`, else the file
    itself must be a bare state dict (LlamaGen's FSDP checkpoints). `trust=True` allows
    arbitrary pickled objects (`weights_only=False`); only use it for files you trust.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}; check the path")
    if path.is_dir():
        raise UserError(f"{path} is a directory, expected a checkpoint file (.pt, .pth, .bin or .safetensors)")
    if path.suffix == SAFETENSORS_SUFFIX:
        return _read_safetensors(path)
    obj = _torch_load(path, trust=trust)
    return _unwrap_state_dict(obj, path)


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as err:  # SafetensorError has no public base class to catch
        raise UserError(f"{path} is not a readable safetensors file ({_first_line(err)})") from None


def _torch_load(path: Path, *, trust: bool) -> Any:
    def load(mmap: bool) -> Any:
        return torch.load(path, map_location="cpu", weights_only=not trust, mmap=mmap)

    try:
        try:
            # mmap avoids holding a second copy of multi-GB checkpoints in memory.
            return load(mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            return load(mmap=False)  # legacy (non-zip) torch.save format
    except pickle.UnpicklingError as err:
        # The safe unpickler names the first non-tensor object it met ("Unsupported global: GLOBAL
        # argparse.Namespace ..."); anything else it rejects is a damaged or foreign file.
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        if not trust and found:
            raise UserError(
                f"{path} contains pickled Python objects ({found.group(1)}) besides tensors and is "
                f"refused by the safe loader; if you trust its source, pass {TRUST_FLAG}") from None
        raise UserError(f"cannot read checkpoint {path}: not a PyTorch checkpoint "
                        f"(UnpicklingError)") from None
    except Exception as err:
        raise UserError(f"cannot read checkpoint {path}: not a PyTorch checkpoint "
                        f"({type(err).__name__}: {_first_line(err)})") from None


def _unwrap_state_dict(obj: Any, path: Path) -> dict[str, Tensor]:
    if not isinstance(obj, Mapping):
        raise UserError(f"{path} holds a {type(obj).__name__}, expected a state dict")
    for key in WRAPPER_KEYS:
        inner = obj.get(key)
        if isinstance(inner, Mapping):
            obj = inner
            break
    tensors = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, Tensor)}
    if not tensors:
        top = ", ".join(sorted(map(str, obj.keys()))[:8])
        raise UserError(f"{path} holds no state dict (top-level keys: {top}); expected a bare state dict "
                        f"or one under {', '.join(repr(k) for k in WRAPPER_KEYS)}")
    return _strip_wrapper_prefixes(tensors)


def _strip_wrapper_prefixes(state: dict[str, Tensor]) -> dict[str, Tensor]:
    for prefix in WRAPPER_PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# --------------------------------------------------------------------------------------------
# Strict loading with one-line errors
# --------------------------------------------------------------------------------------------

# Keys that official files may carry but that hold no weights: the RoPE table (some old
# checkpoints stored it), KV-cache buffers (a state dict taken after `setup_caches`), HF rotary
# inverse frequencies, and the VQ usage ring buffer (absent when saved with show_usage=False).
_HARMLESS_EXTRA = re.compile(r"(^|\.)freqs_cis$|(^|\.)kv_cache\.|(^|\.)rotary_emb\.inv_freq$")
_HARMLESS_MISSING = re.compile(r"(^|\.)codebook_used$")


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


def check_state_dict(module: nn.Module, state: Mapping[str, Tensor], source: str,
                     hint: str | None = None) -> dict[str, Tensor]:
    """Validate `state` against `module.state_dict()`; return it minus the harmless extras.

    Raises one `UserError` for the first problem (missing key, unexpected key, shape mismatch),
    naming `source`, the key and both shapes, plus how many further problems there are.
    """
    expected = module.state_dict()
    state = {k: v for k, v in state.items() if k in expected or not _HARMLESS_EXTRA.search(k)}
    problems: list[str] = []
    for key, want in expected.items():
        got = state.get(key)
        if got is None:
            if not _HARMLESS_MISSING.search(key):
                problems.append(f"missing key {key!r} (expected shape {_shape(want)}, found none)")
        elif got.shape != want.shape:
            problems.append(f"shape mismatch for {key!r}: expected {_shape(want)}, found {_shape(got)}")
    for key, got in state.items():
        if key not in expected:
            problems.append(f"unexpected key {key!r} (expected none, found shape {_shape(got)})")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        tail = f"; {hint}" if hint else ""
        raise UserError(f"{source}: {problems[0]}{more}{tail}")
    _check_values(expected, state, source)
    return state


def _check_values(expected: Mapping[str, Tensor], state: Mapping[str, Tensor], source: str) -> None:
    """Refuse a tensor whose kind differs from the module's (an int or bool file tensor where a
    float parameter goes would be cast and run) and a float tensor holding NaN or inf (it would
    decode images from NaN logits). One pass over the weights, at load."""
    for key, got in state.items():
        want = expected[key]
        kind_differs = (want.is_floating_point() != got.is_floating_point()
                        or (want.dtype == torch.bool) != (got.dtype == torch.bool))
        if kind_differs:
            raise UserError(f"{source}: {key!r} is stored as {str(got.dtype).replace('torch.', '')} but the model "
                            f"holds {str(want.dtype).replace('torch.', '')}; the file is not a weights checkpoint "
                            "of this model (re-export it with floating-point weights)")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            bad = int((~torch.isfinite(got)).sum())
            raise UserError(f"{source}: {key!r} holds {bad} NaN or infinite values; the checkpoint is corrupt "
                            "(re-download or re-export it)")


def load_state_dict_strict(module: nn.Module, state: Mapping[str, Tensor], source: str,
                           hint: str | None = None) -> nn.Module:
    """Copy `state` into `module` after `check_state_dict`; buffers absent from the file (only the
    VQ usage buffer qualifies) keep the module's values. Returns `module`."""
    state = check_state_dict(module, state, source, hint)
    result = module.load_state_dict(state, strict=False)
    # every checked key must land; one that does not is a module's bug (its load hooks), not the file's
    unset = [k for k in result.missing_keys if not _HARMLESS_MISSING.search(k)] + list(result.unexpected_keys)
    if unset:
        raise RuntimeError(f"{source}: {type(module).__name__} left {unset[0]!r} unloaded "
                           f"({len(unset)} keys): its state-dict hooks and its keys disagree")
    return module


# --------------------------------------------------------------------------------------------
# HF-converted LlamaGen (jadohu/LlamaGen-T2I, LlamaGen-T2I-2)
# --------------------------------------------------------------------------------------------

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
        if _HARMLESS_EXTRA.search(key):
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
                raise UserError(f"{source}: unexpected key {key!r} (found shape {_shape(value)}) "
                                "in an HF LlamaGen state dict")
        else:
            raise UserError(f"{source}: unexpected key {key!r} (found shape {_shape(value)}) "
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
        if _HARMLESS_EXTRA.search(key):
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
        raise UserError(f"{source}: invalid HF LlamaGen config ({_first_line(err)}); fix config.json") from None


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


def read_hf_weights(folder: Path) -> dict[str, Tensor]:
    """Weights of an HF folder: `model.safetensors`, a sharded safetensors index, or
    `pytorch_model.bin` (loaded with weights_only=True)."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    binary = folder / "pytorch_model.bin"
    if single.is_file():
        return _read_safetensors(single)
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: missing 'weight_map'")
        state: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = folder / shard
            if not shard_path.is_file():
                raise UserError(f"{index}: shard {shard} not found in {folder}")
            state.update(_read_safetensors(shard_path))
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


# --------------------------------------------------------------------------------------------
# LANTERN drafter folders
# --------------------------------------------------------------------------------------------

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
        raise UserError(f"{source}: invalid drafter config ({_first_line(err)}); fix config.json") from None


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
    state = _state_of(weights)
    if fmt == "safetensors":
        write_safetensors(folder / "model.safetensors", state)
    else:
        with atomic_path(folder / "pytorch_model.bin") as tmp:
            torch.save(state, tmp)
    write_json(folder / "config.json", drafter_config_to_json(config))
    return folder


# --------------------------------------------------------------------------------------------
# The project's own bundles
# --------------------------------------------------------------------------------------------

BUNDLE_MANIFEST = "manifest.json"
BUNDLE_FORMAT = "lantern-runtime-bundle"
BUNDLE_VERSION = 1


@dataclass
class BundlePart:
    """One model of a bundle: its config dict (as given to `save_bundle`) and its weights."""

    config: dict[str, Any]
    state: dict[str, Tensor]


@dataclass
class Bundle:
    """A bundle folder read back: the user manifest fields and the parts by name."""

    path: Path
    manifest: dict[str, Any]
    parts: dict[str, BundlePart]

    def part(self, name: str) -> BundlePart:
        if name not in self.parts:
            raise UserError(f"{self.path}: bundle has no {name!r} part (has: {', '.join(self.parts) or 'none'})")
        return self.parts[name]


def save_bundle(folder: str | os.PathLike[str],
                parts: Mapping[str, tuple[nn.Module | Mapping[str, Tensor], Mapping[str, Any]]],
                manifest: Mapping[str, Any] | None = None) -> Path:
    """Write a bundle: one `<name>.safetensors` per part and `manifest.json`.

    parts: name -> (module or state dict, JSON-able config dict). `manifest` holds any further
    JSON-able fields (e.g. which classes, default sampling settings); it must not use the keys
    "format", "version" or "parts". The manifest is written last, so a folder without one is
    an incomplete bundle.
    """
    manifest = dict(manifest or {})
    reserved = {"format", "version", "parts"} & manifest.keys()
    if reserved:
        raise ValueError(f"manifest keys {sorted(reserved)} are reserved")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries: dict[str, Any] = {}
    for name, (weights, config) in parts.items():
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
            raise ValueError(f"bundle part name {name!r} must be alphanumeric (it names a file)")
        filename = f"{name}.safetensors"
        write_safetensors(folder / filename, _state_of(weights))
        entries[name] = {"file": filename, "config": dict(config)}
    write_json(folder / BUNDLE_MANIFEST,
               {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "parts": entries, **manifest})
    return folder


def read_bundle(folder: str | os.PathLike[str]) -> Bundle:
    """Read a bundle written by `save_bundle`."""
    folder = Path(folder)
    manifest_path = folder / BUNDLE_MANIFEST
    if not folder.is_dir():
        raise UserError(f"model bundle not found: {folder}; check the --model path")
    if not manifest_path.is_file():
        raise UserError(f"{folder} is not a model bundle (no {BUNDLE_MANIFEST})")
    data = read_json(manifest_path)
    if data.get("format") != BUNDLE_FORMAT or not isinstance(data.get("parts"), dict):
        raise UserError(f"{manifest_path}: not a {BUNDLE_FORMAT} manifest")
    if int(data.get("version", 0)) > BUNDLE_VERSION:
        raise UserError(f"{manifest_path}: bundle version {data['version']} is newer than this runtime "
                        f"supports ({BUNDLE_VERSION}); upgrade lantern-runtime")
    parts: dict[str, BundlePart] = {}
    for name, entry in data["parts"].items():
        if not isinstance(entry, dict) or "file" not in entry:
            raise UserError(f"{manifest_path}: part {name!r} has no 'file'")
        weights = folder / str(entry["file"])
        relative = os.path.normpath(str(entry["file"]))
        if os.path.isabs(relative) or relative == ".." or relative.startswith(".." + os.sep):
            raise UserError(f"{manifest_path}: part {name!r} file {entry['file']!r} lies outside the bundle folder; "
                            "a bundle's parts are files inside it")
        if not weights.is_file():
            raise UserError(f"{manifest_path}: part {name!r} file {entry['file']} is missing")
        parts[name] = BundlePart(config=dict(entry.get("config") or {}), state=_read_safetensors(weights))
    extra = {k: v for k, v in data.items() if k not in ("format", "version", "parts")}
    return Bundle(path=folder, manifest=extra, parts=parts)


# --------------------------------------------------------------------------------------------
# Builders used by the CLI
# --------------------------------------------------------------------------------------------


# Image sizes LlamaGen released GPT checkpoints for, as the `_<size>` token of their file names
# (c2i_B_256.pt, c2i_XL_384.pt, t2i_XL_stage2_512.pt, ...). The weights do not carry the token
# grid (the RoPE table is not in the state dict), so the name is the only record of it.
OFFICIAL_IMAGE_SIZES: tuple[int, ...] = (256, 384, 512)
_NAMED_SIZE = re.compile(r"(?:^|_)(" + "|".join(map(str, OFFICIAL_IMAGE_SIZES)) + r")(?=_|$)")
TOKEN_PIXELS = 16  # VQ-16: one token per 16x16 pixels


def image_size_from_name(path: str | os.PathLike[str]) -> int | None:
    """The image size a checkpoint's file name states (`c2i_XL_384.pt` -> 384), else None.

    Only a `_<size>` token of 256/384/512 in the stem counts; a name stating two different
    sizes states none.
    """
    sizes = {int(m) for m in _NAMED_SIZE.findall(Path(path).stem)}
    return sizes.pop() if len(sizes) == 1 else None


def check_image_size(image_size: int) -> None:
    """UserError unless `image_size` is a positive multiple of the VQ-16 token size."""
    if image_size <= 0 or image_size % TOKEN_PIXELS:
        raise UserError(f"--image-size {image_size} is not a positive multiple of {TOKEN_PIXELS} (one token per "
                        f"{TOKEN_PIXELS}x{TOKEN_PIXELS} pixels); use the size the checkpoint was trained at, "
                        f"e.g. {', '.join(map(str, OFFICIAL_IMAGE_SIZES))}")


def checkpoint_image_size(ckpt_path: str | os.PathLike[str], image_size: int | None) -> int:
    """The image size to build a checkpoint file at: `image_size` (--image-size) if given, else
    the size its file name states. Refuses a size the name contradicts, and a file whose name
    states none when no size is given (a wrong grid would load but decode garbage)."""
    named = image_size_from_name(ckpt_path)
    if image_size is not None:
        check_image_size(image_size)
        if named is not None and named != image_size:
            raise UserError(f"{ckpt_path}: the file name says {named} px but --image-size is {image_size}; "
                            f"drop --image-size or pass --image-size {named}")
        return image_size
    if named is None:
        raise UserError(f"{ckpt_path}: the file name does not state the image size the checkpoint was trained "
                        f"at; pass --image-size ({', '.join(map(str, OFFICIAL_IMAGE_SIZES))})")
    return named


def build_gpt(model_name: str | None, ckpt_path: str | os.PathLike[str], image_size: int | None = None,
              model_type: str = "c2i", trust: bool = False) -> "Transformer":
    """A LlamaGen GPT in eval mode with weights from an official `.pt`/`.pth`/`.safetensors` file
    or an HF LlamaGen folder (whose config.json then defines the model; `model_name` and
    `image_size`, if given, must agree with it).

    A file's token grid is (size / 16)^2 with size = `image_size` or the size its name states
    (`c2i_L_384.pt`: 24x24); see `checkpoint_image_size`.
    """
    from runtime.models.gpt import Transformer

    ckpt_path = Path(ckpt_path)
    if is_hf_folder(ckpt_path):
        cfg, state = load_hf_llamagen_folder(ckpt_path)
        if model_name is not None:
            named = gpt_config(model_name, model_type=cfg.model_type, image_size=16 * cfg.grid_size)
            if (named.dim, named.n_layer, named.n_head) != (cfg.dim, cfg.n_layer, cfg.n_head):
                raise UserError(f"{ckpt_path}: config.json describes dim {cfg.dim}, {cfg.n_layer} layers, "
                                f"{cfg.n_head} heads, which is not {model_name}; drop --gpt-model or fix it")
        if image_size is not None:
            check_image_size(image_size)
            if (image_size // TOKEN_PIXELS) ** 2 != cfg.block_size:
                raise UserError(f"{ckpt_path}: model was converted for a {cfg.grid_size}x{cfg.grid_size} token "
                                f"grid ({16 * cfg.grid_size}px), not --image-size {image_size}")
    else:
        if model_name is None:
            raise UserError(f"{ckpt_path}: a checkpoint file needs --gpt-model (e.g. GPT-B)")
        state = read_checkpoint(ckpt_path, trust=trust)  # first: a missing file is the first problem
        size = checkpoint_image_size(ckpt_path, image_size)
        cfg = gpt_config(model_name, model_type=model_type, image_size=size)
    model = Transformer(cfg)
    load_state_dict_strict(model, state, str(ckpt_path),
                           hint="check that --gpt-model and the model type (c2i/t2i) match the checkpoint")
    return model.eval()


def build_vq(ckpt_path: str | os.PathLike[str], config_name: str = "VQ-16", trust: bool = False) -> "VQModel":
    """A VQ tokenizer in eval mode with weights from an official VQ checkpoint (`vq_ds16_c2i.pt`)."""
    from runtime.models.vq import VQModel

    if config_name not in VQ_CONFIGS:
        raise UserError(f"unknown VQ model {config_name!r}; choose one of {', '.join(VQ_CONFIGS)}")
    state = read_checkpoint(ckpt_path, trust=trust)
    model = VQModel(VQ_CONFIGS[config_name])
    load_state_dict_strict(model, state, str(ckpt_path),
                           hint=f"check that the file is a {config_name} tokenizer checkpoint")
    return model.eval()


def build_drafter(folder: str | os.PathLike[str], target_cfg: GPTConfig) -> "Drafter":
    """A drafter in eval mode from a drafter folder, checked against its target's config."""
    from runtime.models.drafter import Drafter

    cfg, state = load_drafter_folder(folder)
    check_drafter_matches_target(cfg, target_cfg, str(folder))
    model = Drafter(cfg)
    load_state_dict_strict(model, state, str(folder))
    return model.eval()


def check_drafter_matches_target(cfg: DrafterConfig, target: GPTConfig, source: str) -> None:
    """UserError naming the first field where a drafter cannot serve `target`."""
    one_d = getattr(target, "model_type", "") == "chameleon"
    if one_d != (cfg.rope == "1d"):
        raise UserError(f"{source}: a drafter with {cfg.rope} positions cannot serve a "
                        f"{'Chameleon' if one_d else 'LlamaGen'} target; use the drafter trained for this model")
    pairs = (("hidden_size", cfg.hidden_size, "dim", target.dim),
             ("vocab_size", cfg.vocab_size, "vocab_size", target.vocab_size),
             ("block_size", cfg.block_size, "block_size", target.block_size),
             # a Chameleon prompt's length varies per run: its drafter's positions do not depend on it
             *(() if one_d else (("cls_token_num", cfg.cls_token_num, "cls_token_num", target.cls_token_num),)))
    for d_name, d_val, t_name, t_val in pairs:
        if d_val != t_val:
            raise UserError(f"{source}: drafter {d_name} {d_val} does not match the target model's "
                            f"{t_name} {t_val}; use the drafter trained for this model and image size")


# --------------------------------------------------------------------------------------------
# Small file helpers (atomic writes)
# --------------------------------------------------------------------------------------------


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({_first_line(err)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def write_json(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write `data` as indented JSON, atomically."""
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    atomic_write_text(path, text)


def write_safetensors(path: str | os.PathLike[str], state: Mapping[str, Tensor],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write a state dict as safetensors, atomically. Tensors are moved to the CPU; tensors that
    share storage (tied weights) are cloned, as safetensors stores each key separately."""
    from safetensors.torch import save

    seen: set[int] = set()
    flat: dict[str, Tensor] = {}
    for key, value in state.items():
        t = value.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        flat[key] = t
    blob = save(flat, metadata=dict(metadata) if metadata else None)
    atomic_write_bytes(path, blob)


def _state_of(weights: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    return dict(weights.state_dict()) if isinstance(weights, nn.Module) else dict(weights)
