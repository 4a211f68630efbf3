"""Where the runtime keeps what it can rebuild (neighbour tables, compiled steps)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VAR = "LANTERN_RUNTIME_CACHE"


def cache_root() -> Path:
    """`$LANTERN_RUNTIME_CACHE`, else `$XDG_CACHE_HOME/lantern-runtime` (`~/.cache/lantern-runtime`)."""
    chosen = os.environ.get(CACHE_VAR)
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "lantern-runtime"


def root_is_chosen() -> bool:
    """Whether the user named the cache (`LANTERN_RUNTIME_CACHE`): a fault there is theirs to fix;
    a fault in the default one only costs the rebuild."""
    return bool(os.environ.get(CACHE_VAR))
