"""Strict loading: a state dict checked against a module, with one-line errors naming the file,
the key and both shapes."""

from __future__ import annotations

import re
from typing import Mapping

import torch
from torch import Tensor, nn

from runtime.utils.errors import UserError

# Keys that official files may carry but that hold no weights: the RoPE table (some old
# checkpoints stored it), KV-cache buffers (a state dict taken after `setup_caches`), HF rotary
# inverse frequencies, and the VQ usage ring buffer (absent when saved with show_usage=False).
HARMLESS_EXTRA = re.compile(r"(^|\.)freqs_cis$|(^|\.)kv_cache\.|(^|\.)rotary_emb\.inv_freq$")
_HARMLESS_MISSING = re.compile(r"(^|\.)codebook_used$")


def shape_text(t: Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


def check_state_dict(module: nn.Module, state: Mapping[str, Tensor], source: str,
                     hint: str | None = None) -> dict[str, Tensor]:
    """Validate `state` against `module.state_dict()`; return it minus the harmless extras.

    Raises one `UserError` for the first problem (missing key, unexpected key, shape mismatch),
    naming `source`, the key and both shapes, plus how many further problems there are.
    """
    expected = module.state_dict()
    state = {k: v for k, v in state.items() if k in expected or not HARMLESS_EXTRA.search(k)}
    problems: list[str] = []
    for key, want in expected.items():
        got = state.get(key)
        if got is None:
            if not _HARMLESS_MISSING.search(key):
                problems.append(f"missing key {key!r} (expected shape {shape_text(want)}, found none)")
        elif got.shape != want.shape:
            problems.append(f"shape mismatch for {key!r}: expected {shape_text(want)}, found {shape_text(got)}")
    for key, got in state.items():
        if key not in expected:
            problems.append(f"unexpected key {key!r} (expected none, found shape {shape_text(got)})")
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
