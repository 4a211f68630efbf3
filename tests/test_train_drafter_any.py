"""`runtime train drafter --gpt-ckpt`: a drafter for any c2i LlamaGen checkpoint (issue 19, item 3).

The target is a tiny LlamaGen (8x8 tokens, 512 codes) in the HF LlamaGen folder format with a sharp
random head, so its greedy choices are a fixed function of the context a drafter can learn.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.training import drafter_training as dt
from runtime.models.configs import VQ_CONFIGS, DrafterConfig, gpt_config
from runtime.models.drafter import Drafter
from runtime.models.gpt import Transformer
from runtime.models.loading import (build_drafter, build_gpt, hf_config_from_gpt, official_to_hf_llamagen,
                                    write_json, write_safetensors)
from runtime.models.vq import VQModel


def _tiny_target(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    gpt = Transformer(gpt_config("GPT-tiny", image_size=128, vocab_size=512))
    gpt.init_weights()
    torch.nn.init.normal_(gpt.output.weight, std=0.5)
    return gpt.eval()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("target") / "LlamaGen-tiny-c2i"
    folder.mkdir()
    gpt = _tiny_target()
    write_json(folder / "config.json", hf_config_from_gpt(gpt.config))
    write_safetensors(folder / "model.safetensors", official_to_hf_llamagen(gpt.state_dict()))
    torch.save({"model": VQModel(VQ_CONFIGS["VQ-16"]).state_dict()}, folder.parent / "vq_ds16_c2i.pt")
    return folder


def _train(run_cli, target_dir: Path, out: Path, *extra: str):
    return run_cli("train", "drafter", "--gpt-ckpt", str(target_dir), "--device", "cpu", "--out", str(out),
                   "--threads", "1", *extra)


@pytest.mark.slow
def test_a_trained_drafter_lifts_greedy_tau_above_1_3_and_runs_lantern_pp(run_cli, target_dir, tmp_path) -> None:
    out = tmp_path / "drafter"
    # the data is made as the drafter is then used: greedy-like (no top-k), no guidance
    res = _train(run_cli, target_dir, out, "--num-images", "128", "--data-cfg", "1", "--data-top-k", "0",
                 "--steps", "300", "--lr", "3e-3", "--eval-images", "4")
    assert res.exit_code == 0, res.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["metrics"]["greedy_tau_sd_depth4"] > 1.3
    assert manifest["metrics"]["held_out_top3"] >= manifest["metrics"]["held_out_top1"] > 0.2
    assert manifest["data"]["source"] == "sampled" and manifest["data"]["images"] == 128
    assert manifest["command"].startswith("runtime train drafter --gpt-ckpt ")
    assert {"config.json", "model.safetensors", "manifest.json", "checkpoint.pt", "data"} <= {
        p.name for p in out.iterdir()}
    # the folder is what --drafter loads; an untrained drafter of the same shape gets nothing accepted
    target = build_gpt(None, target_dir)
    trained = build_drafter(out, target.config)
    classes = [0, 1, 2, 3]
    torch.manual_seed(1)
    fresh = Drafter(DrafterConfig.for_target(target.config)).eval()
    assert dt.greedy_tau(target, fresh, classes) < 1.1 < 1.3 < dt.greedy_tau(target, trained, classes)
    run = run_cli("run", "--gpt-ckpt", str(target_dir), "--vq-ckpt", str(target_dir.parent / "vq_ds16_c2i.pt"),
                  "--drafter", str(out), "--method", "lantern++", "--tree", "chain4", "--greedy", "--cfg", "1",
                  "--device", "cpu", "--num-images", "2", "--out", str(tmp_path / "images"))
    assert run.exit_code == 0, run.stderr
    assert json.loads((tmp_path / "images" / "result.json").read_text())["stats"]["mean_accepted_length"] > 1.3


def test_an_interrupted_run_resumes_to_the_same_weights(target_dir, tmp_path) -> None:
    target = build_gpt(None, target_dir)
    data = tmp_path / "data"
    dt.distill(target, data, [0, 1, 2, 3, 4, 0, 1, 2], dt.DistillSettings(top_k=0, cfg=1.0, shard_images=3))
    settings = dt.TrainSettings(steps=8, batch=4, lr=3e-3, checkpoint_every=2)

    def fresh() -> Drafter:
        torch.manual_seed(5)
        return Drafter(DrafterConfig.for_target(target.config))

    straight = fresh()
    dt.train(straight, target, data, tmp_path / "a", settings)

    def stop_at_5(stage: str, done: int, total: int, info: dict) -> None:
        if done == 5:
            raise KeyboardInterrupt

    cut = fresh()
    with pytest.raises(KeyboardInterrupt):
        dt.train(cut, target, data, tmp_path / "b", settings, progress=stop_at_5)
    resumed = fresh()
    result = dt.train(resumed, target, data, tmp_path / "b", settings, resume=True)
    assert result["resumed_from"] == 4  # the last checkpoint before the interruption
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def test_distilled_shards_hold_tokens_labels_and_hidden_states(target_dir, tmp_path) -> None:
    from safetensors.torch import load_file

    target = build_gpt(None, target_dir)
    index = dt.distill(target, tmp_path / "d", [1, 2, 3, 4, 0], dt.DistillSettings(shard_images=2, null_share=0.0))
    assert [s["images"] for s in index["shards"]] == [2, 2, 1] and index["source"] == "sampled"
    shard = load_file(str(tmp_path / "d" / index["shards"][0]["file"]))
    assert shard["tokens"].shape == (2, 64) and shard["hidden"].shape == (2, 64, 64)
    assert shard["hidden"].dtype == torch.float16 and shard["labels"].tolist() == [1, 2]
    hidden = dt.teacher_hidden(target, shard["labels"], shard["tokens"].long())
    assert torch.allclose(hidden.half().float(), shard["hidden"].float())
    other = Transformer(gpt_config("GPT-tiny", image_size=64, vocab_size=512))
    with pytest.raises(Exception, match="block_size 64 but the target has 16"):
        dt.read_index(tmp_path / "d", other)


def test_teacher_forcing_on_a_token_file_and_reusing_data(run_cli, target_dir, tmp_path) -> None:
    rng = np.random.default_rng(0)
    np.save(tmp_path / "tokens.npy", rng.integers(0, 512, size=(6, 64)))
    np.save(tmp_path / "labels.npy", rng.integers(0, 5, size=(6,)))
    first = _train(run_cli, target_dir, tmp_path / "a", "--tokens", str(tmp_path / "tokens.npy"), "--labels",
                   str(tmp_path / "labels.npy"), "--steps", "2", "--batch", "2", "--eval-images", "0")
    assert first.exit_code == 0, first.stderr
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["data"]["source"] == "tokens" and manifest["metrics"]["greedy_tau_sd_depth4"] is None
    second = _train(run_cli, target_dir, tmp_path / "b", "--data", str(tmp_path / "a" / "data"), "--steps", "2",
                    "--batch", "2", "--eval-images", "0")
    assert second.exit_code == 0, second.stderr
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["data"]["reused"] is True


@pytest.mark.parametrize("extra, words", [
    (["--labels", "l.npy"], "--labels goes with --tokens"),
    (["--tokens", "t.npy"], "--tokens needs --labels"),
    (["--resume"], "holds no checkpoint.pt to continue from"),
    (["--lr", "0"], "--lr must be a positive finite number"),
    (["--data-temperature", "inf"], "--data-temperature must be a positive finite number"),
    (["--tokens", "t.npy", "--labels", "l.npy", "--data-cfg", "2"], "--tokens replaces generation: drop --data-cfg"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--model", "some/bundle"], "give either --model (a bundle or Chameleon folder) or --gpt-ckpt"),
])
def test_bad_arguments_are_refused_in_one_line(run_cli, target_dir, tmp_path, extra, words) -> None:
    out = tmp_path / "out"
    res = _train(run_cli, target_dir, out, *extra)
    assert res.exit_code == 2 and words in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("flag", [["--gpt-model", "GPT-B"], ["--num-images", "8"], ["--resume"], ["--lr", "0.1"]])
def test_checkpoint_flags_on_a_bundle_are_refused(run_cli, tmp_path, flag) -> None:
    res = run_cli("train", "drafter", "--out", str(tmp_path / "o"), *flag)
    assert res.exit_code == 2 and "applies to --gpt-ckpt (or Chameleon folder) training only" in res.stderr


def test_a_non_empty_out_needs_force_or_resume(run_cli, target_dir, tmp_path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    res = _train(run_cli, target_dir, out, "--steps", "1")
    assert res.exit_code == 2 and "pass --force to replace it, --resume" in res.stderr
    assert (out / "keep.txt").read_text() == "x"


@pytest.mark.slow
def test_two_gloo_ranks_train_the_drafter_one_process_trains(target_dir, tmp_path) -> None:
    """torchrun: the data is the single process's (same shard contents), the training steps see the
    same batches with gradients averaged across ranks, so the weights agree up to summation order."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    args = ["train", "drafter", "--gpt-ckpt", str(target_dir), "--device", "cpu", "--num-images", "12",
            "--data-cfg", "1", "--data-top-k", "0", "--steps", "6", "--batch", "4", "--eval-images", "0",
            "--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    single = subprocess.run([sys.executable, "-m", "runtime", *args, "--out", str(tmp_path / "one")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-2000:]
    multi = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "runtime", *args, "--out", str(tmp_path / "two")], env=env, capture_output=True,
                           text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-2000:]
    one, two = (json.loads((tmp_path / d / "data" / "index.json").read_text()) for d in ("one", "two"))
    assert [s["images"] for s in two["shards"]] == [6, 6] and one["images"] == two["images"] == 12
    tokens = [torch.cat([load_file(str(tmp_path / d / "data" / s["file"]))["tokens"] for s in idx["shards"]])
              for d, idx in (("one", one), ("two", two))]
    assert torch.equal(tokens[0], tokens[1])
    w1, w2 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "two"))
    assert w1.keys() == w2.keys()
    assert all(torch.allclose(w1[k], w2[k], atol=1e-4, rtol=1e-3) for k in w1)
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["training"]["ranks"] == 2
