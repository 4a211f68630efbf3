"""`runtime bench --shape NAME`: the speedup a method would reach on a real model's shape here.

AR's step and each method's iteration are timed on the named shape with random weights (see
`runtime.bench.projection`); tau comes from a trained model, either every run of a bench result
file (`--tau-from`) or one method with a given `--tau`. The file written is a projection file,
which `runtime report` shows labelled as a projection with both inputs named.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from runtime.utils.errors import UserError
from runtime.config.method_options import BASELINE, METHOD_TABLE

# bench flags that only shape the measured workload or the model: a projection uses neither
_WORKLOAD_FLAGS = ("model", "gpt_model", "gpt_ckpt", "vq_ckpt", "drafter", "image_size", "classes", "num_images",
                   "repeats")


def bench_shape(args: dict[str, Any]) -> None:
    """Run a projection from `runtime bench`'s parameters (its `locals()`)."""
    from rich.console import Console

    from runtime.bench.projection import model_shape, project
    from runtime.generation.device_setup import open_backend
    from runtime.generation.workload import batch_size as batch_of
    from runtime.tools.roofline import device_roof
    from runtime.utils.atomic import atomic_write_text, writing

    out = _check_shape_flags(args)
    shape = model_shape(args["shape"])
    if args["iterations"] < 2:
        raise UserError(f"--iterations must be >= 2, got {args['iterations']}")
    backend, prof = open_backend(args["device"], args["profile_name"], args["graph"], args["dtype"])
    targets = _targets(args, args["flags"].as_dict(), prof, shape)
    warmup = max(prof.bench.warmup if args["warmup"] is None else args["warmup"], 1)
    console = Console(stderr=True)
    body = project(shape, backend, targets, warmup=warmup, iterations=args["iterations"],
                   batch_size=batch_of(args["batch_size"], prof),
                   progress=lambda text: console.print(f"[dim]{text}[/dim]"), roof=lambda: device_roof(backend, prof))
    data, device = _projection_file(body, backend, prof, warmup, args["iterations"])
    with writing(f"--out {out}"):
        atomic_write_text(out, json.dumps(data, indent=2))
    _print_projection(data, device, shape, out)


def _check_shape_flags(args: dict[str, Any]) -> Path:
    """--out, once the flags that do nothing with --shape are refused."""
    given = [f"--{k.replace('_', '-')}" for k in _WORKLOAD_FLAGS if args.get(k) is not None]
    given += ["--sweep"] if args["sweep"] else []
    given += ["--trust-checkpoint"] if args["trust_checkpoint"] else []
    if given:
        raise UserError(f"{given[0]} does nothing with --shape (random weights of the named shape stand in for the "
                        "model, and tau comes from --tau-from or --tau); drop it")
    out = Path(args["out"])
    if out.is_dir():
        raise UserError(f"--out {out}: is a folder; --out names the projection file, e.g. {out / 'projection.json'}")
    return out


def _targets(args: dict[str, Any], flags: dict[str, Any], prof: Any, shape: Any) -> list[Any]:
    """What is projected: every run of --tau-from's file at its tau, or --methods at --tau."""
    from runtime.bench import schema
    from runtime.bench.projection import Target, spec_from_run

    if (args["tau_from"] is None) == (args["tau"] is None):
        raise UserError("--shape needs the tau of a trained model: --tau-from RESULT.json (every run in it) or "
                        "--tau X with one method in --methods")
    if args["tau_from"] is None:
        return _given_tau_targets(args["methods"], float(args["tau"]), flags, prof, shape)
    if args["methods"] is not None or any(v is not None for v in flags.values()):
        raise UserError("--tau-from projects the runs of the file with their own settings; drop --methods and "
                        "the method flags")
    result = schema.load_bench(args["tau_from"])
    targets = [Target(f"{r.method} [{r.params.label()}]", spec_from_run(r, result.workload.sampling),
                      r.stats.mean_accepted_length,
                      f"{args['tau_from']}: {r.method} [{r.params.label()}] on {result.workload.model}")
               for r in result.runs if r.method != BASELINE and not METHOD_TABLE[r.method].checks
               and r.params.dynamic_depth is None]
    if not targets:
        raise UserError(f"{args['tau_from']}: no run to project (ar, ddd and --dynamic-depth runs are skipped)")
    return targets


def _projection_file(body: Any, backend: Any, prof: Any, warmup: int, iterations: int) -> tuple[Any, dict[str, Any]]:
    """(the projection file's data, its device record)."""
    from datetime import datetime, timezone

    from runtime.bench import schema
    from runtime.bench.environment import current_env
    from runtime.bench.projection import projection_file
    from runtime.cli.app import INVOCATION

    info = backend.info()
    device = {"backend": backend.name, "name": str(info.get("name", backend.name)), "count": 1,
              **({"threads": int(info["threads"])} if "threads" in info else {}),
              "versions": {k: str(info[k]) for k in ("torch", "cuda", "driver", "synapseai") if info.get(k)}}
    values = prof.to_dict()  # as resolved: the graph mode and dtype the steps really ran with
    values.setdefault("device", {}).update(graph=bool(backend.graph_mode), dtype=info.get("dtype"))
    env = current_env(profile=schema.Profile(name=prof.name, values=values),
                      started_at=datetime.now(timezone.utc), bench_seconds=0.0, warmup=warmup,
                      repeats=iterations, timer="synchronize+perf_counter", schedule="sequential",
                      command_line=INVOCATION or ["runtime"] + sys.argv[1:], dtype=info.get("dtype"))
    return projection_file(body, device, schema.to_env_dict(env)), device


def _print_projection(data: Any, device: dict[str, Any], shape: Any, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"projection on {device['name']}: {shape.description} -> {out}")
    for col in ("method", "tau (source)", "iteration / AR step", "iteration / floor", "projected speedup [95% CI]"):
        table.add_column(col)
    table.add_row("ar", "1", "1.00", _over_floor(data["ar_step"]), "1.00x")
    for run in data["runs"]:
        s = run["projected_speedup"]
        table.add_row(run["label"], f"{run['tau']:.2f} ({run['tau_source']})", f"{run['iteration_over_ar_step']:.2f}",
                      _over_floor(run), f"{s['point']:.2f}x [{s['low']:.2f}, {s['high']:.2f}]")
    Console().print(table)
    roof = data.get("roof")
    if roof is None:
        Console().print(f"floor: no peak figures for {device['name']} (runtime.tools.roofline.ROOFS); not shown")
    else:
        Console().print(f"floor: max(bytes / bandwidth, FLOPs / matmul rate) per phase at the mean context "
                        f"({roof['context']} positions); {roof['name']}: {roof['bandwidth_bytes_per_s'] / 1e9:,.0f} "
                        f"GB/s, {max(roof['matmul_flops_per_s'].values()) / 1e12:,.1f} TFLOP/s ({roof['source']})")


def _over_floor(entry: dict[str, Any]) -> str:
    """measured / floor of an iteration, with its phases': '12.3x (verify 10.1x, accept 40x)'."""
    floor = entry.get("floor")
    if not floor:
        return "-"
    phases = ", ".join(f"{k} {v['over_floor']:.1f}x" for k, v in floor.items() if k != "iteration")
    return f"{floor['iteration']['over_floor']:.1f}x ({phases})"


def _given_tau_targets(methods: str | None, tau: float, flags: dict[str, Any], prof: Any, shape: Any) -> list[Any]:
    """One projection target per `--methods` entry (`METHOD[:KEY=VALUE...]`, as `runtime bench`
    takes them), each at `--tau`, or at its own `:tau=X` (e.g. one tau per tree)."""
    from runtime.bench.projection import Target
    from runtime.bench.runner import parse_method_entry
    from runtime.generation.settings import resolve_spec

    entries = [m.strip() for m in (methods or "").split(",") if m.strip()]
    if not entries or any(e.split(":")[0] == BASELINE for e in entries):
        raise UserError("--tau projects the methods named in --methods (not ar: it is the baseline every "
                        "projection is measured against)")
    targets = []
    for entry in entries:
        parts = entry.split(":")
        own = [x for x in parts[1:] if x.startswith("tau=")]
        value = tau
        if own:
            try:
                value = float(own[-1][4:])
            except ValueError:
                raise UserError(f"--methods {entry!r}: tau must be a number") from None
        if not value >= 1.0:
            raise UserError(f"--tau is tokens per target forward, >= 1; got {value:g} for {entry!r}")
        label = ":".join([parts[0]] + [x for x in parts[1:] if not x.startswith("tau=")])
        run = parse_method_entry(label)
        spec = resolve_spec(run.method, {**flags, **run.overrides}, prof, dict(shape.sampling),
                            run_methods=sorted({e.split(":")[0] for e in entries}))
        targets.append(Target(label, spec, value, f"given: {'tau' if own else '--tau'} {value:g}"))
    return targets
