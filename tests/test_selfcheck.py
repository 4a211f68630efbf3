"""`runtime selfcheck --device cpu`: its checks pass on the CPU and its JSON has the documented shape."""

from __future__ import annotations

import json

import pytest

from runtime.cli.app import main


@pytest.mark.slow
def test_selfcheck_cpu_passes_and_writes_its_report(tmp_path):
    out = tmp_path / "selfcheck.json"
    main(["selfcheck", "--device", "cpu", "--no-xl", "--out", str(out)])  # raises SystemExit(1) on failure
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["failed"] == []
    names = {c["name"]: c["passed"] for c in report["checks"]}
    assert names["graph_equals_eager"] is True
    assert names["greedy_exact"] is True
    assert names["no_zero_probability"] is True
    assert names["batch_invariance"] is True
    assert names["no_hidden_host_sync"] is None  # not applicable on the CPU
    assert names["steady_state_no_recompile"] is True  # inductor on the CPU: a second image compiles nothing
    ph = report["phases"]["lantern++ sampling"]
    assert set(ph["ops_per_iteration"]) == {"draft", "verify", "accept"}
    assert ph["kernels_per_step"]["verify"] > 0


def test_selfcheck_refuses_a_directory_as_out(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["selfcheck", "--device", "cpu", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "is a directory" in capsys.readouterr().err
