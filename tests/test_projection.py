"""Real-shape projection (issue 20 item 3): the arithmetic, and step timing on a tiny shape."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.bench.projection import (SHAPES, ModelShape, check_projectable, model_shape, projected_speedup,
                                      projection_interval)
from runtime.tools.step_timing import random_models, random_neighbours, time_steps
from runtime.core import Decoder, MethodSpec, SamplingParams
from runtime.utils.errors import UserError

TINY = ModelShape("tiny", "GPT-tiny", 64, 64, "GPT-tiny, 4x4 tokens, 64 codes")


def test_projection_is_tau_times_ar_step_over_iteration():
    assert projected_speedup(3.0, 0.010, 0.015) == pytest.approx(2.0)
    assert projected_speedup(1.0, 0.02, 0.02) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        projected_speedup(0.0, 0.01, 0.01)


def test_projection_interval_brackets_the_point_and_shrinks_with_samples():
    rng = np.random.default_rng(0)
    ar, it = 0.010 + rng.normal(0, 5e-4, 20), 0.020 + rng.normal(0, 1e-3, 20)
    point, low, high = projection_interval(4.0, ar, it)
    assert low < point < high and point == pytest.approx(4.0 * np.median(ar) / np.median(it))
    ar_many, it_many = 0.010 + rng.normal(0, 5e-4, 400), 0.020 + rng.normal(0, 1e-3, 400)
    _, low_many, high_many = projection_interval(4.0, ar_many, it_many)
    assert high_many - low_many < high - low
    assert low_many < 2.0 < high_many  # the truth: 4 x 0.010 / 0.020


def test_every_named_shape_builds_its_config():
    assert set(SHAPES) == {"demo", "llamagen-b", "llamagen-l", "llamagen-xl", "llamagen-xxl", "chameleon-7b",
                           "janus-pro-1b", "janus-pro-7b", "emu3-8b", "emu3-8b-6l"}
    from runtime.demo.bundle import load_demo_bundle

    demo, packaged = model_shape("demo").config(), load_demo_bundle().gpt.config
    assert [getattr(demo, k) for k in ("n_layer", "n_head", "dim", "ffn_hidden", "block_size", "vocab_size",
                                       "num_classes", "cls_token_num")] == \
        [getattr(packaged, k) for k in ("n_layer", "n_head", "dim", "ffn_hidden", "block_size", "vocab_size",
                                        "num_classes", "cls_token_num")]
    shapes = {name: model_shape(name).config() for name in ("janus-pro-1b", "janus-pro-7b", "emu3-8b", "emu3-8b-6l")}
    assert [(c.n_layer, c.n_head, c.kv_heads, c.dim, c.ffn_hidden, c.block_size, c.vocab_size)
            for c in shapes.values()] == [(24, 16, 16, 2048, 5632, 576, 16384), (30, 32, 32, 4096, 11008, 576, 16384),
                                          (32, 32, 8, 4096, 14336, 8100, 32768), (6, 32, 8, 4096, 14336, 8100, 32768)]
    xl = model_shape("llamagen-xl").config()
    assert (xl.n_layer, xl.dim, xl.block_size, xl.vocab_size) == (36, 1280, 256, 16384)
    cham = model_shape("chameleon-7b").config()
    assert (cham.n_layer, cham.dim, cham.ffn_hidden, cham.vocab_size, cham.block_size) == (32, 4096, 11008,
                                                                                            65536, 1024)
    with pytest.raises(UserError, match="unknown --shape 'xl'"):
        model_shape("xl")


@pytest.mark.parametrize("spec", [MethodSpec(method="ddd"), MethodSpec(method="lantern++", dynamic_depth=0.2)])
def test_methods_whose_depth_the_weights_decide_are_not_projected(spec):
    with pytest.raises(UserError, match="random weights cannot stand in"):
        check_projectable(spec)


@pytest.mark.parametrize("method, extra", [("ar", {}), ("lantern++", {"tree": "chain3", "lantern_k": 4}),
                                           ("eagle2", {"depth": 2, "top_k_draft": 3, "total_tokens": 8})])
def test_step_times_of_a_tiny_shape(method, extra):
    from backends import get_backend

    backend = get_backend("cpu", graph_mode=False)
    target, drafter = random_models(TINY.config(), backend)
    spec = MethodSpec(method=method, sampling=SamplingParams(greedy=False), **extra)
    decoder = Decoder(target, drafter, spec, neighbours=random_neighbours(TINY.vocab_size, spec), backend=backend)
    times = time_steps(decoder, backend, warmup=2, iterations=12)
    assert len(times.verify) == len(times.accept) == 12
    assert len(times.draft) == (0 if method == "ar" else 12)
    assert (times.iterations() > 0).all()


def test_a_whole_projection_names_its_inputs_and_equals_tau_times_the_step_ratio():
    from backends import get_backend
    from runtime.bench.projection import Target, project

    backend = get_backend("cpu", graph_mode=False)
    spec = MethodSpec(method="lantern++", tree="chain3", lantern_k=4, sampling=SamplingParams(greedy=True))
    out = project(TINY, backend, [Target("chain3", spec, 2.5, "tau given (--tau 2.5)")], warmup=1, iterations=6)
    run = out["runs"][0]
    assert run["tau"] == 2.5 and run["tau_source"] == "tau given (--tau 2.5)"
    assert out["shape"]["weights"].startswith("random")
    ratio = np.median(np.sum([run["seconds"][p] for p in ("draft", "verify", "accept")], axis=0))
    ar = np.median(np.sum([out["ar_step"]["seconds"][p] for p in ("verify", "accept")], axis=0))
    assert run["projected_speedup"]["point"] == pytest.approx(2.5 * ar / ratio)
    assert run["projected_speedup"]["low"] <= run["projected_speedup"]["point"] <= run["projected_speedup"]["high"]


def test_a_bench_run_maps_back_to_its_method_spec():
    from types import SimpleNamespace

    from runtime.bench.projection import spec_from_run
    from runtime.bench.schema import MethodParams

    sampling = SimpleNamespace(greedy=False, temperature=1.0, top_k=0, top_p=1.0, cfg=3.0)
    run = SimpleNamespace(method="lantern++", params=MethodParams(tree="chain6", lantern_k=32, lantern_lambda=8.0))
    spec = spec_from_run(run, sampling)
    assert (spec.tree, spec.lantern_k, spec.lantern_lambda, spec.sampling.cfg) == ("chain6", 32, 8.0, 3.0)
    run = SimpleNamespace(method="eagle2", params=MethodParams(tree="dynamic", depth=4, top_k_draft=10,
                                                               total_tokens=60))
    assert spec_from_run(run, sampling).describe()["depth"] == 4


# -- runtime bench --shape and the projection file ---------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--tau", "2.5", "--num-images", "3"], "--num-images does nothing with --shape"),
    ([], "--shape needs the tau of a trained model"),
    (["--tau", "2.5", "--methods", "sd,ar"], "not ar: it is the baseline"),
    (["--tau", "2.5", "--methods", "sd:tau=x"], "tau must be a number"),
    (["--tau", "2.5", "--methods", "sd:tau=0.9"], "got 0.9 for 'sd:tau=0.9'"),
    (["--tau", "0.5", "--methods", "sd"], "--tau is tokens per target forward, >= 1"),
    (["--tau-from", "x.json", "--methods", "sd"], "--tau-from projects the runs of the file"),
])
def test_bench_shape_refuses_what_a_projection_cannot_use(tmp_path, run_cli, args, words):
    out = tmp_path / "p.json"
    res = run_cli("bench", "--shape", "llamagen-b", "--device", "cpu", *args, "--out", str(out))
    assert res.exit_code == 2 and words in res.stderr, res.stderr
    assert not out.exists()


def test_tau_flags_without_shape_are_refused(tmp_path, run_cli):
    res = run_cli("bench", "--tau", "2.0", "--out", str(tmp_path / "b.json"))
    assert res.exit_code == 2 and "--tau is for --shape projections" in res.stderr


@pytest.mark.slow
def test_bench_shape_projects_several_trees_each_at_its_own_tau(tmp_path, run_cli):
    import json

    out = tmp_path / "p.json"
    res = run_cli("bench", "--shape", "llamagen-b", "--device", "cpu", "--no-graph", "--methods",
                  "lantern++:tree=chain3:tau=2.2,lantern++:tree=chain6,sd:depth=2", "--tau", "2.67",
                  "--iterations", "2", "--warmup", "1", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [(r["label"], r["tau"]) for r in runs] == [("lantern++:tree=chain3", 2.2), ("lantern++:tree=chain6", 2.67),
                                                       ("sd:depth=2", 2.67)]
    assert [r["params"]["tree"] for r in runs[:2]] == ["chain3", "chain6"]


@pytest.mark.slow
def test_bench_shape_writes_a_projection_the_report_labels(tmp_path, run_cli):
    out = tmp_path / "p.json"
    res = run_cli("bench", "--shape", "llamagen-b", "--device", "cpu", "--no-graph", "--methods", "lantern++",
                  "--tree", "chain3", "--tau", "2.5", "--iterations", "2", "--warmup", "1", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    import json

    from runtime.bench.projection import validate_projection

    data = json.loads(out.read_text())
    parsed = validate_projection(data, str(out))
    assert parsed.shape.layers == 12 and parsed.runs[0].tau_source == "given: --tau 2.5"
    assert parsed.runs[0].params["cfg"] == 4.0  # LlamaGen's c2i reference setting
    report = tmp_path / "report"
    assert run_cli("report", str(out), "--out", str(report)).exit_code == 0
    markdown = (report / "report.md").read_text()
    assert "## Projected speedups on real model shapes" in markdown and "Projections, not measurements" in markdown
    assert "given: --tau 2.5" in markdown


def test_a_bad_projection_file_is_named_by_field_path():
    from runtime.bench.projection import validate_projection

    good = {"schema_version": 1, "kind": "projection", "device": {}, "env": {},
            "shape": {"name": "x", "description": "x", "layers": 1, "width": 8, "vocab_size": 8, "image_tokens": 4,
                      "weights": "random"},
            "batch_size": 1, "warmup": 1, "iterations": 2,
            "ar_step": {"seconds": {"verify": [0.1], "accept": [0.1]}, "median_s": 0.2},
            "runs": [{"label": "a", "method": "sd", "params": {}, "tau": 2.0, "tau_source": "given",
                      "seconds": {"draft": [0.1], "verify": [0.1], "accept": [0.1]}, "iteration_s": 0.3,
                      "iteration_over_ar_step": 1.5, "projected_speedup": {"point": 1.3, "low": 1.2, "high": 1.4}}]}
    validate_projection(good, "p.json")
    bad = json_copy(good)
    bad["runs"][0]["tau"] = -1
    with pytest.raises(UserError, match=r"p.json: runs\[0\].tau must be > 0 \(got -1\)"):
        validate_projection(bad, "p.json")
    bad = json_copy(good)
    bad["runs"][0]["projected_speedup"]["low"] = 1.35
    with pytest.raises(UserError, match=r"runs\[0\].projected_speedup .*must satisfy low <= point"):
        validate_projection(bad, "p.json")
    bad = json_copy(good)
    bad["extra"] = 1
    with pytest.raises(UserError, match=r"p.json: extra is not a known field; remove it"):
        validate_projection(bad, "p.json")


def json_copy(data):
    import json

    return json.loads(json.dumps(data))


def test_random_checkpoints_of_a_shape_load_like_official_files_and_decode(tmp_path):
    """save_random_checkpoints writes LlamaGen's layouts (target, VQ, LANTERN drafter folder) that
    the loader reads with the official flags; the same seed writes the same weights."""
    import torch

    from runtime.bench.projection import ModelShape, save_random_checkpoints
    from runtime.core import MethodSpec, SamplingParams, generate
    from runtime.generation.loading import load_model

    shape = ModelShape("tiny", "GPT-tiny", 64, 16384, "GPT-tiny, 64 px (4x4 tokens)")
    files = save_random_checkpoints(shape, tmp_path / "a", seed=3)
    assert files["gpt_ckpt"].name == "c2i_tiny_64.pt"
    again = save_random_checkpoints(shape, tmp_path / "b", seed=3)
    first, second = (torch.load(f["gpt_ckpt"], weights_only=True)["model"] for f in (files, again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    loaded = load_model(model=None, gpt_model="GPT-tiny", gpt_ckpt=str(files["gpt_ckpt"]), vq_ckpt=str(files["vq_ckpt"]),
                        image_size=64, drafter=str(files["drafter"]), gpt_type="c2i", trust=False,
                        device=torch.device("cpu"), dtype=torch.float32)
    assert loaded.image_size == 64 and loaded.drafter is not None
    spec = MethodSpec("lantern++", SamplingParams(greedy=True), tree="chain3", lantern_lambda=1.0, lantern_k=8)
    ar = MethodSpec("ar", SamplingParams(greedy=True))
    tokens = generate(loaded.target, loaded.drafter, spec, [1], vq=loaded.vq).tokens
    assert torch.equal(tokens, generate(loaded.target, None, ar, [1]).tokens)  # exact: lambda 1 is AR greedy


def test_paired_rounds_keep_a_drift_both_saw_out_of_the_interval():
    """Timed in turn, a drift of the machine moves AR and the iteration together: resampling the
    rounds together keeps the ratio's interval narrow where independent resampling widens it."""
    drift = np.linspace(1.0, 2.0, 30)  # the host slows by 2x over the run
    ar, it = 0.010 * drift, 0.015 * drift
    point, low, high = projection_interval(3.0, ar, it, paired=True)
    assert point == pytest.approx(2.0) and high - low < 1e-9
    _, low_free, high_free = projection_interval(3.0, ar, it)
    assert high_free - low_free > 0.3
