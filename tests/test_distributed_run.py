"""`torchrun --nproc-per-node 2 -m runtime run` (gloo) equals a single-process run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tiny_models import save_tiny_official


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_ckpt")
    save_tiny_official(d)
    return d


def run_args(d, out):
    return ["run", "--gpt-model", "GPT-tiny", "--gpt-ckpt", str(d / "gpt.pt"), "--vq-ckpt", str(d / "vq.pt"),
            "--image-size", "64", "--device", "cpu", "--method", "ar", "--num-images", "5", "--seed", "3",
            "--out", str(out)]


def test_two_gloo_ranks_equal_one_process(ckpts, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    single = tmp_path / "single"
    subprocess.run([sys.executable, "-m", "runtime", *run_args(ckpts, single)], check=True, env=env,
                   capture_output=True, timeout=600)
    multi = tmp_path / "multi"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "runtime", *run_args(ckpts, multi)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert np.array_equal(np.load(single / "tokens.npy"), np.load(multi / "tokens.npy"))
    result = json.loads((multi / "result.json").read_text())
    assert result["num_images"] == 5 and result["stats"]["tokens"] == 5 * 16
    assert [r["num_images"] for r in result["ranks"]] == [3, 2]
    assert all(r["images_per_s"] > 0 for r in result["ranks"]) and result["timing"]["images_per_s"] > 0
    assert result["device"]["count"] == 2
    assert sorted(p.name for p in multi.iterdir()) == sorted(p.name for p in single.iterdir())


def test_sample_under_two_gloo_ranks_equals_one_process(ckpts, tmp_path):
    """`runtime sample` under torchrun: each rank makes its chunks, rank 0 assembles the same file."""
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def args(out):
        return ["sample", *run_args(ckpts, out)[1:-2], "--chunk", "2", "--out", str(out)]

    single = tmp_path / "single"
    subprocess.run([sys.executable, "-m", "runtime", *args(single)], check=True, env=env, capture_output=True,
                   timeout=600)
    multi = tmp_path / "multi"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "runtime", *args(multi)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with np.load(single / "samples.npz") as a, np.load(multi / "samples.npz") as b:
        assert a["arr_0"].shape[0] == 5 and np.array_equal(a["arr_0"], b["arr_0"])
        assert np.array_equal(a["arr_1"], b["arr_1"])
    assert json.loads((multi / "result.json").read_text())["world_size"] == 2


def test_more_ranks_than_images_leaves_a_rank_idle_not_broken(ckpts, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = run_args(ckpts, tmp_path / "out")
    args[args.index("--num-images") + 1] = "2"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           "-m", "runtime", *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["num_images"] == 2 and [r["num_images"] for r in result["ranks"]] == [1, 1, 0]
    assert result["ranks"][2]["images_per_s"] is None
    assert np.load(tmp_path / "out" / "tokens.npy").shape == (2, 16)
