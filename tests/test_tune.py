"""runtime tune: the tree search is exact on small tables (brute force over every tree), the
acceptance estimates read the calibration counts right, and a tuned profile loads and runs."""

import itertools
import json
import random

import pytest

from runtime.config.profiles import load_profile
from runtime.tools.tune import (Costs, acceptance_rates, best_trees, calibration_tree, choose_tree, monotone,
                          node_weights, probe_tree, tree_value)


def all_trees(budget: int, depth: int, ranks: int, prefix: tuple = ()) -> list[tuple]:
    """Every rank-closed set of descendants of `prefix` with at most `budget` nodes, `depth` levels."""
    if depth == 0 or budget == 0:
        return [()]

    def children(r: int, left: int) -> list[tuple]:
        out = [()]
        if r == ranks or left == 0:
            return out
        node = prefix + (r,)
        for sub in all_trees(left - 1, depth - 1, ranks, node):
            for rest in children(r + 1, left - 1 - len(sub)):
                out.append((node,) + sub + rest)
        return out

    return children(0, budget)


def random_weights(seed: int, depth: int, ranks: int) -> list[list[float]]:
    rng = random.Random(seed)
    rate = [[rng.uniform(0.05, 0.95) for _ in range(ranks)] for _ in range(depth)]
    return node_weights(rate)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_nodes, max_depth, ranks", [(6, 3, 3), (7, 4, 2), (5, 5, 4)])
def test_dp_finds_the_brute_force_optimum_for_every_size(seed, max_nodes, max_depth, ranks):
    weights = random_weights(seed, max_depth, ranks)
    trees = [t for t in all_trees(max_nodes, max_depth, ranks) if t]
    got = best_trees(weights, max_nodes, max_depth)
    for n in range(1, max_nodes + 1):
        values = [tree_value(t, weights) for t in trees if len(t) == n]
        assert got[n][0] == pytest.approx(max(values)), n
        assert len(got[n][1]) == n and tree_value(got[n][1], weights) == pytest.approx(got[n][0])


@pytest.mark.parametrize("seed", range(8))
def test_choice_is_the_brute_force_best_tokens_per_second(seed):
    rng = random.Random(100 + seed)
    max_nodes, max_depth, ranks = 7, 4, 3
    weights = random_weights(seed, max_depth, ranks)
    # verify/accept grow with nodes, the draft with depth; steep or flat at random
    verify = {1: 1.0, 2: 1.0 + rng.uniform(0, 0.3), 4: 1.2 + rng.uniform(0, 0.8), 7: 1.5 + rng.uniform(0, 2)}
    accept = {1: 0.1, 7: 0.1 + rng.uniform(0, 0.3)}
    costs = Costs(verify, accept, {1: 0.2, 4: 0.2 + rng.uniform(0.1, 1.5)}, ar_step=1.0)
    best, per_depth = choose_tree(weights, costs, max_nodes, max_depth)

    def speed(t: tuple) -> float:
        return (1 + tree_value(t, weights)) / costs.iteration(len(t), max(len(p) for p in t))

    brute = max((t for t in all_trees(max_nodes, max_depth, ranks) if t), key=speed)
    assert best.expected_speedup == pytest.approx(speed(brute) * costs.ar_step)
    assert speed(best.paths) == pytest.approx(speed(brute))
    assert [c.depth for c in per_depth] == list(range(1, max_depth + 1))


def test_acceptance_rates_from_node_counts():
    tree = calibration_tree(2, 2)  # [0], [1], [0, 0], [0, 1]
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1))
    # 100 iterations: [0] accepted 60 times, [1] 20 of the 40 left; below [0]: [0,0] 30, [0,1] 15
    hits = [0, 60, 20, 30, 15]
    rate, reached = acceptance_rates(tree, hits, 100, 2, prior=0.0)
    assert reached == [[100, 40], [60, 30]]
    assert rate == [[0.6, 0.5], [0.5, 0.5]]
    shrunk, _ = acceptance_rates(tree, [0, 0, 0, 0, 0], 0, 2)  # nothing reached: the pooled prior
    assert all(0 < a < 1 for row in shrunk for a in row)


def test_costs_are_fitted_non_decreasing_in_nodes():
    assert monotone({1: 9.0, 2: 7.0, 4: 11.0, 8: 10.0, 16: 15.0}) == {1: 8.0, 2: 8.0, 4: 10.5, 8: 10.5, 16: 15.0}
    assert monotone({1: 1.0, 2: 2.0}) == {1: 1.0, 2: 2.0}


def test_probe_trees_are_complete_ternary_trees():
    assert probe_tree(4).paths == ((0,), (1,), (2,), (0, 0))
    assert probe_tree(13).max_depth == 3 and probe_tree(13).num_nodes == 13


def test_tune_writes_a_profile_that_loads_and_runs(tmp_path, run_cli):
    out = tmp_path / "tuned.toml"
    r = run_cli("tune", "--device", "cpu", "--no-graph", "--num-images", "1", "--max-nodes", "4",
                "--max-depth", "2", "--ranks", "2", "--ddd-thresholds", "-0.3", "--occupancies", "1,2", "--out", str(out))
    assert r.exit_code == 0, r.stderr
    profile = load_profile(out)
    assert profile.roof is not None and profile.roof.bandwidth_gbs > 0 and profile.roof.matmul_tflops > 0
    assert profile.roof.source.startswith("runtime tune: measured")
    # --method auto's table: the faster of AR and the tuned tree (exact) at each occupancy, measured
    record_rows = json.loads((tmp_path / "tuned.tune.json").read_text())["occupancy"]
    assert [row["occupancy"] for row in record_rows] == [1, 2]
    assert profile.auto is not None and profile.auto.by_occupancy == {str(r["occupancy"]): r["fastest"]
                                                                      for r in record_rows}
    for row in record_rows:
        assert row["fastest"] == max(row["images_per_s"], key=row["images_per_s"].get)
    assert profile.tree.name.endswith("tuned.tree.toml") and profile.method.name == "lantern++"
    assert profile.method.ddd_threshold == -0.3
    record = json.loads((tmp_path / "tuned.tune.json").read_text())
    assert 1 <= record["choice"]["nodes"] <= 4 and record["choice"]["depth"] <= 2
    assert set(record["costs"]["verify_s"]) == {"1", "2", "4"}
    assert "Chosen: depth" in out.read_text()
    # refuses to overwrite; --force does
    again = run_cli("tune", "--device", "cpu", "--out", str(out))
    assert again.exit_code == 2 and "exists" in again.stderr
    # the profile runs (its tree file is found beside it)
    r = run_cli("run", "--device", "cpu", "--profile-name", str(out), "--num-images", "1", "--classes", "3",
                "--out", str(tmp_path / "images"))
    assert r.exit_code == 0, r.stderr
    result = json.loads((tmp_path / "images" / "result.json").read_text())
    assert result["batch_size"] == 1 and result["profile"]["tree"]["name"].endswith("tuned.tree.toml")


def test_tune_quality_budget_chooses_within_the_band_and_auto_runs_it(tmp_path, run_cli):
    """Quick mode (the mechanics, not a verdict worth keeping): 12 images per set, one lambda."""
    out = tmp_path / "q.toml"
    r = run_cli("tune", "--device", "cpu", "--no-graph", "--num-images", "1", "--max-nodes", "2", "--max-depth", "2",
                "--ranks", "2", "--ddd-thresholds", "none", "--occupancies", "1", "--quality-budget", "1",
                "--quality-images", "12", "--lambdas", "4", "--relax-rules", "paper", "--out", str(out))
    assert r.exit_code == 0, r.stderr
    record = json.loads((tmp_path / "q.tune.json").read_text())["quality"]
    assert record["images"] == 12 and record["features"] == "demo classifier"
    tried = [(c["relax_rule"], c["lantern_lambda"]) for c in record["candidates"]]
    assert tried == [("paper", 1.0), ("paper", 4.0)]  # the exact tree always competes
    assert set(record["band"]) == {"class_accuracy", "fd", "precision", "recall"}
    for c in record["candidates"]:
        inside = all(abs(c["vs_ar"][m]["value"]) <= record["band"][m] for m in record["band"])
        assert c["indistinguishable"] == inside
    within = [c for c in record["candidates"] if c["indistinguishable"]] or record["candidates"][:1]
    chosen = max(within, key=lambda c: c["images_per_s"])
    assert (record["chosen"]["relax_rule"], record["chosen"]["lantern_lambda"]) == \
        (chosen["relax_rule"], chosen["lantern_lambda"])
    profile = load_profile(out)
    assert profile.quality is not None and profile.quality.images == 12
    assert profile.quality.lantern_lambda == chosen["lantern_lambda"] == profile.method.lantern_lambda
    assert set(profile.quality.vs_ar) == set(record["band"])
    # --method auto reads it: lantern++ at the chosen relaxation, not the exact rule
    from runtime.generation.settings import resolve_spec

    spec = resolve_spec("lantern++", {}, profile, {}, lossless=True)
    assert spec.lantern_lambda == profile.quality.lantern_lambda and spec.relax_rule == profile.quality.relax_rule


@pytest.mark.parametrize("args, message", [
    (["--method", "sd", "--quality-budget", "1"], "--method sd is exact"),
    (["--lambdas", "2,3"], "only set(s) up --quality-budget"),
    (["--quality-budget", "0"], "must be > 0"),
    (["--quality-budget", "1", "--relax-rules", "loose"], "expected paper, bounded"),
    (["--quality-budget", "1", "--lambdas", "0.5"], "numbers >= 1"),
    (["--quality-budget", "1", "--inception-weights", "w.safetensors"], "--inception-weights does nothing for the demo"),
    (["--method", "eagle2"], "chooses a static tree"),
    (["--max-depth", "0"], "--max-depth must be in"),
    (["--ddd-thresholds", "0.5"], "log probabilities"),
    (["--occupancies", "0,2"], "batch sizes in [1, 256]"),
])
def test_tune_refuses_bad_arguments(tmp_path, run_cli, args, message):
    r = run_cli("tune", "--device", "cpu", "--out", str(tmp_path / "p.toml"), *args)
    assert r.exit_code == 2 and message in r.stderr
    assert not (tmp_path / "p.toml").exists()


def test_all_trees_enumerator_counts_small_cases():
    # sanity of the brute force itself: trees of <= 2 nodes, depth <= 2, 2 ranks:
    # {}, {0}, {0,1}, {0,00}
    assert sorted(all_trees(2, 2, 2)) == sorted([(), ((0,),), ((0,), (1,)), ((0,), (0, 0))])
    assert len(list(itertools.chain(all_trees(3, 1, 3)))) == 4


AUTO_PROFILE = """description = "auto"
[device]
dtype = "fp32"
graph = false
batch_size = 1
[tree]
name = "chain3"
[method]
name = "lantern++"
lantern_lambda = 5.0
[bench]
warmup = 0
repeats = 1
[auto]
by_occupancy = { 1 = "lantern++", 2 = "ar" }
"""


def test_method_auto_runs_the_tables_lossless_method_for_the_batch(tmp_path, run_cli):
    profile = tmp_path / "auto.toml"
    profile.write_text(AUTO_PROFILE)
    for batch, method in ((1, "lantern++"), (2, "ar")):
        out = tmp_path / f"b{batch}"
        r = run_cli("run", "--device", "cpu", "--profile-name", str(profile), "--method", "auto", "--num-images", "2",
                    "--batch-size", str(batch), "--out", str(out))
        assert r.exit_code == 0, r.stderr
        result = json.loads((out / "result.json").read_text())
        assert result["method"] == method and result["sampling_source"]["method"].startswith("--method auto")
        if method == "lantern++":
            assert result["sampling"]["lantern_lambda"] == 1.0  # auto is lossless: the exact tree
    refused = run_cli("run", "--device", "cpu", "--profile-name", "cpu-tuned-greedy", "--method", "auto",
                      "--out", str(tmp_path / "x"))
    assert refused.exit_code == 2 and "--method auto needs a profile with an [auto] table" in refused.stderr
    relaxed = run_cli("run", "--device", "cpu", "--profile-name", str(profile), "--method", "auto", "--lantern-lambda",
                      "3", "--out", str(tmp_path / "y"))
    assert relaxed.exit_code == 2 and "picks lossless methods only" in relaxed.stderr


@pytest.mark.slow
def test_tune_interrupted_in_its_quality_phase_leaves_nothing_beside_out(tmp_path):
    """SIGINT while --quality-budget decodes: exit 130, and neither the profile, its tree file,
    its record nor the staging folder is left (the tree is staged until all three are written)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "q.toml"
    env = {**os.environ, "LANTERN_GRAPH": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "tune", "--device", "cpu", "--num-images", "1",
                             "--max-nodes", "2", "--max-depth", "2", "--ranks", "2", "--ddd-thresholds", "none",
                             "--occupancies", "1", "--quality-budget", "1", "--quality-images", "96", "--lambdas",
                             "4", "--relax-rules", "paper", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 300
    staged = []
    while proc.poll() is None and time.time() < deadline and not staged:
        staged = list(tmp_path.glob(".q.tune-*/q.tree.toml"))  # the tree is written: the quality phase starts
        time.sleep(0.05)
    assert staged, "the quality phase never started"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "nothing half-written was left" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
