"""Exit codes through a real process: 0 done, 1 a failed check, 2 bad input, 128 + N for signal N,
and no staging folder left behind by a stopped run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

RUNTIME = [sys.executable, "-m", "runtime"]


def test_bad_input_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([*RUNTIME, "run", "--device", "cpu", "--num-images", "0", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --num-images must be >= 1, got 0"]
    assert not (tmp_path / "o").exists()


def test_a_failed_selfcheck_exits_1(tmp_path):
    """The command's own `typer.Exit(1)` must reach the process exit code (non-standalone typer returns it)."""
    code = (
        "import runtime.tools.selfcheck as s\n"
        "s.run_selfcheck = lambda backend, **kw: s.SelfcheckReport(device={'name': 'cpu'}, "
        "checks=[s.Check('forced', False, 'made to fail by the test')])\n"
        "from runtime.cli.app import main\n"
        f"main(['selfcheck', '--device', 'cpu', '--out', {str(tmp_path / 'sc.json')!r}])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "selfcheck failed: forced" in proc.stderr and (tmp_path / "sc.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_mid_run_exits_128_plus_n_and_leaves_nothing(tmp_path, sig, code):
    out = tmp_path / "out"
    # SIGINT ignored by the parent (as a shell does for a background job) must still stop the run
    restore = signal.signal(signal.SIGINT, signal.SIG_IGN) if sig == signal.SIGINT else None
    try:
        proc = subprocess.Popen([*RUNTIME, "run", "--device", "cpu", "--num-images", "24", "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        if restore is not None:
            signal.signal(signal.SIGINT, restore)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".out.") for p in tmp_path.iterdir()):  # generating into the staging folder
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == (f"interrupted by {signal.Signals(sig).name}: stopped; "
                                            "nothing half-written was left")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither --out nor its staging folder


def test_a_completed_command_exits_0():
    proc = subprocess.run([*RUNTIME, "models", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().startswith(("[", "{"))


@pytest.mark.parametrize("argv, message", [
    (("run", "--num-images", "1000000000", "--out", "OUT"), "use runtime sample"),
    (("bench", "--num-images", "1000000000", "--out", "OUT/b.json"), "use runtime sample"),
    (("sample", "--num-images", "1000000000", "--out", "OUT"), "split the work"),
    (("run", "--out", ""), "--out is empty"),
    (("run", "--method", "lantern+", "--out", "OUT"), "(did you mean 'lantern++'?)"),
    (("bench", "--methods", "ar,egle2", "--out", "OUT/b.json"), "(did you mean 'eagle2'?)"),
    (("run", "--gpt-model", "GPT-xl", "--gpt-ckpt", "OUT.pt", "--vq-ckpt", "OUT.pt", "--out", "OUT"),
     "(did you mean 'GPT-XL'?)"),
])
def test_hostile_sizes_and_paths_are_one_line(tmp_path, argv, message):
    argv = [a.replace("OUT", str(tmp_path / "o")) for a in argv]
    proc = subprocess.run([*RUNTIME, *argv, "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_batch_wider_than_the_images_is_capped(tmp_path):
    out = tmp_path / "o"
    proc = subprocess.run([*RUNTIME, "run", "--device", "cpu", "--method", "ar", "--num-images", "2",
                           "--batch-size", "10000", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "result.json").read_text())["batch_size"] == 2


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "must hold a JSON object (a model config), found a JSON list"),
    ("{not json", "is not valid JSON"),
])
def test_a_chameleon_folder_with_a_broken_config_is_named(tmp_path, content, message):
    from runtime.utils.errors import UserError
    from runtime.models.chameleon_folder import read_config

    (tmp_path / "config.json").write_text(content)
    with pytest.raises(UserError, match=re.escape(message)):
        read_config(tmp_path)


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("hidden_size", "big")])
def test_chameleon_config_fields_are_checked(field, value):
    import torch

    from runtime.utils.errors import UserError
    from runtime.models.chameleon import config_from_hf

    cfg = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
           "intermediate_size": 64, field: value}
    with pytest.raises(UserError, match=f"{field} must be a positive integer"):
        config_from_hf(cfg, torch.arange(8), 16)


def test_a_bundle_part_outside_the_bundle_is_refused(tmp_path):
    from runtime.utils.errors import UserError
    from runtime.models.loading import BUNDLE_MANIFEST, read_bundle

    (tmp_path / "outside.safetensors").write_bytes(b"")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / BUNDLE_MANIFEST).write_text(json.dumps({"format": "lantern-runtime-bundle", "version": 1,
                                                      "parts": {"gpt": {"file": "../outside.safetensors"}}}))
    with pytest.raises(UserError, match="lies outside the bundle folder"):
        read_bundle(bundle)


def test_tune_refuses_a_folder_and_an_unwritable_place_before_calibrating(tmp_path):
    folder = tmp_path / "x.toml"
    folder.mkdir()
    proc = subprocess.run([*RUNTIME, "tune", "--device", "cpu", "--force", "--out", str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "is a folder" in proc.stderr and "--force" not in proc.stderr.split("folder")[1]
    blocked = tmp_path / "file"
    blocked.write_text("a file where a folder goes")
    proc = subprocess.run([*RUNTIME, "tune", "--device", "cpu", "--out", str(blocked / "p.toml")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot write --out") and "Traceback" not in proc.stderr


def test_an_empty_tokens_file_is_one_line(tmp_path):
    from types import SimpleNamespace

    import numpy as np

    from runtime.cli.train_drafter_any import _load_labelled_tokens
    from runtime.utils.errors import UserError

    np.save(tmp_path / "t.npy", np.zeros((0, 16), dtype=np.int64))
    np.save(tmp_path / "l.npy", np.zeros((0,), dtype=np.int64))
    target = SimpleNamespace(config=SimpleNamespace(block_size=16, vocab_size=32, num_classes=5))
    with pytest.raises(UserError, match="holds no rows"):
        _load_labelled_tokens(str(tmp_path / "t.npy"), str(tmp_path / "l.npy"), target)
