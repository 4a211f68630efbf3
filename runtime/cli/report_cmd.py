"""`runtime report FILE... --out DIR`: the hardware comparison report from bench result files."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from runtime.cli.app import app


@app.command("report")
def report(
    files: list[Path] = typer.Argument(
        ..., metavar="FILE", help="Bench result files written by `runtime bench --out`.", show_default=False
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Directory for report.md, report.html (self-contained), plots/ (PNG and SVG) and tables/ (CSV).", show_default=False
    ),
    index: Optional[Path] = typer.Option(
        None, "--index", help="Also (or only) write a markdown index of the files: one row each, linked, with "
        "device, workload, fastest method, commit and command (e.g. results/README.md).", show_default=False
    ),
) -> None:
    """Compare bench results across devices: per-device tables, speedup decomposition, plots.

    Files with different workloads are reported in separate sections with the differing fields
    named. A bad input file stops the command before anything is written.
    """
    from runtime.utils.atomic import atomic_write_text, writing
    from runtime.bench.report import results_index, write_report
    from runtime.utils.errors import UserError

    if out is None and index is None:
        raise UserError("give --out DIR (the report) or --index FILE.md (an index of the files), or both")
    text = results_index(files, index) if index is not None else None
    if out is not None:
        for path in write_report(files, out):
            typer.echo(str(path))
    if index is not None:
        with writing(f"--index {index}"):
            atomic_write_text(index, text)
        typer.echo(str(index))
