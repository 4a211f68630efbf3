"""`runtime bench`: every method on one workload, timed on the device, written as a result file."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from runtime.cli import options as opt
from runtime.cli.app import INVOCATION, app
from runtime.utils.errors import UserError


Out = Annotated[str, typer.Option("--out", help=(
    "Result file (JSON, schema in docs/bench_schema.md)."))]
Methods = Annotated[Optional[str], typer.Option("--methods", show_default="ar,sd,eagle2,lantern,lantern++", help=(
    "Comma-separated methods; include ar for speedups. An entry may carry its own options: "
    "sjd:coupling=maximal:proactive=3x2 (a shared --lantern-lambda relaxes sjd too; give it per entry "
    "instead)."))]
Repeats = Annotated[Optional[int], typer.Option("--repeats", help=(
    "Timed repeats of the whole workload (default: the profile's)."))]
Warmup = Annotated[Optional[int], typer.Option("--warmup", help=(
    "Untimed warm-up runs per method (default: the profile's)."))]
Sweep = Annotated[list[str], typer.Option("--sweep", help=(
    "lambda=1,2,4 | delta=0.05,0.1 | tree=a,b | k=5,10 | batch=1,4,8 (every method, ar included; "
    "repeatable)."))]
Quality = Annotated[bool, typer.Option("--quality/--no-quality", help=(
    "Measure class accuracy and FD (demo models)."))]
MeasureLaw = Annotated[bool, typer.Option("--measure-law/--no-measure-law", help=(
    "Measure each drafting method's step TVD (what its acceptance rule does to the law) in an untimed "
    "warm-up pass."))]
Interleave = Annotated[bool, typer.Option("--interleave/--no-interleave", help=(
    "Time the methods' repeats round-robin (default) or each method's back to back (keeps one decoder "
    "in memory at a time)."))]
Shape = Annotated[Optional[str], typer.Option("--shape", help=(
    "Project instead of measure: time AR and each method's iteration on a model shape with random "
    "weights (demo, llamagen-b, llamagen-l, llamagen-xl, llamagen-xxl, chameleon-7b, janus-pro-1b, "
    "janus-pro-7b, emu3-8b) and report tau x AR step / iteration; needs --tau-from or --tau."))]
TauFrom = Annotated[Optional[str], typer.Option("--tau-from", help=(
    "--shape: a bench result file; every run in it is projected with the tau it measured."))]
Tau = Annotated[Optional[float], typer.Option("--tau", help=(
    "--shape: the tau (measured on a trained model) of the methods in --methods; an entry may give its "
    "own as METHOD:tau=X."))]
Iterations = Annotated[int, typer.Option("--iterations", help=(
    "--shape: timed iterations per method."))]
Profile = Annotated[bool, typer.Option("--profile", help=(
    "Also write a torch.profiler trace of each run, <out>.traces/NN.json.gz (NN = the run's index) of "
    "its first decode batch, from one extra untimed pass after its timed repeats; open in "
    "ui.perfetto.dev."))]


@app.command("bench")
@opt.with_method_options()
@opt.with_model_options
def bench(
    out: Out,
    methods: Methods = None,
    repeats: Repeats = None,
    warmup: Warmup = None,
    sweep: Sweep = [],
    quality: Quality = True,
    measure_law: MeasureLaw = True,
    interleave: Interleave = True,
    source: opt.ModelSource = None,  # every model option (opt.MODEL_OPTIONS)
    device: opt.Device = "auto",
    profile_name: opt.ProfileName = None,
    graph: opt.Graph = None,
    dtype: opt.Dtype = None,
    flags: opt.MethodFlags = None,  # every method option (runtime.config.method_options)
    attention: opt.Attention = "auto",
    classes: opt.Classes = None,
    num_images: opt.NumImages = None,
    seed: opt.Seed = 0,
    batch_size: opt.BatchSize = None,
    shape: Shape = None,
    tau_from: TauFrom = None,
    tau: Tau = None,
    iterations: Iterations = 20,
    profile: Profile = False,
) -> None:
    """Benchmark methods on one workload; speedups are ratios to AR from the same run."""
    if shape is not None:
        from runtime.cli.shape_bench import bench_shape

        if profile:
            raise UserError("--profile traces a measured bench, not a --shape projection; drop one of them")
        bench_shape({**locals(), **dataclasses.asdict(source)})  # the model options as bench lists them
        return
    for flag, value in (("--tau-from", tau_from), ("--tau", tau)):
        if value is not None:
            raise UserError(f"{flag} is for --shape projections; add --shape NAME or drop {flag}")
    from runtime.bench.runner import plan_runs

    method_list = _check_bench_flags(methods or "ar,sd,eagle2,lantern,lantern++", repeats, warmup, out, num_images)
    plan = plan_runs(method_list, sweep)
    if batch_size is not None and any(p.batch_size is not None for p in plan):
        raise UserError("--batch-size and --sweep batch=... both set the batch size; give one")
    settings = {"device": device, "profile_name": profile_name, "graph": graph, "dtype": dtype,
                "attention": attention, "classes": classes, "num_images": num_images, "seed": seed,
                "batch_size": batch_size, "repeats": repeats, "warmup": warmup, "quality": quality,
                "interleave": interleave, "measure_law": measure_law}
    result, path = _measure_and_save(source, flags.as_dict(), plan, settings, out, profile)
    _print_bench(result, path)


def _measure_and_save(source: Any, flags: dict[str, Any], plan: list[Any], settings: dict[str, Any], out: str,
                      profile: bool) -> tuple[Any, Path]:
    """Measure, then write the result file, its grids and (--profile) its traces, all or nothing."""
    from runtime.bench.grids import grids_dir, write_grids
    from runtime.bench.schema import save_bench
    from runtime.utils.atomic import publish_folder, writing

    grids: list = []
    traces = Path(out).with_suffix(".traces")
    trace_staging = _staging_folder(traces) if profile else None
    try:
        result = _measure(source, flags, plan, settings, trace_staging,
                          on_images=lambda i, images: grids.append((i, images)))
        with writing(f"--out {out}"):
            path = save_bench(result, out)
            write_grids(grids, grids_dir(path))
            if trace_staging is not None:
                publish_folder(trace_staging, traces)
    finally:
        if trace_staging is not None:
            shutil.rmtree(trace_staging, ignore_errors=True)  # already gone once published
    return result, path


def _check_bench_flags(methods: str, repeats: int | None, warmup: int | None, out: str,
                       num_images: int | None) -> list[str]:
    """The --methods list, once the flags a measured bench reads are checked."""
    from runtime.core.methods import METHODS
    from runtime.generation.workload import check_num_images

    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    if not method_list:
        raise UserError(f"--methods is empty; choose from {', '.join(METHODS)}")
    for name, value in (("--repeats", repeats), ("--warmup", warmup)):
        if value is not None and value < (1 if name == "--repeats" else 0):
            raise UserError(f"{name} must be >= {1 if name == '--repeats' else 0}, got {value}")
    if Path(out).is_dir():
        raise UserError(f"--out {out}: is a folder; --out names the result file, e.g. {Path(out) / 'bench.json'}")
    check_num_images(num_images)
    return method_list


def _measure(source: Any, flags: dict[str, Any], plan: list[Any], s: dict[str, Any], trace_dir: Path | None,
             on_images: Any) -> Any:
    """Open the model through the generation layer, refuse bad settings before the long part,
    and run the planned methods (`runtime.bench.runner.bench`)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from runtime.bench.runner import bench as run_bench
    from runtime.generation.device_setup import open_model
    from runtime.generation.loading import parse_classes
    from runtime.generation.settings import resolve_spec
    from runtime.generation.workload import batch_size as batch_of
    from runtime.models.layers import use_attention_kernel

    with use_attention_kernel(s["attention"]):  # refuses an unknown kernel before any work
        backend, prof, loaded = open_model(source, s["device"], s["profile_name"], s["graph"], s["dtype"])
        if loaded.config.model_type != "c2i":
            raise UserError("runtime bench supports class-conditional models for now; use runtime run for t2i")
        conditions = parse_classes(s["classes"], s["num_images"], loaded)
        for p in plan:  # refuse bad settings before the long part starts
            resolve_spec(p.method, {**flags, **p.overrides}, prof, loaded.recommended,
                         run_methods=sorted({q.method for q in plan}))
        batch = min(batch_of(s["batch_size"], prof), len(conditions))  # never wider than the workload
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
            task = bar.add_task("bench", total=None)

            def progress(label: str, done: int, total: int) -> None:
                bar.update(task, description=f"bench: {label}", completed=done, total=total)

            return run_bench(loaded, backend, prof, plan, flags, conditions, seed=s["seed"],
                             warmup=prof.bench.warmup if s["warmup"] is None else s["warmup"],
                             repeats=prof.bench.repeats if s["repeats"] is None else s["repeats"],
                             quality=s["quality"], command_line=INVOCATION or ["runtime"] + sys.argv[1:],
                             interleave=s["interleave"], batch_size=batch, progress=progress, on_images=on_images,
                             trace_dir=trace_dir, measure_law=s["measure_law"])


def _print_bench(result: Any, path: Path) -> None:
    from rich.console import Console

    from runtime.bench.report import bench_warnings, floor_line, summary_line

    console = Console()
    console.print(bench_table(result, path))
    for line in (summary_line(result), floor_line(result)):
        if line is not None:
            console.print(line.replace("`", ""))
    for warning in bench_warnings(result):
        console.print(f"[yellow]warning:[/] {warning.replace('`', '')}")


def bench_table(result: Any, path: Path) -> Any:
    """The console summary of a bench: one row per run, its settings and quality on dim lines
    under the method, so the table fits 80 columns."""
    from rich import box
    from rich.table import Table

    from runtime.bench.report import quality_text, speedup_text
    from runtime.bench.schema import ar_baseline

    table = Table(title=f"runtime bench on {result.device.name} ({result.device.backend}) -> {path}",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("method, settings, quality", overflow="fold", ratio=1)
    for col in ("tau", "depth", "speedup [95% CI]", "img/s", "tvd"):
        table.add_column(col, no_wrap=True, justify="right")
    for run in result.runs:
        lines = [run.params.label()] if run.params.label() != "-" else []
        if run.quality.measured:
            lines.append(f"quality: {quality_text(run, own_only=True)}")
        detail = "\n".join(lines)
        depth, tvd = run.stats.mean_drafted_depth, run.stats.step_tvd
        table.add_row(f"[bold]{run.method}[/]" + (f"\n[dim]{detail}[/]" if detail else ""),
                      f"{run.stats.mean_accepted_length:.2f}",
                      "-" if not depth else f"{depth:.2f}",
                      speedup_text(run, ar_baseline(result.runs, run.params.batch_size)),
                      f"{run.images_per_s:.3f}", "-" if tvd is None else f"{tvd:.3f}")
    return table


def _staging_folder(target: Path) -> Path:
    """A new hidden folder beside `target`, published in its place once complete."""
    from runtime.utils.atomic import staging_folder, writing

    with writing(f"--out {target.parent}"):
        return staging_folder(target)
