"""The project's own bundles: one `<name>.safetensors` per part and a `manifest.json`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from torch import Tensor, nn

from runtime.utils.errors import UserError
from runtime.models.loading.files import read_safetensors, state_of, read_json, write_json, write_safetensors

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
        write_safetensors(folder / filename, state_of(weights))
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
        parts[name] = BundlePart(config=dict(entry.get("config") or {}), state=read_safetensors(weights))
    extra = {k: v for k, v in data.items() if k not in ("format", "version", "parts")}
    return Bundle(path=folder, manifest=extra, parts=parts)
