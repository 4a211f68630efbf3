"""CLI habits: --version, -v/-q logging levels, `models --json`, help that says which method reads a
flag, a fast `runtime --help` (no torch import), and `runtime bench --profile` traces."""

from __future__ import annotations

import gzip
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import runtime
from runtime.cli.app import configure_logging
from runtime.config.method_options import FLAG_METHODS, readers


def test_version(run_cli) -> None:
    result = run_cli("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"lantern-runtime {runtime.__version__}"


@pytest.mark.parametrize(("verbosity", "level"), [(-1, logging.ERROR), (0, logging.WARNING), (1, logging.INFO),
                                                  (2, logging.DEBUG), (5, logging.DEBUG)])
def test_verbosity_sets_the_level_of_every_package_logger(verbosity: int, level: int) -> None:
    try:
        configure_logging(verbosity)
        for name in ("runtime", "backends", "profiles"):
            logger = logging.getLogger(name)
            assert logger.level == level and len(logger.handlers) == 1
    finally:
        configure_logging(0)


def test_verbose_and_quiet_together_are_refused(run_cli) -> None:
    result = run_cli("-v", "-q", "models")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["error: -v/--verbose and -q/--quiet contradict each other; give one"]


def test_verbose_logs_what_was_loaded_and_default_does_not(run_cli, tmp_path: Path) -> None:
    # a refused flag stops the run after the model is loaded: enough to see the info lines
    loud = run_cli("-v", "run", "--device", "cpu", "--method", "ar", "--tree", "chain3", "--out", str(tmp_path / "a"))
    quiet = run_cli("run", "--device", "cpu", "--method", "ar", "--tree", "chain3", "--out", str(tmp_path / "b"))
    assert loud.exit_code == quiet.exit_code == 2
    assert "model demo:" in loud.stderr and "profile cpu" in loud.stderr
    assert quiet.stderr.strip().splitlines() == [loud.stderr.strip().splitlines()[-1]]
    assert quiet.stderr.startswith("error: --tree does nothing for --method ar")
    configure_logging(0)


def test_models_json(run_cli) -> None:
    result = run_cli("models", "--json")
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    by_name = {row["name"]: row for row in rows}
    assert by_name["GPT-B"]["kind"] == "gpt-c2i" and 100e6 < by_name["GPT-B"]["parameters"] < 120e6
    assert by_name["GPT-B"]["token_grids"] == ["16x16", "24x24"]
    assert "c2i_B_256.pt" in by_name["GPT-B"]["checkpoints"]
    assert all(isinstance(row["parameters"], int) and row["parameters"] > 0 for row in rows)


@pytest.mark.parametrize("command", ["run", "bench"])
def test_help_names_the_methods_that_read_each_flag(run_cli, command: str) -> None:
    result = run_cli(command, "--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())  # rich wraps help text across lines
    for panel in ("Model", "Device", "Method and sampling (every method)", "sjd only", "ddd only"):
        assert panel in text
    for key in ("tree", "depth", "lantern_delta", "lantern_lambda", "dynamic_depth"):
        assert f"Read by: {readers(key)}." in text
    assert readers("depth") == "sd, eagle2, lantern, cool-eagle2" and FLAG_METHODS["tree"] == {"lantern++", "cool-sd"}


def test_top_level_help_imports_no_torch() -> None:
    code = ("import sys\nfrom runtime.cli.app import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "NO-TORCH"


def test_bench_profile_is_refused_with_a_shape(run_cli, tmp_path: Path) -> None:
    result = run_cli("bench", "--shape", "llamagen-b", "--methods", "sd", "--tau", "2", "--profile",
                     "--out", str(tmp_path / "p.json"))
    assert result.exit_code == 2
    assert "--profile traces a measured bench" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory) -> Path:
    """GPT-tiny (4x4 tokens at 64 px) and a VQ-16 in LlamaGen's layout: a bench in seconds."""
    from tiny_models import save_tiny_official

    d = tmp_path_factory.mktemp("tiny")
    save_tiny_official(d, "c2i_tiny_64.pt", "vq_ds16_c2i.pt")
    return d


def test_bench_profile_writes_one_trace_per_run(run_cli, tiny_ckpts: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    result = run_cli("bench", "--gpt-model", "GPT-tiny", "--gpt-ckpt", str(tiny_ckpts / "c2i_tiny_64.pt"), "--vq-ckpt",
                     str(tiny_ckpts / "vq_ds16_c2i.pt"), "--image-size", "64", "--device", "cpu", "--no-graph", "--methods", "ar",
                     "--num-images", "2", "--repeats", "1", "--warmup", "0", "--no-quality", "--profile",
                     "--out", str(out))
    assert result.exit_code == 0, result.stderr
    traces = sorted((tmp_path / "b.traces").iterdir())
    assert [p.name for p in traces] == ["00.json.gz"]
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.grids", "b.json", "b.traces"]  # no staging left


def test_a_log_format_that_is_none_of_the_four_is_refused(run_cli) -> None:
    result = run_cli("--log-format", "xml", "models")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["error: --log-format / LANTERN_LOG_FORMAT 'xml': choose auto, rich, "
                                                  "plain, json"]


def test_off_a_terminal_every_record_is_one_line_with_its_utc_time(capsys) -> None:
    import re

    try:
        configure_logging(0)  # auto: stderr is captured here, no terminal
        logging.getLogger("runtime.serve").warning("draining:\n%d requests in flight", 3)
        logging.getLogger("runtime.serve").error("failed", exc_info=ValueError("bad\nvalue"))
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 2, lines
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING runtime\.serve: draining:\\n3 requests "
                            r"in flight", lines[0]), lines[0]
        assert "ERROR runtime.serve: failed\\n" in lines[1] and "ValueError: bad\\nvalue" in lines[1]
    finally:
        configure_logging(0)


def test_json_log_lines_carry_an_access_records_fields(capsys) -> None:
    pytest.importorskip("fastapi", reason="runtime serve needs the serve extra (in the test extra)")
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from runtime.serve.api import HttpOptions, create_app

    engine = SimpleNamespace(ready=None, decoder=None, stats=None, queue_depth=0, on_done=None)
    served = SimpleNamespace(version="V", method="-", names=["-"], in_flight=0, draining=False)
    try:
        configure_logging(1, "json")
        answer = TestClient(create_app(engine, served, HttpOptions())).get(  # type: ignore[arg-type]
            "/health", headers={"X-Request-ID": "rid-7"})
        assert answer.status_code == 200
        records = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        (access,) = [r for r in records if r.get("request_id") == "rid-7"]
        assert access["logger"] == "runtime.serve.access" and access["level"] == "INFO"
        assert access["status"] == 200 and access["http_method"] == "GET" and access["path"] == "/health"
        assert access["client"].startswith("testclient:") and access["time"].endswith("Z")
        assert access["seconds"] >= 0 and "rid-7" in access["message"]
    finally:
        configure_logging(0)
