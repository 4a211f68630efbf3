"""COOL-SD from the command line (the rule itself: tests/test_relax_rules.py, exactness:
tests/test_core_exactness.py): both trees run on the demo, record their schedule, and the
settings that would do nothing are refused in one line."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("method, extra", [("cool-sd", ["--tree", "chain3"]), ("cool-sd", []),
                                           ("cool-eagle2", ["--depth", "2"])])
def test_cool_sd_runs_on_the_demo_and_records_its_schedule(run_cli, tmp_path, method, extra) -> None:
    out = tmp_path / "o"
    res = run_cli("run", "--method", method, *extra, "--cool-delta", "2", "--cool-nu", "0.5", "--device", "cpu",
                  "--no-graph", "--num-images", "2", "--seed", "3", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["method"] == method
    assert result["sampling"]["cool_delta"] == 2.0 and result["sampling"]["cool_nu"] == 0.5
    assert result["sampling"]["cool_mu"] is None  # mean-normalised
    assert result["stats"]["mean_relaxation_mass"] > 0


@pytest.mark.parametrize("args, words", [
    (["--method", "lantern++", "--cool-delta", "2"], "--cool-delta does nothing for --method lantern++"),
    (["--method", "cool-sd", "--lantern-lambda", "2"], "--lantern-lambda does nothing for --method cool-sd"),
    (["--method", "cool-sd", "--cool-delta", "0"], "--cool-delta must be a finite number in (0, 64], got 0.0"),
    (["--method", "lantern++", "--residual", "tv-optimal", "--relax-rule", "bounded"],
     "--residual tv-optimal is for --relax-rule paper"),
    (["--method", "lantern++", "--residual", "tv-optimal", "--greedy"], "--greedy draws no residual"),
    (["--method", "lantern++", "--residual", "tv-optimal", "--lantern-lambda", "1"], "the relaxation is off"),
])
def test_settings_that_do_nothing_are_refused(run_cli, tmp_path, args, words) -> None:
    res = run_cli("run", *args, "--device", "cpu", "--num-images", "1", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "o").exists()


def test_the_tv_optimal_residual_runs_and_is_recorded(run_cli, tmp_path) -> None:
    res = run_cli("run", "--method", "lantern++", "--residual", "tv-optimal", "--device", "cpu", "--no-graph",
                  "--num-images", "1", "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.stderr
    result = json.loads((tmp_path / "o" / "result.json").read_text())
    assert result["sampling"]["residual"] == "tv-optimal"
