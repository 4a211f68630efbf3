"""What the pages say of the command line and the HTTP API is what the code declares: every
`runtime COMMAND --flag` written in README.md or docs/ names an option of that command, every
flag written on its own names an option of some command (or of the tool its page is about), and
every endpoint a page names is a route of `runtime serve`."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "commands.md")]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# flags of other tools that pages show on their own (docker run / build in the deployment page)
OTHER_TOOLS = {"--build-arg", "--cap-add", "--gpus", "--ipc", "--net", "--network", "--runtime"}


def _options(command: Any) -> set[str]:
    return {o for p in command.params for o in [*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())]
            if o.startswith("--")}


@pytest.fixture(scope="module")
def cli() -> SimpleNamespace:
    """{"run": {flags}, "train drafter": {...}, ...} and the root's own flags."""
    import typer

    from runtime.cli.app import _register, app

    _register()
    root = typer.main.get_command(app)
    commands: dict[str, set[str]] = {}

    def walk(command: Any, path: list[str]) -> None:
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        else:
            commands[" ".join(path)] = _options(command) | {"--help"}

    walk(root, [])
    load = (ROOT / "runtime" / "serve" / "load.py").read_text(encoding="utf-8")
    tester = set(re.findall(r'add_argument\("(--[a-z-]+)"', load))
    return SimpleNamespace(commands=commands, root=_options(root), tester=tester)


def _code(text: str) -> list[str]:
    """The lines of the page's code blocks and its inline code spans."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return [line for block in blocks for line in block.splitlines()] + inline


# `runtime [-v] COMMAND [SUB] ...` at the start of a line of code, or after a shell's && ; | ( or $
COMMAND_LINE = re.compile(r"(?:^|&&|;|\||\(|\$)\s*runtime((?:\s+-[-\w]+)*)\s+([a-z][a-z-]*)(?:\s+([a-z][a-z-]*))?"
                          r"([^|;&#]*)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_line_on_a_page_uses_that_commands_options(cli, page: Path) -> None:
    wrong = []
    for line in _code(page.read_text(encoding="utf-8")):
        for m in COMMAND_LINE.finditer(line.strip()):
            root_flags, command, sub, rest = m.groups()
            name = f"{command} {sub}" if sub and f"{command} {sub}" in cli.commands else command
            if name not in cli.commands:
                wrong.append(f"unknown command 'runtime {name}' in: {line.strip()}")
                continue
            words = rest if name != command else f"{sub or ''} {rest}"
            wrong += [f"runtime {name} has no {flag}: {line.strip()}" for flag in FLAG.findall(words)
                      if flag not in cli.commands[name] and flag not in cli.root]
            wrong += [f"runtime has no {flag}" for flag in FLAG.findall(root_flags) if flag not in cli.root]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_a_page_names_on_its_own_exists(cli, page: Path) -> None:
    known = set().union(*cli.commands.values()) | cli.root | cli.tester | OTHER_TOOLS
    alone = [m.group(1) for line in _code(page.read_text(encoding="utf-8"))
             if (m := re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =]\S+)?(?:/--[a-z][a-z0-9-]*)?", line.strip()))]
    assert not [flag for flag in alone if flag not in known], page


ENDPOINT = re.compile(r"\b(?:GET|POST|OPTIONS)\s+(/[\w/{}.-]*)|`(/(?:v1/[\w/{}.-]*|health|ready|version|info|metrics))`")


def test_every_endpoint_a_page_names_is_a_route_of_the_server() -> None:
    pytest.importorskip("fastapi", reason="runtime serve needs the serve extra (in the test extra)")
    from runtime.serve.api import HttpOptions, create_app

    engine = SimpleNamespace(ready=None, decoder=None, stats=None, queue_depth=0, on_done=None)
    served = SimpleNamespace(version="V", method="-", names=["-"], in_flight=0)
    app = create_app(engine, served, HttpOptions())  # type: ignore[arg-type]
    routes = {re.sub(r"\{[^}]*\}", "{}", r.path) for r in app.routes}  # a path parameter by any name
    named = {(page.name, re.sub(r"\{[^}]*\}", "{}", path.rstrip("/") or "/")) for page in PAGES
             for m in ENDPOINT.finditer(page.read_text(encoding="utf-8")) for path in [m.group(1) or m.group(2)]}
    assert len(named) > 8  # the pages do name the API
    missing = sorted((page, path) for page, path in named
                     if path not in routes and not path.startswith("/ui/") and not path.startswith("/lantern"))
    assert not missing, missing
