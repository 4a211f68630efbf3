"""Atomic file writes: a temp file in the target's folder, renamed over the target on success.

Every file the runtime writes (bench results, bundle parts, manifests, profiler traces) goes
through `atomic_path`, so an error or Ctrl-C leaves either the old file or the new one, never a
half-written one. `tempfile.mkstemp` creates files with mode 0600; the finished file gets the
mode a plain `open(..., "w")` would give (0666 less the umask) so results stay readable by the
other users of a shared machine.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from runtime.utils.errors import UserError


def umask_mode(base: int = 0o666) -> int:
    """`base` with the process umask applied (the mode `open` or `mkdir` would create)."""
    umask = os.umask(0)
    os.umask(umask)
    return base & ~umask


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def owned_prefix(name: str) -> str:
    """The name prefix of this process's temporary files and staging folders for `name`."""
    return f".{name}.{os.getpid()}-{_host_tag()}."


_OWNED = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-(?P<host>[0-9a-f]{8})\.")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale(folder: Path, name: str | None = None) -> list[Path]:
    """Remove from `folder` the temporary files and staging folders (of `name`, or of any name)
    that a process on this host left when it was killed: their owner's pid is gone. Leftovers of
    live processes, and of other hosts sharing the file system, are kept. Returns what went."""
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    host = _host_tag()
    for entry in folder.iterdir():
        m = _OWNED.match(entry.name)
        if m is None or m["host"] != host or (name is not None and m["name"] != name) or _alive(int(m["pid"])):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def staging_folder(out: Path) -> Path:
    """A new private folder beside `out` to build it in (see `publish_folder`), named as its
    owner's; the staging folders of `out` that killed runs left are swept first."""
    parent = Path(out).absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(parent, Path(out).name)
    return Path(tempfile.mkdtemp(prefix=owned_prefix(Path(out).name), dir=parent))


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str], *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to `target`; when the body returns, give it the umask's mode
    and rename it onto `target`. If the body raises, the temporary file is removed and `target`
    is untouched. `fsync` flushes the file to disk before the rename."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=owned_prefix(target.name), suffix=".tmp", dir=target.parent)
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


_WAY_OUT = {
    errno.ENOSPC: "free some space or choose another disk",
    errno.EDQUOT: "free some of your quota or choose another disk",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or choose a file system that holds larger files",
    errno.EROFS: "choose a writable location",
    errno.EACCES: "choose a location you may write to",
    errno.EPERM: "choose a location you may write to",
}


@contextlib.contextmanager
def writing(what: str, then: str = "") -> Iterator[None]:
    """Turn a file-system fault while writing `what` (read-only, full, a file-size limit, missing
    permission, a file where a folder goes) into one `UserError` line naming it and the way out;
    `then` says what to do after (e.g. how to resume)."""
    try:
        yield
    except OSError as err:
        reason = err.strerror or type(err).__name__
        where = f" ({err.filename})" if err.filename else ""
        fix = _WAY_OUT.get(err.errno or 0, "choose a writable location with free space")
        raise UserError(f"cannot write {what}: {reason}{where}; {fix}{f', {then}' if then else ''}") from None


def probe_writable(target: Path, what: str | None = None) -> None:
    """Refuse, before any long work, a `target` path under which nothing can be written (read-only,
    missing permission, a file where a folder goes): one line, as `writing` says it. Creates
    nothing: the probe file goes in the nearest folder that exists, and is removed."""
    nearest = Path(target).absolute().parent
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    with writing(what or f"--out {target}"):
        if not nearest.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(nearest))
        fd, name = tempfile.mkstemp(prefix=owned_prefix(Path(target).name), suffix=".probe", dir=nearest)
        os.close(fd)
        os.unlink(name)


def check_run_folder(out: Path, force: bool, *, marker: str) -> None:
    """Before any work: `out` may be new, empty, or (with `force`) an earlier run, i.e. a folder
    holding `marker`. A file, or a folder of other files, is refused: replacing it would delete
    what the runtime did not write."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder; choose a folder path")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / marker).is_file():
        raise UserError(f"--out {out}: the folder holds files that are not a run (no {marker}); choose a new or "
                        "empty folder")
    if not force:
        raise UserError(f"--out {out}: holds an earlier run; pass --force to replace it whole, or choose "
                        "another folder")


def publish_folder(staging: Path, out: Path) -> None:
    """Move the finished `staging` folder to `out`, replacing an earlier `out` whole (never
    mixing old files with new ones): the old folder is renamed aside, the new one renamed in,
    then the old one deleted."""
    os.chmod(staging, umask_mode(0o777))  # mkdtemp made it private
    if out.is_dir():
        old = Path(tempfile.mkdtemp(prefix=owned_prefix(out.name) + "old.", dir=out.absolute().parent))
        os.replace(out, old / out.name)
        try:
            os.replace(staging, out)
        except BaseException:
            os.replace(old / out.name, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(staging, out)
