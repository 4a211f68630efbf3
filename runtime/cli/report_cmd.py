"""`runtime report FILE... --out DIR`: the hardware comparison report from bench result files."""

from __future__ import annotations

from pathlib import Path

import typer

from runtime.cli.app import app


@app.command("report")
def report(
    files: list[Path] = typer.Argument(
        ..., metavar="FILE", help="Bench result files written by `runtime bench --out`.", show_default=False
    ),
    out: Path = typer.Option(
        ..., "--out", help="Directory for report.md, report.html (self-contained), plots/ (PNG and SVG) and tables/ (CSV).", show_default=False
    ),
) -> None:
    """Compare bench results across devices: per-device tables, speedup decomposition, plots.

    Files with different workloads are reported in separate sections with the differing fields
    named. A bad input file stops the command before anything is written.
    """
    from runtime.bench.report import write_report

    for path in write_report(files, out):
        typer.echo(str(path))
