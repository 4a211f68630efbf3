"""Atomic file writes: a temp file in the target's folder, renamed over the target on success.

Every file the runtime writes (bench results, bundle parts, manifests, profiler traces) goes
through `atomic_path`, so an error or Ctrl-C leaves either the old file or the new one, never a
half-written one. `tempfile.mkstemp` creates files with mode 0600; the finished file gets the
mode a plain `open(..., "w")` would give (0666 less the umask) so results stay readable by the
other users of a shared machine.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def umask_mode(base: int = 0o666) -> int:
    """`base` with the process umask applied (the mode `open` or `mkdir` would create)."""
    umask = os.umask(0)
    os.umask(umask)
    return base & ~umask


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to `target`; when the body returns, give it the umask's mode
    and rename it onto `target`. If the body raises, the temporary file is removed and `target`
    is untouched. `fsync` flushes the file to disk before the rename."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.chmod(tmp, umask_mode())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(target: str | os.PathLike[str], text: str, *, fsync: bool = False) -> Path:
    """Write `text` (UTF-8) to `target` atomically; returns the target path."""
    with atomic_path(target, fsync=fsync) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(target)


def atomic_write_bytes(target: str | os.PathLike[str], data: bytes, *, fsync: bool = False) -> Path:
    """Write `data` to `target` atomically; returns the target path."""
    with atomic_path(target, fsync=fsync) as tmp:
        tmp.write_bytes(data)
    return Path(target)
