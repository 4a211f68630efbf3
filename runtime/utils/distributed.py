"""torch.distributed helpers for `torchrun -m runtime run/bench`: one process per device.

A launcher (`torchrun`, or `mpirun` on Gaudi) starts N processes and sets `RANK`, `WORLD_SIZE`,
`LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`. Each process calls `init_distributed(backend)`,
takes its share of the work with `shard`, and the results meet on rank 0 via `gather_objects`:

    ctx = init_distributed("cuda")                 # nccl, device cuda:LOCAL_RANK
    mine = shard(range(num_images), ctx)           # image indices this rank generates
    parts = gather_objects([(i, make(i)) for i in mine], ctx)
    if ctx.is_main:
        images = merge_indexed(parts)              # back in index order, completeness checked
    destroy(ctx)

Without a launcher (`WORLD_SIZE` unset or 1) no process group is created and every helper
degenerates to the single-process case, so the same code path runs everywhere. Because each
image's seed derives from the run seed and the image index (not from the rank), sharding does
not change any image's tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from runtime.utils.errors import UserError

T = TypeVar("T")

# Device backend -> torch.distributed process-group backend.
PROCESS_GROUP_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}
SHARD_MODES = ("round_robin", "contiguous")
_LAUNCH_HINT = "launch with `torchrun --nproc-per-node N -m runtime ...`"


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job.

    `rank` in [0, world_size); `local_rank` is the rank on this host (it picks the GPU);
    `process_group` is the torch.distributed backend name, or None when running alone;
    `device` is where this rank computes (`cuda:LOCAL_RANK`, `hpu`, `cpu`).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend_name: str = "cpu"
    process_group: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that gathers results and writes files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.process_group is not None

    @property
    def device_index(self) -> int | None:
        """The index to hand to `backends.get_backend(index=...)`: the local rank on CUDA; None
        elsewhere (a Gaudi process sees its card as hpu:0, chosen by HLS_MODULE_ID)."""
        return self.device.index if self.device.type == "cuda" else None


def _env_int(environ: Mapping[str, str], name: str, default: int | None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise UserError(f"{name} is not set although WORLD_SIZE is; {_LAUNCH_HINT}")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{name}={raw!r} is not an integer; {_LAUNCH_HINT}") from None


def ranks_from_env(environ: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's variables; (0, 1, 0) without one."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return 0, 1, 0
    world = _env_int(env, "WORLD_SIZE", None)
    rank = _env_int(env, "RANK", None)
    local = _env_int(env, "LOCAL_RANK", rank)
    if world < 1:
        raise UserError(f"WORLD_SIZE={world} must be >= 1; {_LAUNCH_HINT}")
    if not 0 <= rank < world:
        raise UserError(f"RANK={rank} is outside [0, WORLD_SIZE={world}); {_LAUNCH_HINT}")
    if not 0 <= local < world:
        raise UserError(f"LOCAL_RANK={local} is outside [0, WORLD_SIZE={world}); {_LAUNCH_HINT}")
    return rank, world, local


def _import_hccl() -> None:
    """Register the `hccl` process-group backend (Gaudi containers only).

    The import also maps mpirun's OMPI_COMM_WORLD_* variables to RANK/WORLD_SIZE/LOCAL_RANK and
    picks the card (HLS_MODULE_ID), so it must precede reading the ranks.
    """
    # Same default as backends.hpu: the bridge fixes its mode at first import, and HPU graphs
    # need lazy mode. An explicit PT_HPU_LAZY_MODE (the Gaudi image sets one) wins.
    os.environ.setdefault("PT_HPU_LAZY_MODE", "1")
    try:
        import habana_frameworks.torch.distributed.hccl  # type: ignore[import-not-found]  # noqa: F401
    except ImportError as err:
        raise UserError(
            f"--device hpu needs habana_frameworks ({err}); run inside the Gaudi container (docker/Dockerfile.hpu)"
        ) from None


def _rank_device(backend_name: str, local_rank: int) -> torch.device:
    if backend_name == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local_rank >= count:
            raise UserError(
                f"LOCAL_RANK {local_rank} needs cuda:{local_rank} but {count} CUDA device(s) are visible; "
                f"use --nproc-per-node <= {count}"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if backend_name == "hpu":
        return torch.device("hpu")
    return torch.device("cpu")


def init_distributed(backend_name: str, environ: Mapping[str, str] | None = None) -> DistContext:
    """Join the launcher's process group (gloo / nccl / hccl for cpu / cuda / hpu) and pick this
    rank's device. Without a launcher returns a single-process context and creates no group.

    Idempotent: if a process group already exists it is reused.
    """
    if backend_name not in PROCESS_GROUP_BACKENDS:
        raise UserError(f"unknown device backend {backend_name!r}; use one of {', '.join(PROCESS_GROUP_BACKENDS)}")
    env = os.environ if environ is None else environ
    if backend_name == "hpu" and ("WORLD_SIZE" in env or "OMPI_COMM_WORLD_SIZE" in env):
        _import_hccl()
    rank, world, local = ranks_from_env(env)
    device = _rank_device(backend_name, local)
    if world == 1:
        return DistContext(backend_name=backend_name, device=device)
    process_group = PROCESS_GROUP_BACKENDS[backend_name]
    if not dist.is_initialized():
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
        if missing:
            raise UserError(f"{' and '.join(missing)} not set for WORLD_SIZE={world}; {_LAUNCH_HINT}")
        dist.init_process_group(backend=process_group, init_method="env://", rank=rank, world_size=world)
    return DistContext(
        rank=rank,
        world_size=world,
        local_rank=local,
        backend_name=backend_name,
        process_group=process_group,
        device=device,
    )


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous block; the first `n % world_size` ranks get one more."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard(items: Iterable[T], ctx: DistContext, mode: str = "round_robin") -> list[T]:
    """This rank's share of `items`, deterministic and disjoint across ranks, covering all items.

    `round_robin`: items[rank::world_size] (balances cost when later items are heavier).
    `contiguous`: one block per rank, sizes differing by at most one.
    """
    values = list(items)
    if mode == "round_robin":
        return values[ctx.rank :: ctx.world_size]
    if mode == "contiguous":
        start, stop = shard_bounds(len(values), ctx.rank, ctx.world_size)
        return values[start:stop]
    raise UserError(f"unknown shard mode {mode!r}; use one of {', '.join(SHARD_MODES)}")


def gather_objects(obj: Any, ctx: DistContext) -> list[Any] | None:
    """Every rank's `obj` (picklable), in rank order, on rank 0; None on the other ranks.

    Collective: every rank must call it. gloo and nccl use `gather_object`; hccl has no gather,
    so it uses `all_gather_object` and drops the copies on ranks > 0.
    """
    if not ctx.is_distributed:
        return [obj]
    gathered: list[Any] = [None] * ctx.world_size
    if ctx.process_group == "hccl":
        dist.all_gather_object(gathered, obj)
        return gathered if ctx.is_main else None
    dist.gather_object(obj, gathered if ctx.is_main else None, dst=0)
    return gathered if ctx.is_main else None


def merge_indexed(parts: Sequence[Sequence[tuple[int, T]]], total: int | None = None) -> list[T]:
    """Flatten per-rank `(index, value)` lists into values ordered by index.

    Raises ValueError when an index repeats or, with `total`, when indices are not exactly
    0..total-1 (a rank lost or duplicated work).
    """
    pairs = sorted((pair for part in parts for pair in part), key=lambda pair: pair[0])
    indices = [i for i, _ in pairs]
    if len(set(indices)) != len(indices):
        raise ValueError(f"duplicate indices across ranks: {indices}")
    if total is not None and indices != list(range(total)):
        raise ValueError(f"expected indices 0..{total - 1}, got {indices}")
    return [value for _, value in pairs]


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (no-op when running alone)."""
    if not ctx.is_distributed:
        return
    if ctx.process_group == "nccl":
        dist.barrier(device_ids=[ctx.local_rank])
    else:
        dist.barrier()


def destroy(ctx: DistContext) -> None:
    """Leave the process group (no-op when running alone or already destroyed)."""
    if ctx.is_distributed and dist.is_initialized():
        dist.destroy_process_group()
