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
from typing import Annotated, Any, Optional

import typer

from runtime.cli import options as opt
from runtime.cli.app import app
from runtime.cli.run_cmd import run
from runtime.cli.workload import process_group_backend, software_record
from runtime.utils.atomic import writing
from runtime.utils.errors import UserError

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
    from runtime.generation.generator import ImageGenerator
    from runtime.generation.sample_store import plan
    from runtime.generation.source import ModelSource
    from runtime.generation.workload import SAMPLE_IMAGES, check_num_images
    from runtime.utils.distributed import barrier, destroy, init_distributed

    chunk_size, per_class = params["chunk"], params["per_class"]
    if chunk_size < 1:
        raise UserError(f"--chunk must be >= 1, got {chunk_size}")
    if per_class is not None and (per_class < 1 or params["num_images"] is not None):
        raise UserError("--per-class K (K >= 1) sets the image count; give it or --num-images, not both")
    check_num_images(params["num_images"], SAMPLE_IMAGES)
    shard = _parse_shard(params["shard"])
    _probe_out(params["out"])
    ctx = init_distributed(process_group_backend(params["device"]))
    try:
        if ctx.is_distributed and shard != (0, 1):
            raise UserError("--shard splits work between independent jobs; under torchrun the ranks already "
                            "split it: drop --shard")
        rank, world = (ctx.rank, ctx.world_size) if ctx.is_distributed else shard
        gen = ImageGenerator.from_source(
            ModelSource.pick(params), opt.MethodFlags.pick(params).as_dict(), device=params["device"],
            profile=params["profile_name"], dtype=params["dtype"], graph=params["graph"], method=params["method"],
            attention=params["attention"], batch_size=params["batch_size"], t5_path=params["t5_path"],
            prompt_length=params["prompt_length"], device_index=ctx.device_index)
        work = _workload(gen, params, per_class)
        chunks = plan(len(work), chunk_size)
        slots = min(gen.default_batch, chunk_size, len(work))  # one decoder for every chunk, the last included
        store, layout, record = _open_store(gen, work, params, chunks, gen.spec_for(slots), ctx)
        made, seconds = _make_chunks(gen, work, store, chunks, params, slots, (rank, world), ctx.is_main)
        barrier(ctx)
        if ctx.is_main:  # chunks other jobs or ranks wrote since; this process's own are known sound
            with writing(f"--out {params['out']}"):
                _verify(store, chunks, layout)
        missing = store.missing(chunks)
        if missing:
            print(f"sample: {len(chunks) - len(missing)} of {len(chunks)} chunks done in {store.root}; run the "
                  "remaining shards (or this command again without --shard) to finish and assemble")
            return
        if ctx.is_main:
            with writing(f"--out {params['out']}", then=RESUME):
                summary = store.assemble(chunks, list(work.labels))
                _write_result(store.root, summary, record, gen.spec_for(slots), gen.backend, made, seconds, world)
    finally:
        destroy(ctx)


def _workload(gen: Any, params: dict[str, Any], per_class: int | None) -> Any:
    """The images to make: --per-class K of every class, or run's --classes / --prompts / --num-images."""
    from runtime.generation.workload import SAMPLE_IMAGES, check_num_images, read_prompt_file

    num_images, classes = params["num_images"], params["classes"]
    if per_class is not None:
        if gen.loaded.config.model_type != "c2i":
            raise UserError("--per-class is for class-conditional models; give --num-images with --prompts")
        num_images = per_class * gen.loaded.num_classes
        check_num_images(num_images, SAMPLE_IMAGES)
        if classes is None:  # every class, not the demo subset `run` picks by default
            classes = ",".join(str(c) for c in range(gen.loaded.num_classes))
    prompts = read_prompt_file(params["prompts"]) if params["prompts"] is not None else None
    return gen.workload(prompts=prompts, classes=classes, num_images=num_images, limit=SAMPLE_IMAGES)


def _open_store(gen: Any, work: Any, params: dict[str, Any], chunks: list[Any], spec: Any,
                ctx: Any) -> tuple[Any, Any, Any]:
    """(the sample store, its chunk layout, the workload record that must match to resume), the
    store opened and its chunks checked by rank 0 (or each independent job)."""
    from runtime.generation.sample_store import ChunkLayout, SampleStore, conditions_digest
    from runtime.utils.distributed import barrier

    loaded = gen.loaded
    store = SampleStore(Path(params["out"]))
    layout = ChunkLayout((loaded.image_size, loaded.image_size, 3), int(loaded.config.block_size))
    record = {"model": loaded.name, "method": spec.describe(), "seed": params["seed"], "num_images": len(work),
              "chunk": params["chunk"], "conditions": conditions_digest(list(work.labels))}
    if ctx.is_main or not ctx.is_distributed:
        with writing(f"--out {params['out']}"):
            store.open(record)
            _verify(store, chunks, layout)
    barrier(ctx)
    return store, layout, record


def _make_chunks(gen: Any, work: Any, store: Any, chunks: list[Any], params: dict[str, Any], slots: int,
                 shard: tuple[int, int], shown: bool) -> tuple[int, float]:
    """Make this process's missing chunks, each written as it is done; (images made, seconds)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from runtime.generation.sample_store import mine

    rank, world = shard
    todo = store.missing(mine(chunks, rank, world))
    started, made = time.perf_counter(), 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, disable=not shown) as bar:
        task = bar.add_task(f"sample {gen.spec_for(slots).method} (rank {rank}/{world})",
                            total=sum(len(c) for c in todo))
        for c in todo:
            idx = list(range(c.start, c.stop))
            result = gen.run(work.select(idx), seed=params["seed"], indices=idx, slots=slots,
                             on_image=lambda j, t: bar.advance(task))
            with writing(f"--out {params['out']}", then=RESUME):
                store.write(c, result.arrays, result.tokens.numpy(), result.stats, result.timings["total_s"])
            made += len(c)
    return made, time.perf_counter() - started


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


def _write_result(root: Path, summary: dict[str, Any], workload: dict[str, Any], spec: Any, backend: Any,
                  made: int, seconds: float, world: int) -> None:
    from rich.console import Console

    from runtime.core.law import bound_warning
    from runtime.generation.workload import merge_stats
    from runtime.utils.atomic import atomic_write_text


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
