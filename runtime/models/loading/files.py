"""Reading checkpoint files (pickled or safetensors, unwrapped to a bare state dict) and the
small JSON / safetensors writers every other loading module uses (atomic writes).

Pickled checkpoints are read with `weights_only=True`; a file that needs arbitrary pickled
objects (e.g. an `argparse.Namespace` saved under "args") is refused unless the user passes
`--trust-checkpoint`.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from runtime.utils.atomic import atomic_write_bytes, atomic_write_text
from runtime.utils.errors import UserError

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
        return read_safetensors(path)
    obj = _torch_load(path, trust=trust)
    return _unwrap_state_dict(obj, path)


def read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as err:  # SafetensorError has no public base class to catch
        raise UserError(f"{path} is not a readable safetensors file ({first_line(err)})") from None


def _torch_load(path: Path, *, trust: bool) -> Any:
    def load(mmap: bool) -> Any:
        with warnings.catch_warnings():
            # the safe unpickler warns about a pickle protocol it was not written for, then refuses
            # the file in its own words (reported below as one line)
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
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
        raise UserError(f"cannot read checkpoint {path}: not a PyTorch checkpoint (a pickle the safe loader "
                        f"refuses: {_unpickler_reason(err)})") from None
    except Exception as err:
        raise UserError(f"cannot read checkpoint {path}: not a PyTorch checkpoint "
                        f"({type(err).__name__}: {first_line(err)})") from None


def _unpickler_reason(err: Exception) -> str:
    """The safe unpickler's own reason ("Unsupported operand 149"), without its advice to load the
    file unsafely."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
    return found.group(1).strip().splitlines()[0] if found else "UnpicklingError"


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


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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
        raise UserError(f"{path} is not valid JSON ({first_line(err)})") from None
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


def state_of(weights: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    return dict(weights.state_dict()) if isinstance(weights, nn.Module) else dict(weights)
