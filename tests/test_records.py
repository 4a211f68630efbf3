"""Result files carry what reproduction needs: version, git commit (also for a non-editable
install run inside the checkout), command line, class names."""

from __future__ import annotations

import json
import subprocess

import runtime
from runtime.bench import environment


def test_run_result_records_version_commit_command_and_class_names(tmp_path, run_cli):
    out = tmp_path / "out"
    res = run_cli("run", "--device", "cpu", "--method", "lantern++", "--num-images", "2", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    result = json.loads((out / "result.json").read_text())
    software = result["software"]
    assert software["version"] == runtime.__version__
    assert software["command_line"] == ["runtime", "run", "--device", "cpu", "--method", "lantern++", "--num-images",
                                        "2", "--out", str(out)]
    assert software["git_commit"] == environment.git_commit()
    assert all(isinstance(r["class_name"], str) and r["class_name"] for r in result["images"])
    sources = result["sampling_source"]  # every setting the method used, with where it came from
    assert sources["tree"] == "profile cpu" and sources["cfg"].startswith("model bundle")
    assert set(sources) >= {"greedy", "temperature", "top_k", "top_p", "cfg", "cfg_interval"}


def _repo(path):
    (path / "runtime").mkdir(parents=True)
    (path / "runtime" / "__init__.py").write_text("")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=path, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()


def test_a_non_editable_install_reads_the_commit_of_the_checkout_it_runs_in(tmp_path, monkeypatch):
    head = _repo(tmp_path / "checkout")
    site = tmp_path / "site-packages" / "runtime" / "bench"
    site.mkdir(parents=True)
    monkeypatch.setattr(environment, "__file__", str(site / "environment.py"))  # installed, not the checkout
    monkeypatch.delenv(environment.COMMIT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert environment.git_commit() is None  # not inside a checkout of this project
    monkeypatch.chdir(tmp_path / "checkout")
    assert environment.git_commit() == head
    monkeypatch.setenv(environment.COMMIT_ENV, "abc123")
    assert environment.git_commit() == "abc123"


def test_commit_flag_is_recorded_and_a_bad_one_refused(tmp_path, run_cli, monkeypatch):
    monkeypatch.delenv(environment.COMMIT_ENV, raising=False)  # restored after the test
    out = tmp_path / "out"
    res = run_cli("--commit", "0123456789abcdef", "run", "--device", "cpu", "--num-images", "1", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    assert json.loads((out / "result.json").read_text())["software"]["git_commit"] == "0123456789abcdef"
    bad = run_cli("--commit", "main", "models")
    assert bad.exit_code == 2 and "--commit 'main': expected a git commit hash" in bad.stderr
