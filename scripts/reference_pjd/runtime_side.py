"""What the project-venv scripts here share (runtime_run.py, published_check.py, token_check.py):
the repository on sys.path, released_run.py's prompts, and a result file's provenance and write."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PROMPTS = ["a red cat on the grass", "a lighthouse at night by the sea"]  # released_run.py's


def provenance() -> dict:
    """One thread, the torch, the platform and the commit a result came from."""
    import torch

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"threads": 1, "torch": torch.__version__, "platform": platform.platform(), "commit": commit.stdout.strip()}


def write(out: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"written {path}")
