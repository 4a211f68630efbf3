"""`.ci/run` keeps its promises: strict bash, CPU torch before the project, non-editable install
with the test extra, and the README's own test command."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI_SCRIPT = ROOT / ".ci" / "run"
README = ROOT / "README.md"


def ci_commands() -> list[str]:
    """The script's non-comment, non-blank lines."""
    lines = CI_SCRIPT.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def readme_test_command() -> str:
    """The command in the README's "Testing" section code block."""
    testing = README.read_text().split("## Testing", 1)[1]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", testing, re.S)
    assert block is not None, "README's Testing section has no code block"
    commands = [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 1, f"expected one test command in README's Testing block, got {commands}"
    return commands[0]


def index_of(commands: list[str], pattern: str) -> int:
    for index, command in enumerate(commands):
        if re.search(pattern, command):
            return index
    raise AssertionError(f"no line of .ci/run matches {pattern!r}")


def test_script_is_strict_bash() -> None:
    text = CI_SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in ci_commands()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(CI_SCRIPT)], check=True)


def test_cpu_torch_is_installed_before_the_project_and_the_project_is_not_editable() -> None:
    commands = ci_commands()
    torch_line = index_of(commands, r"pip install [\"']?torch==2\.13\.0")
    project_line = index_of(commands, r"pip install [\"']?\.\[test\]")
    assert torch_line < project_line
    assert not any(re.search(r"pip install .*(-e|--editable)\b", command) for command in commands)


def test_script_runs_the_readme_test_command_last() -> None:
    assert ci_commands()[-1] == readme_test_command()
