"""`runtime sample`: generate N images at scale into ADM's `.npz` layout, sharded and resumable.

Takes every model and method option of `runtime run` (the same declarations, read from `run`'s
signature) plus the chunking options; see `runtime.generation.sample_store` for the folder it keeps.
Under `torchrun` each rank makes its share of the chunks on its own device and rank 0 assembles
the result; `--shard I/N` splits the chunks across independent jobs instead. Running the same
command again finishes whatever is missing and then assembles.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from runtime.cli import options as opt
from runtime.cli.app import app
from runtime.cli.run_cmd import run
from runtime.cli.workload import merge_stats, process_group_backend, select, software_record, workload_conditions
from runtime.utils.errors import UserError

if TYPE_CHECKING:
    from backends import Backend


NOT_FROM_RUN = ("out", "force", "profile")  # run's own output options; sample has its own
RESUME = "then run the same command again: it keeps the chunks already written"

Out = Annotated[str, typer.Option("--out", help="Sampling folder: new or empty, or an earlier sampling run "
                                  "with the same settings to resume.")]
Chunk = Annotated[int, typer.Option("--chunk", help="Images per chunk: the unit written, resumed and shared "
                                    "between ranks.")]
Shard = Annotated[Optional[str], typer.Option("--shard", help="I/N: make only chunks c with c % N == I (independent "
                                              "jobs; under torchrun the ranks split the chunks themselves).")]
PerClass = Annotated[Optional[int], typer.Option("--per-class", help="Class-conditional: K images of every class "
                                                 "(ADM's FID-50k: 50 per class of 1000), classes cycled.")]


def sample(**params: Any) -> None:
    """Generate many images into ADM's .npz layout (arr_0 images, arr_1 labels), sharded and resumable."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from runtime.utils.atomic import writing
    from runtime.utils.distributed import barrier, destroy, init_distributed
    from runtime.generation.pipeline import make_decoder, run_generation
    from runtime.generation.settings import resolve_spec
    from runtime.generation.sample_store import ChunkLayout, SampleStore, conditions_digest, mine, plan

    flags = opt.MethodFlags.pick(params)
    chunk_size, per_class = params["chunk"], params["per_class"]
    if chunk_size < 1:
        raise UserError(f"--chunk must be >= 1, got {chunk_size}")
    if per_class is not None and (per_class < 1 or params["num_images"] is not None):
        raise UserError("--per-class K (K >= 1) sets the image count; give it or --num-images, not both")
    opt.check_num_images(params["num_images"], opt.SAMPLE_IMAGES)
    shard = _parse_shard(params["shard"])
    out = params["out"]
    _probe_out(out)
    ctx = init_distributed(process_group_backend(params["device"]))
    try:
        if ctx.is_distributed and shard != (0, 1):
            raise UserError("--shard splits work between independent jobs; under torchrun the ranks already "
                            "split it: drop --shard")
        rank, world = (ctx.rank, ctx.world_size) if ctx.is_distributed else shard
        backend, prof = opt.open_backend(params["device"], params["profile_name"], params["graph"],
                                         params["dtype"], index=ctx.device_index)
        loaded = opt.ModelSource.pick(params).load(backend)
        spec = resolve_spec(params["method"], flags.as_dict(), prof, loaded.recommended)
        num_images, classes = params["num_images"], params["classes"]
        if per_class is not None:
            if loaded.config.model_type != "c2i":
                raise UserError("--per-class is for class-conditional models; give --num-images with --prompts")
            num_images = per_class * loaded.num_classes
            opt.check_num_images(num_images, opt.SAMPLE_IMAGES)
            if classes is None:  # every class, not the demo subset `run` picks by default
                classes = ",".join(str(c) for c in range(loaded.num_classes))
        conditions, cond_masks, labels = workload_conditions(loaded, classes, params["prompts"], params["t5_path"],
                                                     num_images, backend)
        chunks = plan(len(labels), chunk_size)
        store = SampleStore(Path(out))
        layout = ChunkLayout((loaded.image_size, loaded.image_size, 3), int(loaded.config.block_size))
        workload = {"model": loaded.name, "method": spec.describe(), "seed": params["seed"],
                    "num_images": len(labels), "chunk": chunk_size, "conditions": conditions_digest(list(labels))}
        if ctx.is_main or not ctx.is_distributed:
            with writing(f"--out {out}"):
                store.open(workload)
                _verify(store, chunks, layout)
        barrier(ctx)
        todo = store.missing(mine(chunks, rank, world))
        batch = min(opt.batch_size(params["batch_size"], prof), chunk_size, len(labels))
        decoder = make_decoder(loaded, spec, backend, batch_size=batch)
        started, made = time.perf_counter(), 0
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn())
        with Progress(*columns, disable=not ctx.is_main) as bar:
            task = bar.add_task(f"sample {spec.method} (rank {rank}/{world})", total=sum(len(c) for c in todo))
            for c in todo:
                idx = list(range(c.start, c.stop))
                masks = cond_masks[idx] if cond_masks is not None else None
                result = run_generation(loaded, spec, select(conditions, idx), seed=params["seed"], backend=backend,
                                        indices=idx, cond_masks=masks, decoder=decoder,
                                        on_image=lambda j, t: bar.advance(task))
                with writing(f"--out {out}", then=RESUME):
                    store.write(c, result.images, result.tokens.numpy(), result.stats, result.total_s)
                made += len(c)
        seconds = time.perf_counter() - started
        barrier(ctx)
        if ctx.is_main:  # chunks other jobs or ranks wrote since; this process's own are known sound
            with writing(f"--out {out}"):
                _verify(store, chunks, layout)
        missing = store.missing(chunks)
        if missing:
            print(f"sample: {len(chunks) - len(missing)} of {len(chunks)} chunks done in {store.root}; run the "
                  "remaining shards (or this command again without --shard) to finish and assemble")
            return
        if ctx.is_main:
            with writing(f"--out {out}", then=RESUME):
                summary = store.assemble(chunks, list(labels))
                _write_result(store.root, summary, workload, spec, backend, made, seconds, world)
    finally:
        destroy(ctx)


def _probe_out(text: str) -> None:
    """Before the model loads: --out must be a folder path under which this process can write."""
    from runtime.utils.atomic import probe_writable

    if not text.strip():  # Path("") would be the current folder
        raise UserError("--out is empty; give the sampling folder's path")
    out = Path(text)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder; choose a folder path")
    probe_writable(out / "manifest.json", f"--out {out}")


def _verify(store: Any, chunks: list[Any], layout: Any) -> None:
    """Check the chunks on disk; name each damaged one (moved aside, made again) in one line."""
    for bad in store.verify(chunks, layout):
        print(f"warning: {store.path(bad.chunk).relative_to(store.root)} is damaged ({bad.reason}); moved to "
              f"{bad.moved_to.relative_to(store.root)} and made again", file=sys.stderr)


def _parse_shard(text: str | None) -> tuple[int, int]:
    if text is None:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard {text}: expected I/N, e.g. 0/4") from None
    if not 0 <= i < n:
        raise UserError(f"--shard {text}: need 0 <= I < N")
    return i, n


def _write_result(root: Path, summary: dict[str, Any], workload: dict[str, Any], spec: Any, backend: Backend,
                  made: int, seconds: float, world: int) -> None:
    from rich.console import Console

    from runtime.utils.atomic import atomic_write_text
    from runtime.core.law import bound_warning

    chunks = summary["chunks"]
    chunk_seconds = sum(c["seconds"] for c in chunks)
    result = {
        "schema_version": 1, "kind": "sample", "software": software_record(), "workload": workload,
        "method": spec.method,
        "device": backend.info(), "world_size": world,
        "stats": merge_stats([c["stats"] for c in chunks]),
        # generation time summed over chunks (ranks overlap in wall time; per device it is this)
        "timing": {"chunk_seconds": chunk_seconds,
                   "images_per_s_per_device": workload["num_images"] / chunk_seconds if chunk_seconds else None,
                   "this_invocation": {"images": made, "seconds": seconds}},
        "files": {"samples": "samples.npz", "tokens": "tokens.npy"},
    }
    stats = result["stats"]
    result["bound_warning"] = bound_warning(spec, stats["step_tvd"], stats["step_tvd_bound"], stats["law_steps"])
    atomic_write_text(root / "result.json", json.dumps(result, indent=2))
    rate = result["timing"]["images_per_s_per_device"]
    Console().print(f"sample: {workload['num_images']} images in {root / 'samples.npz'} (tau "
                    f"{result['stats']['mean_accepted_length']:.2f}, {rate:.3f} images/s per device)")
    if result["bound_warning"]:
        print(f"warning: {result['bound_warning']}", file=sys.stderr)


def _declare() -> None:
    """Register `sample` with run's model / method / device options and its own."""
    hints = typing.get_type_hints(run, include_extras=True)
    base = [p.replace(annotation=hints[p.name]) for p in inspect.signature(run).parameters.values()
            if p.name not in NOT_FROM_RUN]
    own = [inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, annotation=Out),
           inspect.Parameter("chunk", inspect.Parameter.KEYWORD_ONLY, annotation=Chunk, default=1000),
           inspect.Parameter("shard", inspect.Parameter.KEYWORD_ONLY, annotation=Shard, default=None),
           inspect.Parameter("per_class", inspect.Parameter.KEYWORD_ONLY, annotation=PerClass, default=None)]
    params = own + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in base]
    sample.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    sample.__annotations__ = {p.name: p.annotation for p in params}
    app.command("sample")(sample)


_declare()
