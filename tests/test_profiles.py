"""Hardware profiles: the shipped ones validate, malformed ones are refused naming file and key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.utils.errors import UserError
from runtime.config.method_options import METHODS
from runtime.config.profiles import (
    Profile,
    default_profile_for,
    default_profile_name,
    load_profile,
    parse_profile,
    shipped_profiles,
)

SHIPPED = ("cpu", "rtx3090", "h100", "gaudi2")

VALID = """\
description = "test profile"

[device]
dtype = "bf16"
graph = true

[tree]
name = "naive_extend_57"

[method]
name = "lantern++"
lantern_k = 1000
lantern_lambda = 2
top_k_draft = 10

[bench]
warmup = 2
repeats = 5
"""


def write_profile(tmp_path: Path, text: str, name: str = "x.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_four_targets_are_shipped() -> None:
    assert set(SHIPPED) <= set(shipped_profiles())


@pytest.mark.parametrize("name", shipped_profiles())
def test_every_shipped_profile_validates(name: str) -> None:
    profile = load_profile(name)
    assert isinstance(profile, Profile)
    assert profile.name == name
    assert profile.source == f"profiles/{name}.toml"
    assert profile.bench.repeats >= 1 and profile.bench.warmup >= 0
    assert profile.tree.name


def test_shipped_profiles_hold_the_agreed_hardware_settings() -> None:
    assert load_profile("cpu").device.torch_dtype == torch.float32
    for name in ("rtx3090", "h100", "gaudi2"):
        profile = load_profile(name)
        assert (profile.device.dtype, profile.device.graph, profile.tree.name) == ("bf16", True, "naive_extend_57")
    assert load_profile("gaudi2").device.hpu_lazy_mode is False  # eager + hpu_backend, Intel's default


def test_a_valid_file_loads_with_its_values(tmp_path: Path) -> None:
    profile = load_profile(write_profile(tmp_path, VALID))
    assert profile.name == "x"
    assert profile.method.name == "lantern++"
    assert profile.method.pinned() == {"lantern_k": 1000, "lantern_lambda": 2.0, "top_k_draft": 10}
    assert isinstance(profile.method.lantern_lambda, float)
    assert profile.bench.repeats == 5
    assert profile.to_dict()["device"] == {"dtype": "bf16", "graph": True, "hpu_mode": None, "batch_size": 1}


def test_a_profile_may_set_the_batch_size(tmp_path: Path) -> None:
    profile = load_profile(write_profile(tmp_path, VALID.replace("graph = true", "graph = true\nbatch_size = 8")))
    assert profile.device.batch_size == 8


def test_a_profile_may_pin_the_cfg_interval(tmp_path: Path) -> None:
    profile = load_profile(write_profile(tmp_path, VALID.replace("top_k_draft = 10", "cfg_interval = 20")))
    assert profile.method.pinned() == {"lantern_k": 1000, "lantern_lambda": 2.0, "cfg_interval": 20}


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("lantern_k = 1000", "lamda = 2", "unknown key 'method.lamda' (known: name, greedy, temperature"),
        ('dtype = "bf16"', 'dtype = "int8"', "'device.dtype' must be one of 'bf16', 'fp16', 'fp32', got 'int8'"),
        ("graph = true", 'graph = "yes"', "'device.graph' must be true or false, got 'yes'"),
        ("graph = true", "graph = true\nbatch_size = 0", "'device.batch_size' must be an integer >= 1, got 0"),
        ("repeats = 5", "repeats = -3", "'bench.repeats' must be an integer >= 1, got -3"),
        ("warmup = 2", "warmup = 1.5", "'bench.warmup' must be an integer >= 0, got 1.5"),
        ("lantern_k = 1000", "lantern_k = true", "'method.lantern_k' must be an integer >= 1, got True"),
        ("lantern_lambda = 2", "lantern_lambda = 0.5", "'method.lantern_lambda' must be a number >= 1"),
        ('name = "lantern++"', 'name = "medusa"',
         "'method.name' must be one of " + ", ".join(repr(m) for m in METHODS) + ", got 'medusa'"),
        ("top_k_draft = 10", "top_p = 0", "'method.top_p' must be a number in (0, 1], got 0"),
        ("top_k_draft = 10", "cfg_interval = -2", "'method.cfg_interval' must be an integer >= -1, got -2"),
        ("repeats = 5", "", "missing key 'bench.repeats'"),
        ("[tree]", "[trees]", "unknown key 'trees' (known: description, device, tree, method, bench, auto, roof, quality)"),
        ('description = "test profile"', "description = 3", "'description' must be a string"),
        ("graph = true", "graph = ", "not valid TOML"),
        ("lantern_k = 1000", 'lantern_k = "1000"', "'method.lantern_k' must be an integer >= 1, got '1000'"),
        ("repeats = 5", "repeats = 5.0", "'bench.repeats' must be an integer >= 1, got 5.0"),
        ("lantern_lambda = 2", "lantern_lambda = true", "'method.lantern_lambda' must be a number >= 1, got True"),
        ("lantern_lambda = 2", 'lantern_lambda = "2"', "'method.lantern_lambda' must be a number >= 1, got '2'"),
        ("lantern_lambda = 2", "lantern_lambda = inf", "'method.lantern_lambda' must be a number >= 1, got inf"),
        ("top_k_draft = 10", "greedy = 1", "'method.greedy' must be true or false, got 1"),
        ('name = "naive_extend_57"', 'name = "  "', "'tree.name' must be a non-empty string, got '  '"),
        ("[bench]", "[bench.extra]", "unknown key 'bench.extra' (known: warmup, repeats)"),
    ],
)
def test_a_malformed_profile_is_refused_naming_file_and_key(tmp_path: Path, old: str, new: str, expected: str) -> None:
    assert old in VALID
    path = write_profile(tmp_path, VALID.replace(old, new, 1))
    with pytest.raises(UserError) as caught:
        load_profile(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert "\n" not in message


def test_a_missing_section_is_refused(tmp_path: Path) -> None:
    text = VALID[: VALID.index("[bench]")]
    with pytest.raises(UserError, match=r"x\.toml: missing section \[bench\]"):
        load_profile(write_profile(tmp_path, text))


def test_a_section_that_is_not_a_table_is_refused() -> None:
    text = 'bench = 3\n' + VALID[VALID.index("[device]") : VALID.index("[bench]")]
    with pytest.raises(UserError, match="mem.toml: 'bench' must be a table"):
        parse_profile(text, source="mem.toml", name="mem")


def test_schema_rejects_every_unknown_key_in_every_section() -> None:
    for section in ("device", "tree", "method", "bench"):
        text = VALID.replace(f"[{section}]", f"[{section}]\nbogus = 1", 1)
        with pytest.raises(UserError, match=f"unknown key '{section}.bogus'"):
            parse_profile(text, source="mem.toml", name="mem")


def test_unknown_names_and_missing_files_are_refused_with_the_choices() -> None:
    with pytest.raises(UserError, match=r"unknown profile 'a100' \(shipped: cpu, (.+, )?gaudi2, h100, rtx3090"):
        load_profile("a100")
    with pytest.raises(UserError, match="profile file 'nowhere/p.toml' not found"):
        load_profile("nowhere/p.toml")


def test_a_tree_path_is_resolved_next_to_the_profile(tmp_path: Path) -> None:
    text = VALID.replace('name = "naive_extend_57"', 'name = "trees/mine.json"')
    profile = load_profile(write_profile(tmp_path, text))
    assert Path(profile.tree.name) == tmp_path.resolve() / "trees" / "mine.json"
    assert load_profile(write_profile(tmp_path, VALID)).tree.name == "naive_extend_57"  # presets stay names


@pytest.mark.parametrize(
    ("backend", "device_name", "expected"),
    [
        ("cpu", "AMD EPYC", "cpu"),
        ("cuda", "NVIDIA H100 80GB HBM3", "h100"),
        ("cuda", "NVIDIA H200", "h100"),
        ("cuda", "NVIDIA GeForce RTX 3090", "rtx3090"),
        ("cuda", "NVIDIA A100-SXM4-40GB", "rtx3090"),
        ("hpu", "GAUDI2", "gaudi2"),
    ],
)
def test_default_profile_follows_the_detected_device(backend: str, device_name: str, expected: str) -> None:
    assert default_profile_name(backend, device_name) == expected
    assert default_profile_for(backend, device_name).name == expected


def test_installed_package_ships_the_profiles(tmp_path: Path) -> None:
    """importlib.resources finds the TOMLs in the *installed* package (run outside the checkout)."""
    probe = (
        "import importlib.resources as r, profiles, runtime.config.profiles as p; "
        "print(profiles.__path__[0]); print(' '.join(p.shipped_profiles())); "
        "[p.load_profile(n) for n in p.shipped_profiles()]"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    completed = subprocess.run(
        [sys.executable, "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    if completed.returncode != 0 and "No module named" in completed.stderr:
        pytest.skip("lantern-runtime is not installed in this environment (pip install .)")
    assert completed.returncode == 0, completed.stderr
    _location, names = completed.stdout.strip().splitlines()[-2:]
    assert set(SHIPPED) <= set(names.split())
