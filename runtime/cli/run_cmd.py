"""`runtime run`: generate images with any method and write them, their tokens and result.json.

Output is written atomically: everything goes to a hidden staging folder beside `--out` and is
moved into place only after every file is complete, so an error or Ctrl-C leaves nothing
half-written. Under `torchrun` images are sharded across ranks and rank 0 writes one folder.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from runtime.cli import options as opt
from runtime.cli.app import app
from runtime.utils.atomic import check_run_folder, publish_folder, staging_folder, writing
from runtime.utils.errors import UserError
from runtime.cli.workload import process_group_backend, software_record

if TYPE_CHECKING:
    from backends import Backend
    from runtime.generation.generator import ImageGenerator
    from runtime.generation.workload import Workload


RESULT_SCHEMA_VERSION = 1


@app.command("run")
@opt.with_method_options()
@opt.with_model_options
def run(
    out: str = typer.Option("out", "--out", help="Output folder: new or empty, or an earlier run's with --force (replaced whole)."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier run in --out (the whole folder)."),
    source: opt.ModelSource = None,  # every model option (opt.MODEL_OPTIONS)
    device: opt.Device = "auto",
    profile_name: opt.ProfileName = None,
    graph: opt.Graph = None,
    dtype: opt.Dtype = None,
    method: opt.Method = None,
    flags: opt.MethodFlags = None,  # every method option (runtime.config.method_options)
    attention: opt.Attention = "auto",
    classes: opt.Classes = None,
    prompts: opt.Prompts = None,
    t5_path: opt.T5Path = None,
    prompt_length: opt.PromptLength = None,
    num_images: opt.NumImages = None,
    seed: opt.Seed = 0,
    batch_size: opt.BatchSize = None,
    profile: bool = typer.Option(False, "--profile", help="Write a torch.profiler trace (trace.json) beside the images."),
) -> None:
    """Generate images (default: the embedded demo with LANTERN++ sampling) into --out."""
    from runtime.generation.generator import ImageGenerator
    from runtime.generation.workload import check_num_images, read_prompt_file
    from runtime.utils.distributed import destroy, gather_objects, init_distributed, shard

    check_num_images(num_images)
    if not out.strip():
        raise UserError("--out is empty; give the output folder's path")
    out_dir = Path(out)
    check_run_folder(out_dir, force, marker="result.json")
    ctx = init_distributed(process_group_backend(device))
    try:
        gen = ImageGenerator.from_source(
            source, flags.as_dict(), device=device, profile=profile_name, dtype=dtype, graph=graph, method=method,
            attention=attention, batch_size=batch_size, t5_path=t5_path, prompt_length=prompt_length,
            device_index=ctx.device_index)
        work = gen.workload(prompts=read_prompt_file(prompts) if prompts is not None else None, classes=classes,
                            num_images=num_images)
        mine = shard(list(range(len(work))), ctx)
        staging = None
        if ctx.is_main:
            with writing(f"--out {out}"):
                staging = staging_folder(out_dir)
        try:
            trace = staging / "trace.json" if (profile and staging is not None) else None
            part = _generate_part(gen, work, mine, seed, ctx, trace)
            parts = gather_objects(part, ctx)
            if ctx.is_main:
                with writing(f"--out {out}"):
                    summary = _write_outputs(staging, parts, work.labels, gen, seed)
                    publish_folder(staging, out_dir)
                staging = None
                _print_summary(summary, out_dir)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
    finally:
        destroy(ctx)


def _generate_part(gen: ImageGenerator, work: Workload, mine: list[int], seed: int, ctx: Any,
                   trace: Path | None) -> dict[str, Any]:
    """This rank's share of the images (`mine`), as the record rank 0 gathers."""
    backend = gen.backend
    if not mine:  # more ranks than images: this rank has none, and says so in the gathered parts
        return _idle_part(ctx.rank, backend)
    backend.reset_peak_memory()
    with _progress(len(mine), gen.spec_for(min(gen.default_batch, len(mine))).method, enabled=ctx.is_main) as advance:
        result = _maybe_profiled(backend, trace, lambda: gen.run(work.select(mine), seed=seed, indices=mine,
                                                                 on_image=lambda j, t: advance()))
    return {"rank": ctx.rank, "indices": mine, "tokens": result.tokens.numpy(), "images": result.arrays,
            "seeds": result.seeds, "stats": result.stats, "total_s": result.timings["total_s"],
            "phases": result.timings["phases"], "memory": backend.memory_stats(), "device": backend.info(),
            "method": result.method, "batch_size": result.batch_size, "sources": result.sources}


def _idle_part(rank: int, backend: Backend) -> dict[str, Any]:
    """The gathered record of a rank that made no image."""
    stats = {"target_forwards": 0, "tokens": 0, "mean_accepted_length": 0.0, "per_depth_acceptance": [],
             "mean_relaxation_mass": 0.0, "mean_drafted_depth": 0.0}
    return {"rank": rank, "indices": [], "tokens": [], "images": [], "seeds": [], "stats": stats, "total_s": 0.0,
            "phases": {}, "memory": backend.memory_stats(), "device": backend.info()}


class _progress:
    """A rich progress bar over images (silent on non-zero ranks)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            transient=False)
        self.bar.__enter__()
        task = self.bar.add_task(f"{self.label}", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False


def _maybe_profiled(backend, trace: Path | None, fn):
    if trace is None:
        return fn()
    with backend.profiler(trace):
        return fn()


def _write_outputs(staging: Path, parts: list[dict[str, Any]], labels: list[Any], gen: ImageGenerator,
                   seed: int) -> dict[str, Any]:
    """Write images, grid, tokens and result.json into `staging`; returns the result record."""
    import numpy as np

    from runtime.utils.distributed import merge_indexed

    n = len(labels)
    done = [p for p in parts if p["indices"]]
    tokens = np.stack(merge_indexed([list(zip(p["indices"], p["tokens"])) for p in parts], n))
    images = np.stack(merge_indexed([list(zip(p["indices"], p["images"])) for p in parts], n))
    seeds = merge_indexed([list(zip(p["indices"], p["seeds"])) for p in parts], n)
    records = _write_images(staging, images, labels, seeds, gen.loaded.class_names)
    np.save(staging / "tokens.npy", tokens.astype(np.int64))
    result = _result_record(parts, gen, seed, n, batch=done[0]["batch_size"], sources=done[0]["sources"],
                            method=done[0]["method"])
    result["images"] = records
    (staging / "result.json").write_text(json.dumps(result, indent=2))
    return result


def _write_images(staging: Path, images: Any, labels: list[Any], seeds: list[int],
                  class_names: list[str] | None) -> list[dict[str, Any]]:
    """Each image as image_NNNN_cK.png (a class) or _p.png (a prompt), and the grid; their records."""
    from PIL import Image

    from runtime.generation.pipeline import image_grid

    records = []
    for i, label in enumerate(labels):
        tag = f"c{label}" if isinstance(label, int) else "p"
        name = f"image_{i:04d}_{tag}.png"
        Image.fromarray(images[i]).save(staging / name)
        record: dict[str, Any] = {"index": i, "file": name, "seed": seeds[i]}
        record["class" if isinstance(label, int) else "prompt"] = label
        if isinstance(label, int) and class_names is not None and label < len(class_names):
            record["class_name"] = class_names[label]
        records.append(record)
    Image.fromarray(image_grid(images)).save(staging / "grid.png")
    return records


def _result_record(parts: list[dict[str, Any]], gen: ImageGenerator, seed: int, n: int, *, batch: int,
                   sources: dict[str, str], method: str) -> dict[str, Any]:
    """result.json's fields but the images' (docs/cli.md: "runtime run"'s result file)."""
    from runtime.core.law import bound_warning
    from runtime.generation.workload import merge_stats

    loaded, backend = gen.loaded, gen.backend
    spec = gen.spec_for(batch)
    stats = merge_stats([p["stats"] for p in parts])
    total_s = max(p["total_s"] for p in parts)  # ranks run concurrently: wall time is the slowest
    device = dict(parts[0]["device"])
    device.update(backend=backend.name, count=len(parts) if len(parts) > 1 else device.get("count", 1))
    result = {
        "schema_version": RESULT_SCHEMA_VERSION, "software": software_record(), "method": method, "device": device,
        "model": {"name": loaded.name, "params": loaded.params, "tokens_per_image": loaded.config.block_size,
                  "image_size": loaded.image_size, "type": loaded.config.model_type, "family": loaded.family},
        "sampling": spec.describe(), "sampling_source": sources, "attention": gen.attention, "batch_size": batch,
        "num_images": n, "seed": seed, "stats": stats,
        "timing": {"total_s": total_s, "images_per_s": n / total_s if total_s > 0 else None,
                   "phases": _merge_phases([p["phases"] for p in parts]),
                   "graph": bool(backend.graph_mode), "dtype": str(backend.dtype).replace("torch.", "")},
        "memory": {"peak_bytes": max(p["memory"]["peak_bytes"] for p in parts)},
        "profile": gen.profile.to_dict(),
        "bound_warning": bound_warning(spec, stats["step_tvd"], stats["step_tvd_bound"], stats["law_steps"]),
    }
    if len(parts) > 1:
        result["ranks"] = [{"rank": p["rank"], "num_images": len(p["indices"]), "total_s": p["total_s"],
                            "images_per_s": len(p["indices"]) / p["total_s"] if p["total_s"] > 0 else None}
                           for p in parts]
    return result


def _merge_phases(all_phases: list[dict]) -> dict:
    merged: dict[str, dict[str, float]] = {}
    for phases in all_phases:
        for name, v in phases.items():
            m = merged.setdefault(name, {"seconds": 0.0, "count": 0})
            m["seconds"] = max(m["seconds"], v["seconds"]) if len(all_phases) > 1 else v["seconds"]
            m["count"] += v["count"]
    return merged


def _print_summary(result: dict, out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"runtime run -> {out_dir}")
    for col in ("method", "images", "tau", "target forwards", "seconds", "images/s"):
        table.add_column(col, justify="right" if col != "method" else "left")
    t = result["timing"]
    table.add_row(result["method"], str(result["num_images"]), f"{result['stats']['mean_accepted_length']:.2f}",
                  str(result["stats"]["target_forwards"]), f"{t['total_s']:.2f}",
                  f"{t['images_per_s']:.3f}" if t["images_per_s"] else "-")
    Console().print(table)
    if result.get("bound_warning"):
        print(f"warning: {result['bound_warning']}", file=sys.stderr)
