"""`runtime run` with official-layout checkpoints: outputs, result.json, and clean refusals."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny_models import save_tiny_official


@pytest.fixture(scope="module")
def official_ckpts(tmp_path_factory):
    """GPT-tiny (4x4 tokens at 64 px) and VQ-16, saved as LlamaGen saves them ({"model": sd})."""
    d = tmp_path_factory.mktemp("ckpt")
    save_tiny_official(d, "c2i_tiny.pt", "vq_ds16_c2i.pt", steps=1)
    return d


def base_args(ckpts: Path, out: Path) -> list[str]:
    return ["run", "--gpt-model", "GPT-tiny", "--gpt-ckpt", str(ckpts / "c2i_tiny.pt"), "--vq-ckpt",
            str(ckpts / "vq_ds16_c2i.pt"), "--image-size", "64", "--device", "cpu", "--out", str(out)]


def test_run_writes_images_tokens_and_result(official_ckpts, tmp_path, run_cli):
    out = tmp_path / "out"
    res = run_cli(*base_args(official_ckpts, out), "--method", "ar", "--classes", "3,7", "--num-images", "3",
                  "--seed", "5")
    assert res.exit_code == 0, res.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["grid.png", "image_0000_c3.png", "image_0001_c7.png", "image_0002_c3.png",
                     "result.json", "tokens.npy"]
    tokens = np.load(out / "tokens.npy")
    assert tokens.shape == (3, 16) and tokens.dtype == np.int64
    result = json.loads((out / "result.json").read_text())
    for key in ("schema_version", "method", "device", "model", "sampling", "num_images", "seed", "stats", "timing"):
        assert key in result
    assert result["device"]["backend"] == "cpu" and result["model"]["tokens_per_image"] == 16
    assert result["stats"]["target_forwards"] == 3 * 16 and result["stats"]["tokens"] == 48
    phases = result["timing"]["phases"]
    assert {"prefill", "verify", "accept", "decode"} <= set(phases)
    total = sum(p["seconds"] for p in phases.values())
    assert abs(total - result["timing"]["total_s"]) <= 0.05 * result["timing"]["total_s"] + 0.01
    assert result["memory"]["peak_bytes"] > 0
    assert [r["class"] for r in result["images"]] == [3, 7, 3]
    from PIL import Image
    assert Image.open(out / "image_0000_c3.png").size == (64, 64)
    assert "tau" in res.stdout and "images/s" in res.stdout

    # image i depends only on (seed, i): a run of image 0..1 reproduces the first two
    again = tmp_path / "again"
    assert run_cli(*base_args(official_ckpts, again), "--method", "ar", "--classes", "3,7", "--seed", "5").exit_code == 0
    assert np.array_equal(np.load(again / "tokens.npy"), tokens[:2])
    # ... and so does a batch of two images per decode (the last batch padded)
    batched = tmp_path / "batched"
    assert run_cli(*base_args(official_ckpts, batched), "--method", "ar", "--classes", "3,7", "--num-images", "3",
                   "--seed", "5", "--batch-size", "2").exit_code == 0
    assert np.array_equal(np.load(batched / "tokens.npy"), tokens)
    assert json.loads((batched / "result.json").read_text())["batch_size"] == 2
    assert result["batch_size"] == 1


@pytest.mark.parametrize("extra, message", [
    (["--classes", "0,1200"], "class 1200 is out of range"),
    (["--num-images", "-1"], "--num-images must be >= 1"),
    (["--method", "medusa"], "unknown method 'medusa'"),
    (["--method", "lantern++", "--tree", "nope"], "unknown tree 'nope'"),
    (["--method", "sd"], "needs a drafter"),
    (["--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
    (["--cfg", "1", "--cfg-interval", "3"], "--cfg-interval 3 does nothing without classifier-free guidance"),
    (["--cfg-interval", "-2"], "--cfg-interval must be an integer >= -1, got -2"),
    (["--attention", "flash"], "--attention 'flash' is not a kernel setting; choose auto or math"),
    (["--image-size", "100"], "--image-size 100 is not a positive multiple of 16"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
])
def test_bad_arguments_are_refused_before_anything_is_written(official_ckpts, tmp_path, run_cli, extra, message):
    out = tmp_path / "out"
    res = run_cli(*base_args(official_ckpts, out), *extra)
    assert res.exit_code == 2
    assert message in res.stderr and res.stderr.count("\n") == 1
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging left behind


def test_result_records_each_sampling_setting_its_source_and_the_attention_kernel(official_ckpts, tmp_path, run_cli):
    out = tmp_path / "out"
    res = run_cli(*base_args(official_ckpts, out), "--method", "ar", "--num-images", "1", "--top-p", "0.9",
                  "--cfg-interval", "4", "--attention", "math")
    assert res.exit_code == 0, res.stderr
    result = json.loads((out / "result.json").read_text())
    sampling = result["sampling"]
    # LlamaGen's sample_c2i.py defaults fill what neither a flag nor the cpu profile sets
    assert (sampling["cfg"], sampling["top_k"], sampling["temperature"]) == (4.0, 2000, 1.0)
    assert (sampling["top_p"], sampling["cfg_interval"], sampling["greedy"]) == (0.9, 4, False)
    llamagen = "model default (LlamaGen sample_c2i.py)"
    assert result["sampling_source"] == {"greedy": "default", "temperature": llamagen, "top_k": llamagen,
                                         "top_p": "flag (--top-p)", "cfg": llamagen,
                                         "cfg_interval": "flag (--cfg-interval)"}
    assert result["attention"] == "math"


def test_missing_checkpoint_and_unavailable_devices_are_one_line(official_ckpts, tmp_path, run_cli):
    res = run_cli("run", "--gpt-model", "GPT-B", "--gpt-ckpt", str(tmp_path / "nope.pt"), "--vq-ckpt",
                  str(official_ckpts / "vq_ds16_c2i.pt"), "--device", "cpu", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "checkpoint not found" in res.stderr and res.stderr.count("\n") == 1
    for device in ("cuda", "hpu"):
        if device == "cuda" and torch.cuda.is_available():
            continue
        res = run_cli(*base_args(official_ckpts, tmp_path / "o"), "--device", device)
        assert res.exit_code == 2 and f"{device} is not available" in res.stderr
        assert res.stderr.count("\n") == 1


def test_profile_flag_writes_a_chrome_trace(official_ckpts, tmp_path, run_cli):
    out = tmp_path / "out"
    res = run_cli(*base_args(official_ckpts, out), "--method", "ar", "--num-images", "1", "--profile")
    assert res.exit_code == 0, res.stderr
    trace = json.loads((out / "trace.json").read_text())
    assert trace["traceEvents"]


def test_sjd_runs_an_official_checkpoint_without_a_drafter(official_ckpts, tmp_path, run_cli):
    """Training-free drafting: --gpt-ckpt with no --drafter; greedy tokens equal AR's (sjd, and
    pjd at batch 2)."""
    ar, sjd, pjd = tmp_path / "ar", tmp_path / "sjd", tmp_path / "pjd"
    common = ("--greedy", "--classes", "3,7", "--cfg", "2.0")
    assert run_cli(*base_args(official_ckpts, ar), "--method", "ar", *common).exit_code == 0
    res = run_cli(*base_args(official_ckpts, sjd), "--method", "sjd", "--window", "6", *common)
    assert res.exit_code == 0, res.stderr
    assert np.array_equal(np.load(ar / "tokens.npy"), np.load(sjd / "tokens.npy"))
    res = run_cli(*base_args(official_ckpts, pjd), "--method", "pjd", "--pjd-rows", "3", "--batch-size", "2", *common)
    assert res.exit_code == 0, res.stderr
    assert np.array_equal(np.load(ar / "tokens.npy"), np.load(pjd / "tokens.npy"))
    result = json.loads((sjd / "result.json").read_text())
    assert result["method"] == "sjd" and result["sampling"]["window"] == 6
    # the published pjd loop: one row in flight is AR; several rows, captured, at batch 2, commit ahead
    one = tmp_path / "pjd1"
    res = run_cli(*base_args(official_ckpts, one), "--method", "pjd", "--accept", "published", "--pjd-rows", "1", *common)
    assert res.exit_code == 0, res.stderr
    assert np.array_equal(np.load(ar / "tokens.npy"), np.load(one / "tokens.npy"))
    rows = tmp_path / "pjd3"
    res = run_cli(*base_args(official_ckpts, rows), "--method", "pjd", "--accept", "published", "--pjd-rows", "3",
                  "--pjd-window", "3", "--graph", "--batch-size", "2", *common)
    assert res.exit_code == 0, res.stderr
    result = json.loads((rows / "result.json").read_text())
    assert result["sampling"]["accept"] == "published" and result["sampling"]["pjd_rows"] == 3
    assert np.load(rows / "tokens.npy").shape == np.load(ar / "tokens.npy").shape
    res = run_cli(*base_args(official_ckpts, tmp_path / "x"), "--method", "lantern++")
    assert res.exit_code != 0 and "--method sjd (no drafter needed)" in res.stderr
