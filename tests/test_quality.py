"""Quality measures: the Frechet distance's algebra, and the packaged bundle's classifier and
`runtime eval` on real images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runtime.demo.bundle import default_bundle_path
from runtime.demo.dataset import EVAL_SEED, NUM_CLASSES, VAL_SEED, make_images, to_tensor_range
from runtime.demo.quality import class_accuracy, evaluate_images
from runtime.metrics.frechet import frechet_distance

needs_bundle = pytest.mark.skipif(not (default_bundle_path() / "manifest.json").is_file(),
                                  reason="the packaged demo bundle (runtime/assets/demo) is not built")


def _gaussian(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((dim, dim)) / np.sqrt(dim)
    return rng.standard_normal((n, dim)) @ mix + rng.standard_normal(dim)


def test_fd_of_a_set_with_itself_is_zero():
    a = _gaussian(500, 16, 0)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)


def test_fd_of_a_pure_mean_shift_is_the_squared_shift():
    a = _gaussian(400, 12, 1)
    shift = np.linspace(-1, 1, 12)
    assert frechet_distance(a, a + shift) == pytest.approx(float((shift**2).sum()), rel=1e-7)


def test_fd_of_a_scaled_copy_matches_the_closed_form():
    # b = 2a: cov_b = 4 cov_a, so the cross term is 2 tr(2 cov_a) and FD = |mu_a|^2 + tr(cov_a).
    a = _gaussian(300, 10, 2)
    expected = float((a.mean(0) ** 2).sum() + np.trace(np.cov(a, rowvar=False)))
    assert frechet_distance(a, 2 * a) == pytest.approx(expected, rel=1e-7)


def test_fd_is_symmetric_and_grows_with_the_shift():
    a, b = _gaussian(400, 8, 3), _gaussian(400, 8, 4)
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-6)
    same = frechet_distance(_gaussian(400, 8, 3), _gaussian(400, 8, 3) + 0.0)
    fds = [frechet_distance(a, a + s) for s in (0.25, 0.5, 1.0, 2.0)]
    assert same == pytest.approx(0.0, abs=1e-8)
    assert fds == sorted(fds) and fds[0] > 0


def test_fd_handles_rank_deficient_covariances():
    # Fewer samples than dimensions: singular covariances must not produce NaN or a negative FD.
    a, b = _gaussian(5, 32, 5), _gaussian(6, 32, 6)
    fd = frechet_distance(a, b)
    assert np.isfinite(fd) and fd >= 0


def test_fd_rejects_mismatched_feature_sets():
    with pytest.raises(ValueError):
        frechet_distance(np.zeros((4, 3)), np.zeros((4, 5)))
    with pytest.raises(ValueError):
        frechet_distance(np.zeros((1, 3)), np.zeros((4, 3)))


@pytest.fixture(scope="module")
def bundle():
    from runtime.demo.bundle import load_demo_bundle

    return load_demo_bundle()


@needs_bundle
def test_bundle_classifier_recognises_held_out_real_images(bundle):
    images, labels = make_images(VAL_SEED, np.arange(10_000, 10_000 + 240))
    assert class_accuracy(bundle.classifier, images, labels) > 0.9


@needs_bundle
def test_real_images_score_well_and_wrong_or_noise_images_score_badly(bundle):
    # Held-out real images (indices past the FD reference set) against the reference set.
    images, labels = make_images(EVAL_SEED, np.arange(5000, 5000 + 240))
    real = evaluate_images(bundle, images, labels, n_real=480)
    wrong = evaluate_images(bundle, images, (labels + 1) % NUM_CLASSES, n_real=480)
    noise = np.random.default_rng(0).integers(0, 256, images.shape, dtype=np.uint8)
    junk = evaluate_images(bundle, noise, labels, n_real=480)
    assert real["class_accuracy"] > 0.9 and real["n"] == 240 and real["n_real"] == 480
    assert wrong["class_accuracy"] < 0.1 and wrong["fd"] == pytest.approx(real["fd"])
    assert junk["fd"] > 10 * real["fd"]


def _write_run(run_dir, tokens: np.ndarray, classes: list[int]) -> None:
    run_dir.mkdir()
    np.save(run_dir / "tokens.npy", tokens)
    records = [{"index": i, "class": c, "file": f"image_{i:04d}_c{c}.png"} for i, c in enumerate(classes)]
    (run_dir / "result.json").write_text(json.dumps({"schema_version": 1, "images": records}))


@needs_bundle
def test_runtime_eval_reports_high_accuracy_for_tokenised_real_images(bundle, tmp_path, run_cli):
    images, labels = make_images(VAL_SEED, np.arange(20_000, 20_000 + 48))
    with torch.no_grad():
        tokens = bundle.vq.encode(torch.from_numpy(to_tensor_range(images)))[1].numpy()
    _write_run(tmp_path / "run", tokens, labels.tolist())
    res = run_cli("eval", str(tmp_path / "run"), "--json", "--n-real", "240")
    assert res.exit_code == 0, res.stderr
    metrics = json.loads(res.stdout)
    assert metrics["n"] == 48 and metrics["n_real"] == 240
    acc = metrics["metrics"]["class_accuracy"]
    assert acc["value"] > 0.8 and acc["lo"] <= acc["value"] <= acc["hi"] and acc["hi"] - acc["lo"] > 0
    fd = metrics["metrics"]["fd"]
    assert fd["lo"] < fd["hi"] and metrics["bootstrap"] == 20


@needs_bundle
def test_runtime_eval_rejects_a_run_without_class_records(tmp_path, run_cli):
    run = tmp_path / "run"
    run.mkdir()
    np.save(run / "tokens.npy", np.zeros((2, 256), dtype=np.int64))
    (run / "result.json").write_text(json.dumps({"images": [{"index": 0, "prompt": "a cat"}]}))
    res = run_cli("eval", str(run))
    assert res.exit_code == 2
    assert "need a 'class'" in res.stderr and "Traceback" not in res.stderr


def test_runtime_eval_names_a_missing_tokens_file(tmp_path, run_cli):
    res = run_cli("eval", str(tmp_path))
    assert res.exit_code == 2
    assert "tokens.npy not found" in res.stderr


@needs_bundle
@pytest.mark.slow
def test_bench_quality_carries_intervals_and_the_paired_difference_to_ar(tmp_path, run_cli):
    out = tmp_path / "bench.json"
    res = run_cli("bench", "--device", "cpu", "--methods", "ar,lantern++", "--num-images", "4", "--repeats", "1",
                  "--warmup", "0", "--no-measure-law", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    runs = {r["method"]: r["quality"] for r in json.loads(out.read_text())["runs"]}
    for method, q in runs.items():
        for name in ("class_accuracy", "fd"):
            assert q[f"{name}_lo"] <= q[name] <= q[f"{name}_hi"], (method, name, q)
    assert "class_accuracy_vs_ar" not in runs["ar"]
    lpp = runs["lantern++"]
    assert lpp["fd_vs_ar_lo"] <= lpp["fd_vs_ar"] <= lpp["fd_vs_ar_hi"]
    report = tmp_path / "report"
    assert run_cli("report", str(out), "--out", str(report)).exit_code == 0
    text = (report / "report.md").read_text()
    from runtime.bench.report import quality_text
    from runtime.bench.schema import load_bench

    shown = quality_text(next(r for r in load_bench(out).runs if r.method == "lantern++"))
    assert "fd_vs_ar" in shown and " [" in shown and shown in text
