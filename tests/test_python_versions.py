"""The package runs on every Python `pyproject.toml` admits (>= 3.10: Intel's Gaudi containers
run Ubuntu 22.04's 3.10), although CI's interpreter is 3.11."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from runtime.config.toml_compat import tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "backends", "profiles")


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_every_module_parses_with_the_grammar_of_python_3_10():
    bad = []
    for path in _modules():
        try:
            ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
        except SyntaxError as err:
            bad.append(f"{path.relative_to(REPO)}:{err.lineno}: {err.msg}")
    assert not bad, bad


def test_only_the_compat_module_imports_tomllib():
    """tomllib is new in 3.11: everything else reads TOML through runtime.config.toml_compat."""
    importers = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "tomllib" in names:
                importers.append(str(path.relative_to(REPO)))
    assert importers == ["runtime/config/toml_compat.py"]


def test_tomli_is_declared_where_tomllib_is_missing():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"
    tomli = [d for d in project["dependencies"] if d.replace(" ", "").startswith("tomli")]
    assert len(tomli) == 1 and "python_version<'3.11'" in tomli[0].replace(" ", "").replace('"', "'")


def test_python_3_10_reads_toml_through_tomli():
    """The 3.10 branch, run here by posing as 3.10 with a stand-in tomli."""
    code = (
        "import sys, types, tomllib\n"
        "fake = types.ModuleType('tomli'); fake.loads = tomllib.loads; fake.TOMLDecodeError = tomllib.TOMLDecodeError\n"
        "sys.modules['tomli'] = fake; sys.modules['tomllib'] = None\n"
        "sys.version_info = (3, 10, 13, 'final', 0)\n"
        "from runtime.config.toml_compat import tomllib as chosen\n"
        "assert chosen is fake, chosen\n"
        "print(chosen.loads('paths = [[0]]'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'paths': [[0]]}"
