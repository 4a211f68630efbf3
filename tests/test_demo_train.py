"""The demo training path stays alive (micro run), and the packaged bundle is complete."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runtime.demo.bundle import PART_NAMES, default_bundle_path, load_demo_bundle
from runtime.demo.dataset import CLASS_NAMES, NUM_CLASSES, make_images, to_tensor_range
from runtime.demo.train import DemoTrainConfig, train_demo

RECOMMENDED_KEYS = {"temperature", "top_k", "top_p", "cfg", "method", "tree", "lantern_k", "lantern_lambda",
                    "lantern_delta"}
needs_bundle = pytest.mark.skipif(not (default_bundle_path() / "manifest.json").is_file(),
                                  reason="the packaged demo bundle (runtime/assets/demo) is not built")


@pytest.fixture(scope="module")
def micro_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro") / "bundle"
    manifest = train_demo(str(out), DemoTrainConfig.micro(seed=3, threads=1), command="pytest micro run")
    return out, manifest


def _check_manifest(manifest: dict) -> None:
    assert manifest["image_size"] == 64 and manifest["downsample"] == 4
    assert manifest["num_classes"] == NUM_CLASSES and manifest["class_names"] == list(CLASS_NAMES)
    assert set(manifest["recommended"]) >= RECOMMENDED_KEYS
    training = manifest["training"]
    assert training["command"] and isinstance(training["seed"], int)
    assert len(training["data"]["sha256_first_n_token_images"]) == 64
    assert set(training["steps"]) == {"vq", "gpt", "drafter", "classifier"}
    assert training["wall_time_s"]["total"] > 0
    metrics = manifest["metrics"]
    for key in ("recon_l1", "codebook_usage"):
        assert key in metrics["vq"]
    assert "val_loss" in metrics["gpt"] and "top1_vs_target" in metrics["drafter"]
    assert "val_accuracy" in metrics["classifier"]


def test_micro_run_writes_a_complete_bundle_atomically(micro_bundle):
    out, manifest = micro_bundle
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{n}.safetensors" for n in PART_NAMES] + ["manifest.json"])
    assert not out.with_name(out.name + ".tmp").exists()
    _check_manifest(manifest)
    assert manifest["training"]["command"] == "pytest micro run" and manifest["training"]["seed"] == 3


def test_micro_bundle_loads_and_its_parts_fit_together(micro_bundle):
    out, manifest = micro_bundle
    bundle = load_demo_bundle(out)
    assert bundle.manifest["training"]["seed"] == 3
    gpt_cfg, vq = bundle.gpt.config, bundle.vq
    assert gpt_cfg.block_size == 256 and gpt_cfg.vocab_size == vq.config.codebook_size
    assert gpt_cfg.num_classes == NUM_CLASSES and gpt_cfg.cls_token_num == 1
    assert 3e6 <= manifest["params"]["gpt"] <= 10e6
    assert vq.config.codebook_size >= 512 and vq.downsample == 4
    assert bundle.drafter.config.hidden_size == gpt_cfg.dim
    # The drafter's frozen input embedding is the target's (both stored in fp16).
    assert torch.equal(bundle.drafter.embed_tokens.weight, bundle.gpt.tok_embeddings.weight)
    images, _ = make_images(0, np.arange(2))
    with torch.no_grad():
        _, tokens = vq.encode(torch.from_numpy(to_tensor_range(images)))
        assert tokens.shape == (2, 256)
        assert vq.decode_code(tokens).shape == (2, 3, 64, 64)
        logits, hidden = bundle.gpt.forward_train(torch.tensor([0, 1]), tokens)
        assert logits.shape == (2, 256, gpt_cfg.vocab_size)
        assert bundle.drafter.forward_train(hidden, tokens).shape == (2, 256, gpt_cfg.dim)


def test_micro_bundle_loads_in_bfloat16(micro_bundle):
    bundle = load_demo_bundle(micro_bundle[0], dtype=torch.bfloat16)
    assert bundle.gpt.output.weight.dtype == torch.bfloat16
    assert bundle.drafter.fc.weight.dtype == torch.bfloat16
    assert bundle.vq.decoder.conv_out.weight.dtype == torch.float32


def test_train_refuses_an_existing_output_without_force(tmp_path, run_cli):
    (tmp_path / "taken").mkdir()
    res = run_cli("train", "demo", "--out", str(tmp_path / "taken"), "--micro")
    assert res.exit_code == 2 and "--force" in res.stderr
    res = run_cli("train", "demo", "--out", str(tmp_path / "new"), "--steps-gpt", "-1")
    assert res.exit_code == 2 and "--steps-gpt must be >= 0" in res.stderr
    assert not (tmp_path / "new").exists()


def test_drafter_retrain_replaces_only_the_drafter_and_records_how(micro_bundle, tmp_path, run_cli):
    src, _ = micro_bundle
    out = tmp_path / "retrained"
    res = run_cli("train", "drafter", "--model", str(src), "--out", str(out), "--steps", "2", "--threads", "1")
    assert res.exit_code == 0, res.stderr
    old, new = load_demo_bundle(src), load_demo_bundle(out)
    for part in ("gpt", "vq", "classifier"):
        a, b = getattr(old, part).state_dict(), getattr(new, part).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(old.drafter.fc.weight, new.drafter.fc.weight)
    assert torch.equal(new.drafter.embed_tokens.weight, new.gpt.tok_embeddings.weight)
    record = new.manifest["training"]["drafter_retrain"]
    assert record["steps"] == 2 and record["command"].startswith("runtime train drafter --model ")
    # Before and after are measured on the same 64 validation images.
    assert set(record["metrics_before"]) == set(new.manifest["metrics"]["drafter"]) == {"top1_vs_target", "vloss",
                                                                                         "ploss"}
    assert new.manifest["training"]["command"] == old.manifest["training"]["command"]
    _check_manifest(new.manifest)


def test_drafter_retrain_rejects_bad_arguments_before_writing(micro_bundle, tmp_path, run_cli):
    src, _ = micro_bundle
    res = run_cli("train", "drafter", "--model", str(src), "--out", str(tmp_path / "a"), "--steps", "0")
    assert res.exit_code == 2 and "--steps must be >= 1" in res.stderr
    res = run_cli("train", "drafter", "--model", str(tmp_path), "--out", str(tmp_path / "a"))
    assert res.exit_code == 2 and "no manifest.json" in res.stderr
    res = run_cli("train", "drafter", "--model", str(src), "--out", str(src))
    assert res.exit_code == 2 and "--force" in res.stderr
    assert not (tmp_path / "a").exists()


def test_target_retrain_changes_the_shape_and_keeps_vq_classifier_and_data(micro_bundle, tmp_path, run_cli):
    src, _ = micro_bundle
    out = tmp_path / "deep"
    res = run_cli("train", "target", "--model", str(src), "--out", str(out), "--gpt-layers", "6", "--gpt-dim", "64",
                  "--gpt-heads", "2", "--steps", "2", "--steps-drafter", "2", "--threads", "1")
    assert res.exit_code == 0, res.stderr
    assert "copied" in res.stdout  # VQ and classifier were not retrained
    old, new = load_demo_bundle(src), load_demo_bundle(out)
    for part in ("vq", "classifier"):
        a, b = getattr(old, part).state_dict(), getattr(new, part).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = new.gpt.config
    assert (cfg.n_layer, cfg.dim, cfg.n_head) == (6, 64, 2) and new.drafter.config.hidden_size == 64
    assert torch.equal(new.drafter.embed_tokens.weight, new.gpt.tok_embeddings.weight)
    record = new.manifest["training"]["target_retrain"]
    assert record["shape"] == {"layers": 6, "dim": 64, "heads": 2} and record["steps"] == {"gpt": 2, "drafter": 2}
    assert record["command"].startswith("runtime train target --model ")
    assert record["source_metrics"]["gpt"] == old.manifest["metrics"]["gpt"]
    assert new.manifest["params"]["gpt"] == sum(p.numel() for p in new.gpt.parameters())
    _check_manifest(new.manifest)


def test_target_retrain_rejects_bad_arguments_before_writing(micro_bundle, tmp_path, run_cli):
    src, _ = micro_bundle
    base = ("train", "target", "--model", str(src), "--out", str(tmp_path / "a"))
    res = run_cli(*base, "--gpt-layers", "0", "--gpt-dim", "64", "--gpt-heads", "2")
    assert res.exit_code == 2 and "--gpt-layers must be >= 1" in res.stderr
    res = run_cli(*base, "--gpt-layers", "2", "--gpt-dim", "60", "--gpt-heads", "8")
    assert res.exit_code == 2 and "--gpt-dim 60 must split into 8 heads" in res.stderr
    assert not (tmp_path / "a").exists()


def test_loading_a_folder_that_is_not_a_bundle_is_one_clear_error(tmp_path):
    from runtime.utils.errors import UserError

    with pytest.raises(UserError, match="not a model bundle"):
        load_demo_bundle(tmp_path)


@needs_bundle
def test_packaged_bundle_is_complete_small_and_reproducible_from_its_manifest():
    folder = default_bundle_path()
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    assert size <= 20 * 1024 * 1024
    manifest = json.loads((folder / "manifest.json").read_text())
    _check_manifest(manifest)
    assert manifest["training"]["command"].startswith("runtime train demo ")
    assert manifest["metrics"]["classifier"]["val_accuracy"] > 0.9
    assert manifest["metrics"]["vq"]["codebook_usage"] > 0.5
