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
    from runtime.utils.errors import UserError
    from runtime.config.profiles import default_profile_name

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
    Console().print(devices_table(rows))


def devices_table(rows: list[dict[str, Any]]) -> Table:
    """Backend and status, then the device (name x count, versions, profile) or why it is not
    available, on lines of their own: fits 80 columns."""
    table = Table(title=f"Devices (torch {rows[0]['torch']})" if rows else "Devices", title_justify="left")
    table.add_column("backend", no_wrap=True)
    table.add_column("available", no_wrap=True)
    table.add_column("device / why not", overflow="fold", ratio=1)
    for row in rows:
        if row["available"]:
            versions = _versions(row)
            detail = (f"{row.get('name', '-')} x{row.get('count', '-')}\n[dim]"
                      + (f"{versions}; " if versions != "-" else "") + f"profile {row.get('profile', '-')}[/]")
        else:
            detail = row["reason"] or "-"
        table.add_row(row["backend"], "[green]yes[/green]" if row["available"] else "[red]no[/red]", detail)
    return table
