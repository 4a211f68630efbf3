"""The generated command reference (docs/reference/commands.md) is what the commands declare."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.cli.reference import command_reference

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "commands.md"


def test_the_committed_reference_is_what_the_commands_declare():
    assert PAGE.read_text(encoding="utf-8") == command_reference(), (
        "docs/reference/commands.md is stale: run `python -m runtime.cli.reference --out docs/reference/commands.md`")


def test_every_command_and_option_is_in_the_reference():
    import typer

    from runtime.cli.app import _register, app

    _register()
    page = command_reference()
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="runtime")
    for name in root.list_commands(ctx):
        command = root.get_command(ctx, name)
        subs = ([command.get_command(ctx, s) for s in command.list_commands(ctx)]
                if hasattr(command, "list_commands") else [command])
        assert f"## `runtime {name}" in page
        for sub in subs:
            for param in sub.params:
                for flag in getattr(param, "opts", []):
                    if flag.startswith("-"):
                        assert f"`{flag}" in page or f", {flag}" in page or f" {flag}" in page, flag
