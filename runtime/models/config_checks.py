"""A model folder's config.json read as untrusted data: every field that sizes a tensor checked
for type and range, and the model's bytes against the host's free memory, before anything is
built (a config asking for 10**9-wide layers is one line, not an allocation that fails later)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from runtime.utils.errors import UserError
from runtime.utils.host_memory import host_free_bytes


# Fields that size tensors, with the largest value a real model of these families has room for
# (Emu3-Gen: hidden 4096, 32 layers, vocabulary 184,622; headroom of 8x or more).
TEXT_FIELDS = {"hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 1024,
               "num_attention_heads": 1024, "num_key_value_heads": 1024, "vocab_size": 1 << 24,
               "max_position_embeddings": 1 << 22}
VQ_FIELDS = {"num_embeddings": 1 << 20, "embed_dim": 65536, "base_channels": 65536, "latent_channels": 65536,
             "in_channels": 64, "out_channels": 64, "num_res_blocks": 64, "codebook_size": 1 << 20}


def _field_fault(config_path: Path, key: str, value: Any, what: str) -> UserError:
    return UserError(f"{config_path}: {key} must be {what}, got {value!r}; fix or re-download the model folder's "
                     "config.json")


LLAMAGEN_FIELDS = {"hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 1024,
                   "num_attention_heads": 1024, "num_key_value_heads": 1024, "vocab_size": 1 << 24,
                   "block_size": 1 << 22, "cls_token_num": 1 << 16, "num_classes": 1 << 24, "caption_dim": 65536,
                   "multiple_of": 1 << 16}


def check_int_fields(values: Mapping[str, Any], fields: Mapping[str, int], path: Path | str,
                     section: str = "") -> None:
    """Each of `fields` present in `values` an integer (not a bool or a float) in [1, its bound]."""
    for key, high in fields.items():
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high):
            raise _field_fault(Path(path), f"{section}.{key}" if section else key, value,
                               f"an integer in [1, {high:,}]")


def check_number(values: Mapping[str, Any], key: str, low: float, high: float, path: Path | str,
                 name: str | None = None, closed: bool = False) -> None:
    """`values[key]`, where present, a finite number in (low, high) (`closed`: [low, high])."""
    import math

    value = values.get(key)
    if value is None:
        return
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    inside = number and (low <= value <= high if closed else low < value < high)
    if not inside:
        bounds = f"[{low:g}, {high:g}]" if closed else f"({low:g}, {high:g})"
        raise _field_fault(Path(path), name or key, value, f"a number in {bounds}")


def check_llamagen_fields(config: Mapping[str, Any], path: Path | str, kind: str = "model") -> None:
    """An HF LlamaGen model's or a LANTERN drafter's config.json (`kind`), read as untrusted: the
    fields that size tensors typed and bounded, the numbers finite, and the bytes it describes
    against the host's free memory."""
    check_int_fields(config, LLAMAGEN_FIELDS, path)
    check_number(config, "rms_norm_eps", 0, 1, path)
    for key in ("rope_base", "rope_theta"):
        check_number(config, key, 0, 1e12, path)
    check_number(config, "class_dropout_p", 0, 1, path, closed=True)
    check_model_bytes(config, {}, Path(path), kind)


def check_config_fields(config: dict[str, Any], folder: Path, flat: bool = False) -> None:
    """Every field of a Janus / Emu3 config.json (`flat`: a Chameleon one, whose text fields sit at
    its top level) that sizes a tensor, checked for type and range before anything is built, and
    the model's bytes against the host's free memory."""
    path = folder / "config.json"
    text = config if flat else config.get("text_config")
    for section, fields in (("" if flat else "text_config", TEXT_FIELDS), ("vq_config", VQ_FIELDS)):
        values = config.get(section) if section else config
        if values is None:
            continue
        if not isinstance(values, dict):
            raise _field_fault(path, section, type(values).__name__, "a JSON object")
        check_int_fields(values, fields, path, section)
    if isinstance(text, dict):
        check_number(text, "rms_norm_eps", 0, 1, path, "rms_norm_eps" if flat else "text_config.rms_norm_eps")
    vision = config.get("vision_config")
    if vision is not None and not isinstance(vision, dict):
        raise _field_fault(path, "vision_config", type(vision).__name__, "a JSON object")
    tokens = (vision or {}).get("num_image_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 1 << 16):
        raise _field_fault(path, "vision_config.num_image_tokens", tokens, f"an integer in [1, {1 << 16:,}]")
    vocab_map = config.get("vocabulary_map")
    if vocab_map is not None:
        if not isinstance(vocab_map, dict):
            raise _field_fault(path, "vocabulary_map", type(vocab_map).__name__, "a JSON object of token ids")
        vocab = text.get("vocab_size") if isinstance(text, dict) else None
        for name, value in vocab_map.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (vocab or 1 << 24):
                raise _field_fault(path, f"vocabulary_map[{name!r}]", value,
                                   f"a token id in [0, {vocab or 1 << 24:,})")
    if isinstance(text, dict):
        check_model_bytes(text, config.get("vq_config") or {}, path)


def model_bytes(text: Mapping[str, Any], vq: Mapping[str, Any] | None = None) -> int:
    """fp32 bytes of a decoder-only transformer described by HF-style fields (defaults: a 7B
    Llama's), plus a VQ codebook."""
    h, layers = text.get("hidden_size", 4096), text.get("num_hidden_layers", 32)
    ffn, vocab = text.get("intermediate_size", 11008), text.get("vocab_size", 65536)
    heads = text.get("num_attention_heads", 32)
    kv_dim = h * text.get("num_key_value_heads", heads) // max(heads, 1)
    params = layers * (2 * h * h + 2 * h * kv_dim + 3 * h * ffn) + 2 * vocab * h
    params += (vq or {}).get("num_embeddings", 16384) * (vq or {}).get("embed_dim", 8)
    return 4 * params


def check_model_bytes(text: Mapping[str, Any], vq: Mapping[str, Any], config_path: Path, kind: str = "model") -> None:
    """Refuse a model whose config asks for more host memory than is free (its weights are read
    and built on the host in fp32 first)."""
    need = model_bytes(text, vq)
    free = host_free_bytes()
    if free is not None and need > free:
        fields = ", ".join(f"{key} {text[key]}" for key in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                             "vocab_size") if key in text)
        raise UserError(f"{config_path}: the {kind} it describes takes about {need / 2**30:,.1f} GiB ({fields}) and "
                        f"this machine has {free / 2**30:,.1f} GiB free; check that config.json is this {kind}'s, "
                        "or use a machine with more memory")
