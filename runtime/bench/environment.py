"""The environment a bench ran in, read from this process: the software versions, the git
commit, torch's threads, and a hash of every weights file read (`Env` in the result schema)."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from runtime.bench.schema import Env, Profile


COMMIT_ENV = "LANTERN_COMMIT"


def git_commit(cwd: str | os.PathLike[str] | None = None) -> str | None:
    """The commit of the code that runs: $LANTERN_COMMIT when set (a container built from a known
    commit); else HEAD of the repository holding this package (an editable install), else HEAD of
    the working directory's repository when that is a checkout of this project (a non-editable
    `pip install .` run inside the checkout); suffixed `-dirty` when the tree has changes. None
    when none of these answers."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV].strip()
    if cwd is not None:
        return _head(Path(cwd))
    package = Path(__file__).resolve().parents[1]
    found = _head(package.parent) if (package.parent / "pyproject.toml").is_file() else None
    if found is None and (Path.cwd() / "runtime" / "__init__.py").is_file():
        found = _head(Path.cwd())
    return found


def _head(here: Path) -> str | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit or None


def current_env(*, profile: Profile, started_at: datetime, bench_seconds: float, warmup: int, repeats: int,
                timer: str, schedule: str = "interleaved", command_line: Sequence[str] | None = None,
                dtype: str | None = None, checkpoints: Sequence[str | os.PathLike[str]] = ()) -> Env:
    """Env for this process: torch/python/platform/git commit, threads and package versions read
    here, `checkpoints` hashed here, the rest passed in."""
    import torch

    return Env(torch=str(torch.__version__), python=platform.python_version(), platform=platform.platform(),
               git_commit=git_commit(), profile=profile,
               command_line=list(command_line if command_line is not None else sys.argv),
               started_at=started_at.astimezone(timezone.utc).isoformat(timespec="seconds"),
               bench_seconds=float(bench_seconds), warmup=int(warmup), repeats=int(repeats), timer=timer,
               schedule=schedule, threads=torch.get_num_threads(), dtype=dtype, packages=package_versions(),
               checkpoints={str(f): file_sha256(f) for f in checkpoints})


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a bench's numbers depend on (those present)."""
    from importlib import metadata

    found = {}
    for name in ("torch", "numpy", "lantern-runtime", "triton", "habana-torch-plugin", "intel-extension-for-pytorch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
