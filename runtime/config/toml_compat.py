"""TOML reading on every Python the package supports: the standard `tomllib` from 3.11, its
backport `tomli` (a declared dependency for older Pythons, same API) on 3.10, which Intel's
Gaudi containers (Ubuntu 22.04) run. Modules read TOML through this one, never `tomllib` directly."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["tomllib"]
