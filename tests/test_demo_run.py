"""`runtime run` on the packaged demo bundle: defaults, exactness at lambda = 1, graph mode."""

import json

import numpy as np
import pytest

from runtime.demo.bundle import default_bundle_path

pytestmark = pytest.mark.skipif(not (default_bundle_path() / "manifest.json").is_file(),
                                reason="the packaged demo bundle (runtime/assets/demo) is not built")


def tokens_of(run_cli, out, *args):
    res = run_cli("run", "--device", "cpu", "--out", str(out), *args)
    assert res.exit_code == 0, res.stderr
    return np.load(out / "tokens.npy"), json.loads((out / "result.json").read_text())


def test_default_run_uses_the_demo_with_lantern_pp_sampling(run_cli, tmp_path):
    tokens, result = tokens_of(run_cli, tmp_path / "out", "--classes", "0,5", "--no-graph")
    assert result["method"] == "lantern++" and result["sampling"]["greedy"] is False
    assert result["model"]["tokens_per_image"] == 256 and tokens.shape == (2, 256)
    assert result["stats"]["mean_accepted_length"] > 1.0


def test_greedy_lantern_pp_at_lambda_one_equals_greedy_ar(run_cli, tmp_path):
    common = ("--greedy", "--classes", "1,4,9", "--seed", "7", "--no-graph")
    ar, _ = tokens_of(run_cli, tmp_path / "ar", "--method", "ar", *common)
    lpp, result = tokens_of(run_cli, tmp_path / "lpp", "--method", "lantern++", "--lantern-lambda", "1", *common)
    assert np.array_equal(ar, lpp)
    assert result["stats"]["mean_accepted_length"] > 1.2  # drafts were accepted, not just bonus tokens


def test_graph_and_no_graph_give_the_same_tokens_and_stats(run_cli, tmp_path):
    common = ("--greedy", "--method", "lantern++", "--classes", "2", "--tree", "chain4", "--seed", "3")
    eager, r1 = tokens_of(run_cli, tmp_path / "eager", *common, "--no-graph")
    graph, r2 = tokens_of(run_cli, tmp_path / "graph", *common, "--graph")
    assert np.array_equal(eager, graph)
    for key in ("mean_accepted_length", "target_forwards", "tokens", "per_depth_acceptance"):
        assert r1["stats"][key] == r2["stats"][key]
    assert r2["timing"]["graph"] is True and "capture" in r2["timing"]["phases"]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("temperature", "1.0", "recommended.temperature must be a number"),
        ("top_k", 2.5, "recommended.top_k must be an integer"),
        ("lantern_lambda", 0.5, "recommended.lantern_lambda must be >= 1 (got 0.5)"),
        ("lantern_kk", 32, "recommended.lantern_kk is not a known field"),
    ],
)
def test_a_manifest_with_a_wrong_field_is_refused_in_one_line(run_cli, tmp_path, key, value, message):
    """A bundle whose manifest mistypes a recommended setting stops at load, naming file and field
    (it used to end in a TypeError traceback deep in sampling)."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for part in default_bundle_path().iterdir():
        if part.name != "manifest.json":
            (bundle / part.name).symlink_to(part)
    manifest = json.loads((default_bundle_path() / "manifest.json").read_text())
    manifest["recommended"][key] = value
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    res = run_cli("run", "--device", "cpu", "--model", str(bundle), "--out", str(tmp_path / "out"), "--classes", "0")
    assert res.exit_code == 2
    assert res.stderr.startswith(f"error: {bundle / 'manifest.json'}: {message}") and res.stderr.count("\n") == 1
