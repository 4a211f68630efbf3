"""`runtime eval` with torch-fidelity and open_clip: FID / IS / KID / precision-recall / CLIP score.

Needs the `eval` extra (torch-fidelity, open_clip, and a torchvision matching torch); marked
`eval` and skipped with the reason where it is not installed. CI runs this tier in its own
environment (.ci/run). No weights are downloaded: an InceptionV3 and a tiny CLIP with random
weights, written to temp files, stand in for the real ones.
"""

from __future__ import annotations

import argparse
import json
import warnings

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.eval
torch_fidelity = pytest.importorskip("torch_fidelity", reason="the eval extra (torch-fidelity) is not installed")
open_clip = pytest.importorskip("open_clip", reason="the eval extra (open_clip_torch) is not installed")

from PIL import Image  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from runtime.demo.dataset import make_images  # noqa: E402
from runtime.utils.errors import UserError  # noqa: E402
from runtime.metrics import fidelity  # noqa: E402
from runtime.metrics.clip_score import clip_scores, load_clip  # noqa: E402
from runtime.metrics.images import open_images  # noqa: E402


@pytest.fixture(scope="module")
def inception_file(tmp_path_factory):
    """torch-fidelity's InceptionV3 with random weights, as safetensors."""
    return fidelity.save_random_inception(tmp_path_factory.mktemp("inception") / "inception.safetensors")


def _folder(path, images, names=None):
    path.mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image).save(path / (names[i] if names else f"{i:03d}.png"))
    return path


def test_fid_equals_a_direct_scipy_frechet_distance_of_the_same_features(inception_file, tmp_path):
    scipy = pytest.importorskip("scipy", reason="the direct computation needs scipy (CI installs it)")
    import scipy.linalg  # noqa: F811

    model = fidelity.load_inception(inception_file)
    a = fidelity.extract(model, open_images(_folder(tmp_path / "a", make_images(1, np.arange(12))[0])))
    b = fidelity.extract(model, open_images(_folder(tmp_path / "b", make_images(2, np.arange(12))[0])))
    assert a.pool.shape == (12, 2048) and a.logits.shape == (12, 1008) and a.pool.std(0).max() > 0
    figures = fidelity.fidelity_metrics(a, b, reps=4)
    mu1, s1, mu2, s2 = a.pool.mean(0), np.cov(a.pool, rowvar=False), b.pool.mean(0), np.cov(b.pool, rowvar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 12 samples in 2048 dimensions: singular covariances
        covmean = scipy.linalg.sqrtm(s1 @ s2)
    direct = float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean.real))
    assert figures["fid"].value == pytest.approx(direct, rel=1e-4)
    assert figures["fid"].value > 0
    for name in ("fid", "inception_score", "kid", "precision", "recall"):
        e = figures[name]
        assert e.lo is not None and e.lo <= e.hi
    # FID of a set against itself is zero; a paired resample of a set against itself stays zero
    same = fidelity.fidelity_metrics(a, a, paired=True, reps=3)
    assert abs(same["fid"].value) < 1e-3 and abs(same["fid"].hi) < 1e-3  # round-off of rank-12 covariances


def test_inception_weights_with_pickled_objects_are_refused_unless_trusted(tmp_path, inception_file):
    from safetensors.torch import load_file

    state = load_file(str(inception_file))
    path = tmp_path / "inception.pth"
    torch.save({**state, "args": argparse.Namespace(x=1)}, path)
    with pytest.raises(UserError, match="--trust-checkpoint"):
        fidelity.load_inception(path)
    torch.save({"conv.weight": torch.zeros(2)}, tmp_path / "other.pth")
    with pytest.raises(UserError, match="not torch-fidelity InceptionV3 weights"):
        fidelity.load_inception(tmp_path / "other.pth")


def test_missing_inception_weights_name_where_to_get_them(tmp_path, monkeypatch):
    monkeypatch.delenv(fidelity.INCEPTION_ENV, raising=False)
    with pytest.raises(UserError, match="weights-inception-2015-12-05"):
        fidelity.inception_weights(None)
    with pytest.raises(UserError, match="file not found"):
        fidelity.inception_weights(str(tmp_path / "nope.pth"))
    (tmp_path / "w.pth").write_bytes(b"x")
    monkeypatch.setenv(fidelity.INCEPTION_ENV, str(tmp_path / "w.pth"))
    assert fidelity.inception_weights(None) == tmp_path / "w.pth"


@pytest.mark.slow
def test_runtime_eval_of_a_demo_run_against_ar_prints_every_figure_with_intervals(inception_file, tmp_path, run_cli):
    common = ("--num-images", "6", "--device", "cpu", "--seed", "5")
    assert run_cli("run", "--out", str(tmp_path / "ar"), "--method", "ar", *common).exit_code == 0
    assert run_cli("run", "--out", str(tmp_path / "lpp"), "--method", "lantern++", *common).exit_code == 0
    res = run_cli("eval", str(tmp_path / "lpp"), "--reference", str(tmp_path / "ar"), "--inception-weights",
                  str(inception_file), "--bootstrap", "5", "--device", "cpu", "--out", str(tmp_path / "q.json"))
    assert res.exit_code == 0, res.stderr
    for name in ("FID", "IS", "KID", "precision", "recall", "95% interval", "paired"):
        assert name in res.stdout
    result = json.loads((tmp_path / "q.json").read_text())
    assert result["paired"] is True and result["n"] == result["n_reference"] == 6
    for name in ("fid", "inception_score", "kid", "precision", "recall"):
        v = result["metrics"][name]
        assert v["lo"] <= v["hi"] and np.isfinite(v["value"])
    assert result["images_per_s"] > 0


def test_runtime_eval_against_an_adm_reference_batch_uses_its_statistics(inception_file, tmp_path, run_cli):
    real = make_images(3, np.arange(8))[0]
    model = fidelity.load_inception(inception_file)
    feats = fidelity.extract(model, open_images(_folder(tmp_path / "real", real)))
    mu, sigma = fidelity.gaussian(feats.pool)
    np.savez(tmp_path / "VIRTUAL_ref.npz", real, mu=mu, sigma=sigma)
    gen = np.ascontiguousarray(make_images(4, np.arange(6))[0])
    np.savez(tmp_path / "gen.npz", gen)
    res = run_cli("eval", str(tmp_path / "gen.npz"), "--reference", str(tmp_path / "VIRTUAL_ref.npz"),
                  "--inception-weights", str(inception_file), "--bootstrap", "0", "--json")
    assert res.exit_code == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["fid_reference"] == "precomputed mu/sigma" and result["paired"] is False
    by_folder = run_cli("eval", str(tmp_path / "gen.npz"), "--reference", str(tmp_path / "real"),
                        "--inception-weights", str(inception_file), "--bootstrap", "0", "--json")
    assert json.loads(by_folder.stdout)["metrics"]["fid"]["value"] == pytest.approx(
        result["metrics"]["fid"]["value"], rel=1e-6)
    assert result["metrics"]["fid"]["lo"] is None  # --bootstrap 0: no interval


def _eval_process(*argv: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "runtime", "eval", *argv], capture_output=True, text=True,
                          timeout=600)


def _one_error_line(proc, *words: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_eval_needs_no_temp_folder(inception_file, tmp_path):
    """A full temp folder (every temporary file or folder fails with ENOSPC in the process) does not
    stop eval: the weights reach torch-fidelity in memory, and --out is written beside itself."""
    import subprocess
    import sys

    np.savez(tmp_path / "gen.npz", np.ascontiguousarray(make_images(4, np.arange(4))[0]))
    out = tmp_path / "q.json"
    patch = ("import errno, os, tempfile\n"
             "def full(*a, **k):\n"
             "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tempfile.tempdir or '/tmp')\n"
             "tempfile.gettempdir = tempfile.TemporaryDirectory = tempfile.NamedTemporaryFile = full\n")
    argv = ["eval", str(tmp_path / "gen.npz"), "--inception-weights", str(inception_file), "--bootstrap", "0",
            "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", f"{patch}from runtime.cli.app import main\nmain({argv!r})"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "inception_score" in json.loads(out.read_text())["metrics"]


def test_features_that_overflow_are_refused_and_nothing_is_written(inception_file, tmp_path):
    """Finite weights scaled past float32's range: every feature is inf or NaN, so is every figure."""
    from safetensors.torch import load_file

    state = {k: v * 1e30 if v.is_floating_point() and k.endswith("conv.weight") else v
             for k, v in load_file(str(inception_file)).items()}
    huge = tmp_path / "huge.safetensors"
    save_file(state, str(huge))
    np.savez(tmp_path / "gen.npz", np.ascontiguousarray(make_images(4, np.arange(4))[0]))
    out = tmp_path / "q.json"
    _one_error_line(_eval_process(str(tmp_path / "gen.npz"), "--inception-weights", str(huge), "--bootstrap", "0",
                                  "--out", str(out)), "pool_3 features of 4 of 4 images are NaN or infinite")
    assert not out.exists()


def test_a_reference_whose_statistics_have_another_feature_width_is_refused(inception_file, tmp_path):
    images = np.ascontiguousarray(make_images(4, np.arange(4))[0])
    np.savez(tmp_path / "gen.npz", images)
    np.savez(tmp_path / "ref.npz", images, mu=np.zeros(16), sigma=np.eye(16))
    _one_error_line(_eval_process(str(tmp_path / "gen.npz"), "--reference", str(tmp_path / "ref.npz"),
                                  "--inception-weights", str(inception_file), "--bootstrap", "0"),
                    "mu / sigma have 16 features but InceptionV3's pool_3 has 2048")


@pytest.mark.parametrize("argv, message", [
    (("--reference", "REF", "--model", "demo"), "--model is for the demo metrics"),
    (("--clip-model", "ViT-B-32"), "needs both --clip-model"),
    (("--trust-checkpoint",), "--trust-checkpoint does nothing"),
    (("--reference", "REF", "--bootstrap", "-1"), "--bootstrap must be >= 0"),
])
def test_eval_refusals(tmp_path, run_cli, argv, message):
    argv = tuple(str(tmp_path) if a == "REF" else a for a in argv)
    res = run_cli("eval", str(tmp_path), *argv)
    assert res.exit_code == 2 and message in res.stderr and "Traceback" not in res.stderr


TINY_CLIP = {"embed_dim": 16,
             "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


def test_clip_score_of_a_prompt_run_equals_the_direct_definition(tmp_path, run_cli):
    config = tmp_path / "tiny-clip-test.json"
    config.write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    net = open_clip.create_model("tiny-clip-test", pretrained=None)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp_path / "clip.safetensors"))
    prompts = ["a red square", "a blue circle", "a green triangle", "a yellow star"]
    images = make_images(6, np.arange(4))[0]
    run = _folder(tmp_path / "run", images, [f"image_{i:04d}_p.png" for i in range(4)])
    records = [{"index": i, "file": f"image_{i:04d}_p.png", "prompt": p, "seed": i} for i, p in enumerate(prompts)]
    (run / "result.json").write_text(json.dumps({"schema_version": 1, "images": records}))

    res = run_cli("eval", str(run), "--clip-model", str(config), "--clip-weights", str(tmp_path / "clip.safetensors"),
                  "--bootstrap", "8", "--json")
    assert res.exit_code == 0, res.stderr
    score = json.loads(res.stdout)["metrics"]["clip_score"]

    clip = load_clip(str(config), tmp_path / "clip.safetensors")
    with torch.no_grad():
        pixels = torch.stack([clip.preprocess(Image.fromarray(im)) for im in images])
        img = torch.nn.functional.normalize(clip.model.encode_image(pixels), dim=-1)
        txt = torch.nn.functional.normalize(clip.model.encode_text(clip.tokenizer(prompts)), dim=-1)
    direct = (100 * (img * txt).sum(-1).clamp(min=0)).double().numpy()
    assert np.allclose(clip_scores(clip, open_images(run), prompts), direct, atol=1e-4)
    assert score["value"] == pytest.approx(direct.mean(), abs=1e-4) and score["lo"] <= score["hi"]
    with pytest.raises(UserError, match="do not fit open_clip"):
        save_file({"x": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
        load_clip(str(config), tmp_path / "bad.safetensors")
