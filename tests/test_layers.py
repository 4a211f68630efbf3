"""The layers hold: import-linter's contract (pyproject.toml) is kept, it places every module of
the runtime, and no module imports another in a cycle."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast

grimp = pytest.importorskip("grimp", reason="the layer checks need import-linter (the test extra)")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "backends", "profiles")


def import_cycles(graph: "grimp.ImportGraph") -> list[list[str]]:
    """Strongly connected groups of more than one module (each a set of modules importing each
    other, directly or through the others), by Tarjan's algorithm; imports under
    `TYPE_CHECKING` count too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                group.append(other)
                if other == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_the_cycle_finder_sees_a_cycle_through_a_third_module():
    graph = grimp.ImportGraph()
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")]:
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_module_imports_another_in_a_cycle():
    assert import_cycles(grimp.build_graph(*PACKAGES)) == []


def test_the_layer_contract_is_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.exists(), "lint-imports is not installed beside this python; pip install '.[test]'"
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_every_runtime_module_has_a_layer():
    """A new module must be placed: every module of the packages is, or is under, one of the
    contract's layers (the packages' own __init__, a package whose modules sit in several layers,
    and the entry point excepted)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = [name.strip() for contract in config["contracts"] if contract["type"] == "layers"
              for layer in contract["layers"] for name in layer.replace(":", "|").split("|")]
    unplaced = [m for m in grimp.build_graph(*PACKAGES).modules
                if m not in PACKAGES and m != "runtime.__main__" and m.split(".")[0] == "runtime"
                and not any(m == layer or m.startswith(layer + ".") for layer in layers)
                and not any(layer.startswith(m + ".") for layer in layers)]  # a package split across layers
    assert unplaced == [], f"add these modules to a layer in pyproject.toml [tool.importlinter]: {unplaced}"


def test_the_package_root_holds_only_its_face():
    """The folders name the layers: at most four modules at runtime/'s root (`__init__`,
    `__main__` and the public face); every other module sits in the folder of its layer."""
    loose = sorted(p.name for p in (ROOT / "runtime").glob("*.py"))
    assert len(loose) <= 4, f"move these into a layer's folder: {loose}"


def test_the_commands_are_thin_shells():
    """The commands keep flags, output files and printing; the work is below them: no function of
    runtime/cli is over 60 lines (decorators excluded, its signature included)."""
    import ast

    long = []
    for path in sorted((ROOT / "runtime" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == [], long
