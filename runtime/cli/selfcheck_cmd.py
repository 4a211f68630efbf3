"""`runtime selfcheck`: device checks and step costs in one command (see runtime/tools/selfcheck.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from runtime.cli.app import app


@app.command("selfcheck")
def selfcheck(
    device: str = typer.Option("auto", "--device", help="cpu, cuda, hpu or auto."),
    out: Path = typer.Option(Path("selfcheck.json"), "--out", help="Where to write the JSON report."),
    graph: bool = typer.Option(True, "--graph/--no-graph", help="Check captured steps (graph == eager, host syncs)."),
    xl: bool = typer.Option(True, "--xl/--no-xl", help="Measure LlamaGen-XL-shaped step costs (random weights)."),
) -> None:
    """Graph == eager, greedy exactness, no zero-probability samples, no host sync in replays,
    per-phase time / ops / kernels / memory, and LlamaGen-XL step costs. Exit 1 names a failed check."""
    from backends import get_backend
    from runtime.utils.atomic import atomic_path
    from runtime.utils.errors import UserError
    from runtime.tools.selfcheck import run_selfcheck

    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name such as {out / 'selfcheck.json'}")
    backend = get_backend(device, dtype="fp32", graph_mode=graph)
    console = Console(stderr=True)
    xl_backends, roof = None, None
    if xl:  # the XL shape as users run it: the device profile's dtype (bf16 on cuda / hpu), eager and captured
        from runtime.tools.roofline import device_roof
        from runtime.cli import options as opt

        eager, prof = opt.open_backend(device, None, False, None)
        xl_backends = {"eager": eager}
        if graph:
            xl_backends["captured"] = opt.open_backend(device, None, True, None)[0]
        roof = device_roof(eager, prof)
    report = run_selfcheck(backend, xl=xl, progress=lambda msg: console.print(f"[dim]selfcheck:[/] {msg}"),
                           xl_backends=xl_backends, roof=roof)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        Path(tmp).write_text(json.dumps(report.to_dict(), indent=2) + "\n")

    table = Table(title=f"selfcheck on {report.device.get('name', backend.name)} ({report.seconds:.0f} s)")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for c in report.checks:
        mark = "skipped" if c.passed is None else ("pass" if c.passed else "FAIL")
        table.add_row(c.name, mark, c.detail)
    for name, ph in report.phases.items():
        ops = ", ".join(f"{k} {v:.0f}" for k, v in ph["ops_per_iteration"].items())
        secs = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in ph["seconds"].items())
        table.add_row(name, "measured", f"ops/iter: {ops}; {secs}")
    for mode, x in (report.xl_shape or {}).items():
        if mode in ("model", "roof"):
            continue
        ar = x["ar_step"]
        floor = f" ({ar['floor']['iteration']['over_floor']:.1f}x its floor)" if "floor" in ar else ""
        table.add_row(f"GPT-XL shape, {mode} {x['dtype']}", "measured",
                      f"AR step {(ar['verify_s'] + ar['accept_s']) * 1e3:.1f} ms{floor}; verify(58) / AR "
                      f"{x['verify_over_ar_step']:.2f}; draft / AR {x['draft_over_ar_step']:.2f}")
    Console().print(table)
    if report.failed:
        Console(stderr=True).print(f"selfcheck failed: {', '.join(report.failed)} (details in {out})")
        raise typer.Exit(1)
