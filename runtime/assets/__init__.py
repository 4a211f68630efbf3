"""Package data: draft-tree presets and the embedded demo bundle."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def default_bundle_path() -> Path:
    """The demo bundle packaged with the runtime (`runtime/assets/demo`)."""
    return Path(str(resources.files("runtime.assets").joinpath("demo")))
