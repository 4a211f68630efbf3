"""What the commands that write result files share: the process group's backend under torchrun and
the software record of a result."""

from __future__ import annotations

import os
from typing import Any


def process_group_backend(device: str) -> str:
    """The torch.distributed backend for `device` under torchrun ("cpu" when single-process)."""
    from backends import resolve_backend_name

    if os.environ.get("WORLD_SIZE", "1") == "1":
        return "cpu"  # single process: no process group; the name is unused
    return resolve_backend_name(device)


def software_record() -> dict[str, Any]:
    """What reproducing a result needs: package version, git commit (None where unknown) and the
    command line of this invocation."""
    from runtime import __version__
    from runtime.bench.environment import git_commit
    from runtime.cli.app import INVOCATION

    return {"version": __version__, "git_commit": git_commit(), "command_line": list(INVOCATION)}
