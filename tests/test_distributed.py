"""torch.distributed helpers: rank parsing, deterministic sharding, and a real 2-rank gloo job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from runtime.utils.distributed import (
    DistContext,
    gather_objects,
    init_distributed,
    merge_indexed,
    ranks_from_env,
    shard,
    shard_bounds,
)
from runtime.utils.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def ctx(rank: int, world: int) -> DistContext:
    return DistContext(rank=rank, world_size=world, local_rank=rank, process_group="gloo" if world > 1 else None)


def test_no_launcher_means_one_process_and_no_group() -> None:
    assert ranks_from_env({}) == (0, 1, 0)
    single = init_distributed("cpu", environ={})
    assert (single.rank, single.world_size, single.is_distributed, single.is_main) == (0, 1, False, True)
    assert single.device == torch.device("cpu")
    assert gather_objects({"x": 1}, single) == [{"x": 1}]


def test_ranks_come_from_the_launcher_variables() -> None:
    assert ranks_from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == (3, 4, 1)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2"}, "RANK is not set although WORLD_SIZE is"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is outside [0, WORLD_SIZE=2)"),
        ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "MASTER_ADDR and MASTER_PORT not set"),
    ],
)
def test_bad_launcher_environment_is_one_line(environ: dict[str, str], message: str) -> None:
    with pytest.raises(UserError, match=None) as err:
        init_distributed("cpu", environ=environ)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_backend_and_missing_gpu_are_user_errors() -> None:
    with pytest.raises(UserError, match="unknown device backend 'tpu'"):
        init_distributed("tpu", environ={})
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="0 CUDA device"):
            init_distributed("cuda", environ={"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"})


@pytest.mark.parametrize("mode", ["round_robin", "contiguous"])
@pytest.mark.parametrize(("n", "world"), [(5, 2), (7, 3), (2, 4), (0, 2)])
def test_shards_are_disjoint_cover_everything_and_balanced(mode: str, n: int, world: int) -> None:
    parts = [shard(range(n), ctx(rank, world), mode) for rank in range(world)]
    assert sorted(i for part in parts for i in part) == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts == [shard(range(n), ctx(rank, world), mode) for rank in range(world)]  # deterministic


def test_shard_layouts() -> None:
    assert [shard(range(5), ctx(r, 2)) for r in range(2)] == [[0, 2, 4], [1, 3]]
    assert [shard(range(5), ctx(r, 2), "contiguous") for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [shard_bounds(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(UserError, match="unknown shard mode 'striped'"):
        shard(range(3), ctx(0, 1), "striped")


def test_merge_indexed_restores_order_and_detects_lost_work() -> None:
    assert merge_indexed([[(0, "a"), (2, "c")], [(1, "b")]], total=3) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="expected indices 0..2"):
        merge_indexed([[(0, "a")], [(2, "c")]], total=3)
    with pytest.raises(ValueError, match="duplicate"):
        merge_indexed([[(0, "a")], [(0, "a")]])


WORKER = textwrap.dedent(
    """
    import json, sys
    from runtime.utils.distributed import barrier, destroy, gather_objects, init_distributed, merge_indexed, shard

    ctx = init_distributed("cpu")
    mine = shard(range(5), ctx)
    parts = gather_objects([(i, {"square": i * i, "rank": ctx.rank}) for i in mine], ctx)
    if ctx.is_main:
        merged = merge_indexed(parts, total=5)
        record = {"world": ctx.world_size, "group": ctx.process_group, "parts": parts, "merged": merged}
        with open(sys.argv[1], "w") as f:
            json.dump(record, f)
    else:
        assert parts is None
    barrier(ctx)
    destroy(ctx)
    """
)


def test_two_gloo_ranks_shard_five_items_and_gather_on_rank_0(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "gathered.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["world"] == 2 and record["group"] == "gloo"
    # rank 0 holds items 0, 2, 4 and rank 1 holds 1, 3, in rank order
    assert [[pair[0] for pair in part] for part in record["parts"]] == [[0, 2, 4], [1, 3]]
    assert record["merged"] == [{"square": i * i, "rank": i % 2} for i in range(5)]


@pytest.mark.parametrize("argv, code, stream, text", [
    (["--version"], 0, "stdout", "lantern-runtime"),
    (["run", "--device", "cpu", "--num-images", "1", "--out", "o"], 2, "stderr",
     "error: MASTER_ADDR and MASTER_PORT not set"),
])
def test_under_a_launcher_the_process_exits_with_the_commands_code_and_its_output(
        tmp_path: Path, argv: list[str], code: int, stream: str, text: str) -> None:
    """`python -m runtime` under WORLD_SIZE > 1 leaves by os._exit (runtime/__main__.py): the
    command's exit code and its flushed output still come through."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "runtime", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert text in getattr(proc, stream)
    assert "Traceback" not in proc.stderr
