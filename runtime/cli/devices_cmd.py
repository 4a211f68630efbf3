"""`runtime devices`: which backends can run here, on what hardware, with which software versions."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from runtime.cli.app import app


def probe_devices() -> list[dict[str, Any]]:
    """One row per backend: ``backend``, ``available``, ``reason`` and, when available, its ``info()``
    plus the shipped ``profile`` that ``--profile-name`` defaults to on it."""
    import torch

    from backends import BACKENDS
    from runtime.errors import UserError
    from runtime.profiles import default_profile_name

    rows: list[dict[str, Any]] = []
    for name, cls in BACKENDS.items():
        available, reason = cls.availability()
        row: dict[str, Any] = {"backend": name, "available": available, "reason": reason, "torch": torch.__version__}
        if available:
            try:
                info = cls().info()
            except UserError as err:  # e.g. the device vanished or is held by another process
                row.update(available=False, reason=str(err))
            else:
                row.update(info)
                row["profile"] = default_profile_name(name, str(info.get("name", "")))
        rows.append(row)
    return rows


def _versions(row: dict[str, Any]) -> str:
    parts = []
    if row.get("cuda"):
        parts.append(f"CUDA {row['cuda']}")
    if row.get("driver"):
        parts.append(f"driver {row['driver']}")
    if row.get("synapseai"):
        parts.append(f"SynapseAI {row['synapseai']}")
    if row.get("hpu_mode"):
        parts.append(f"{row['hpu_mode']} mode")
    return ", ".join(parts) or "-"


@app.command("devices")
def devices(
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON instead of a table."),
) -> None:
    """List the backends (cpu, cuda, hpu): available or why not, device name and count, versions."""
    rows = probe_devices()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="Devices")
    for column in ("backend", "available", "device", "count", "torch", "CUDA / driver / SynapseAI", "profile", "reason"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            row["backend"],
            "[green]yes[/green]" if row["available"] else "[red]no[/red]",
            str(row.get("name", "-")),
            str(row.get("count", "-")),
            row["torch"],
            _versions(row),
            row.get("profile", "-"),
            row["reason"] or "",
        )
    Console().print(table)
