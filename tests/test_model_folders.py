"""A model folder is untrusted input (issue 69, the parts done so far): Hub ids the Hub library
would reject and revisions that are paths are one line; a tokenizer that names code of its own is
refused and its code never runs, in a terminal or not; both tokenizer files are required; pjd's
released loop under sampling refuses a support filter it cannot keep; result files and /info name
the model's family."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BAD_IDS = ["x/y..z", "a--b/c", "a/b.git", "a/b-"]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    import hf_tiny

    hf_tiny.use_hub_cache(monkeypatch, tmp_path / "hf_home")


def one_line(res, *needles: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("bad", BAD_IDS)
def test_a_hub_id_the_hub_rejects_is_one_line_wherever_it_is_given(run_cli, offline, tmp_path, bad) -> None:
    out = str(tmp_path / "out")
    one_line(run_cli("run", "--model", bad, "--device", "cpu", "--out", out), f"--model {bad}: not a Hub id")
    one_line(run_cli("run", "--drafter", bad, "--device", "cpu", "--out", out), f"--drafter {bad}: not a Hub id")
    one_line(run_cli("train", "drafter", "--model", bad, "--out", out), f"--model {bad}: not a Hub id")
    one_line(run_cli("serve", "--model", bad, "--device", "cpu", "--port", "8765"), f"--model {bad}: not a Hub id")
    assert not Path(out).exists()


@pytest.mark.parametrize("revision", ["../..", "", "main/../..", " main"])
def test_a_revision_that_is_empty_or_a_path_is_one_line(run_cli, offline, tmp_path, revision) -> None:
    res = run_cli("run", "--model", "owner/name", "--model-revision", revision, "--device", "cpu",
                  "--out", str(tmp_path / "out"))
    one_line(res, "--model-revision", "not a branch, tag or commit")


def test_pjd_published_refuses_a_support_filter_it_cannot_keep(run_cli, tmp_path) -> None:
    base = ("run", "--method", "pjd", "--accept", "published", "--device", "cpu", "--num-images", "1")
    one_line(run_cli(*base, "--top-k", "5", "--out", str(tmp_path / "a")), "cannot keep top-k 5", "--top-k 0")
    one_line(run_cli(*base, "--top-p", "0.9", "--out", str(tmp_path / "b")), "cannot keep top-p 0.9")
    assert run_cli(*base, "--top-k", "5", "--greedy", "--out", str(tmp_path / "c")).exit_code == 0
    assert run_cli(*base, "--out", str(tmp_path / "d")).exit_code == 0  # the demo's default: no filter
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_result_files_name_the_family(run_cli, tmp_path) -> None:
    assert run_cli("run", "--method", "ar", "--device", "cpu", "--num-images", "1",
                   "--out", str(tmp_path / "o")).exit_code == 0
    assert json.loads((tmp_path / "o" / "result.json").read_text())["model"]["family"] == "c2i"


# -- prompted folders (the tiny Janus-Pro of tests/hf_tiny.py) ---------------------------------------

@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> dict[str, Path]:
    """Plain copies (no cache links) of the tiny Janus-Pro and Emu3 snapshots, by family."""
    pytest.importorskip("transformers")
    import hf_tiny

    made = hf_tiny.write_hub_cache(tmp_path_factory.mktemp("hf_home"))
    copies = {}
    for family, name in (("janus", "Janus-tiny"), ("emu3", "Emu3-tiny")):
        copies[family] = tmp_path_factory.mktemp(family) / name
        shutil.copytree(made[family][-1], copies[family], symlinks=False)
    return copies


@pytest.fixture(scope="module")
def janus_folder(snapshots) -> Path:
    return snapshots["janus"]


@pytest.fixture(scope="module")
def emu3_folder(snapshots) -> Path:
    return snapshots["emu3"]


def _copy(folder: Path, where: Path) -> Path:
    target = where / folder.name
    shutil.copytree(folder, target)
    return target


def _prompts(where: Path) -> str:
    (where / "prompts.txt").write_text("a red cat\n")
    return str(where / "prompts.txt")


def test_the_family_of_a_janus_folder(janus_folder) -> None:
    from runtime import ImageGenerator

    with ImageGenerator(str(janus_folder), device="cpu", graph=False, method="ar") as g:
        assert g.loaded.family == "janus" and g.loaded.config.model_type == "chameleon"


@pytest.mark.parametrize("missing", ["tokenizer_config.json", "tokenizer.json"])
def test_a_missing_tokenizer_file_is_refused(run_cli, janus_folder, tmp_path, missing) -> None:
    folder = _copy(janus_folder, tmp_path)
    (folder / missing).unlink()
    res = run_cli("run", "--model", str(folder), "--prompts", _prompts(tmp_path), "--method", "ar", "--device", "cpu",
                  "--out", str(tmp_path / "out"))
    one_line(res, f"no {missing}", "tokenizer.json and tokenizer_config.json")
    assert not (tmp_path / "out").exists()


def _with_remote_tokenizer(janus_folder: Path, where: Path) -> tuple[Path, Path]:
    """The folder with a tokenizer_config.json naming a .py of its own that writes a marker file."""
    folder = _copy(janus_folder, where)
    marker = where / "code_ran"
    (folder / "evil_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, marker


def test_a_tokenizer_with_code_of_its_own_is_refused_and_never_run(run_cli, janus_folder, tmp_path) -> None:
    folder, marker = _with_remote_tokenizer(janus_folder, tmp_path)
    res = run_cli("run", "--model", str(folder), "--prompts", _prompts(tmp_path), "--method", "ar", "--device", "cpu",
                  "--out", str(tmp_path / "out"))
    one_line(res, "names code of its own", "never runs")
    assert not marker.exists()


@pytest.mark.slow
def test_in_a_terminal_answering_yes_runs_no_code(janus_folder, tmp_path) -> None:
    """transformers asks "Do you wish to run the custom code? [y/N]" in a terminal when
    trust_remote_code is unset; the runtime never leaves it unset, so even a "y" typed at the
    terminal runs nothing."""
    folder, marker = _with_remote_tokenizer(janus_folder, tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LANTERN_GRAPH": "0", "COLUMNS": "200"}
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "run", "--model", str(folder), "--prompts",
                             _prompts(tmp_path), "--method", "ar", "--device", "cpu", "--out", str(tmp_path / "out")],
                            stdin=secondary, stdout=secondary, stderr=secondary, env=env, close_fds=True)
    os.close(secondary)
    output = b""
    deadline = time.time() + 180
    while proc.poll() is None and time.time() < deadline:
        ready, _, _ = select.select([primary], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(primary, 4096)
            except OSError:
                break
            output += chunk
            if b"[y/N]" in chunk:
                os.write(primary, b"y\n")
        else:
            os.write(primary, b"y\n")  # answer yes to anything asked, asked or not
    proc.wait(30)
    try:
        output += os.read(primary, 65536)
    except OSError:
        pass
    os.close(primary)
    text = output.decode(errors="replace")
    assert proc.returncode == 2, text
    assert "never runs" in text and "Traceback" not in text and b"[y/N]" not in output
    assert not marker.exists() and not (tmp_path / "out").exists()


TEMPLATES = {
    "raises": ("{{ raise_exception('no images today') }}", "chat template fails (TemplateError: no images today)"),
    "syntax": ("{% for m in messages %}{{ m['content'] }", "chat template is not valid Jinja"),
    "divides by zero": ("{{ 1 / 0 }}", "chat template fails (ZeroDivisionError"),
    "sandbox escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template fails (SecurityError"),
    "runaway output": ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
                       "renders more than"),
    "runaway loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "ran past"),
    "empty": ("", "renders a prompt without the prompt's text (empty)"),
    "drops the text": ("<|User|>: a picture", "without the prompt's text (the text is dropped)"),
}


@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_a_chat_template_that_misbehaves_is_one_line(run_cli, janus_folder, tmp_path, case) -> None:
    import resource

    folder = _copy(janus_folder, tmp_path)
    template, expected = TEMPLATES[case]
    (folder / "chat_template.jinja").write_text(template)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    res = run_cli("run", "--model", str(folder), "--prompts", _prompts(tmp_path), "--method", "ar", "--device", "cpu",
                  "--out", str(tmp_path / "out"))
    one_line(res, "chat template", expected)
    assert time.monotonic() - started < 60
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 1 << 20  # under 1 GiB more while refusing
    assert not (tmp_path / "out").exists()


# -- paths a folder names --------------------------------------------------------------------------

def test_a_sharded_index_naming_a_file_outside_the_folder_is_refused(run_cli, janus_folder, tmp_path) -> None:
    folder = _copy(janus_folder, tmp_path)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    res = run_cli("run", "--model", str(folder), "--prompts", _prompts(tmp_path), "--method", "ar", "--device", "cpu",
                  "--out", str(tmp_path / "out"))
    one_line(res, "model.safetensors.index.json", "'../../etc/passwd'", "not a file inside its folder")


@pytest.mark.parametrize("ref", ["", "../../../elsewhere", "/tmp"])
def test_a_cache_ref_that_names_no_snapshot_is_one_line(run_cli, tmp_path, monkeypatch, ref) -> None:
    pytest.importorskip("transformers")
    import hf_tiny

    home = tmp_path / "hf_home"
    hf_tiny.write_hub_cache(home)
    hf_tiny.use_hub_cache(monkeypatch, home)
    repo = home / "hub" / f"models--{hf_tiny.JANUS_ID.replace('/', '--')}"
    snapshot = next((repo / "snapshots").iterdir())
    shutil.copytree(snapshot, tmp_path / "elsewhere")  # a model outside the cache, which must not load
    (repo / "refs" / "main").write_text(ref)
    res = run_cli("run", "--model", hf_tiny.JANUS_ID, "--prompts", _prompts(tmp_path), "--method", "ar",
                  "--device", "cpu", "--out", str(tmp_path / "out"))
    one_line(res, f"--model {hf_tiny.JANUS_ID}", "snapshot is damaged", "refs/main")


# -- config fields that size tensors --------------------------------------------------------------------

def _set(config: dict, path: str, value) -> None:
    *parents, key = path.split(".")
    for part in parents:
        config = config[part]
    config[key] = value


CONFIG_CASES = [  # (family, field, value, what the line says)
    ("janus", "text_config.hidden_size", 10**9, "text_config.hidden_size must be an integer in [1, 65,536]"),
    ("janus", "text_config.intermediate_size", 10**9, "text_config.intermediate_size must be an integer"),
    ("janus", "text_config.num_hidden_layers", 10**6, "text_config.num_hidden_layers must be an integer"),
    ("janus", "text_config.hidden_size", 64.0, "got 64.0"),
    ("janus", "vq_config.num_embeddings", 10**10, "vq_config.num_embeddings must be an integer"),
    ("janus", "vq_config.num_embeddings", -1, "vq_config.num_embeddings must be an integer"),
    ("janus", "vq_config", [1, 2], "vq_config must be a JSON object"),
    ("janus", "vision_config.num_image_tokens", "many", "vision_config.num_image_tokens must be an integer"),
    ("janus", "text_config.rms_norm_eps", float("nan"), "text_config.rms_norm_eps must be a number in (0, 1)"),
    ("janus", "text_config.hidden_size", 65536, "GiB free"),  # in range, but past this machine's memory
    ("janus", "text_config.vocab_size", 0, "text_config.vocab_size must be an integer in [1, 16,777,216], got 0"),
    ("emu3", "text_config.rms_norm_eps", float("nan"), "text_config.rms_norm_eps must be a number in (0, 1)"),
    ("emu3", "vocabulary_map", [1, 2], "vocabulary_map must be a JSON object of token ids"),
    ("emu3", "vocabulary_map.<|visual token 000000|>", "x", "must be a token id"),
    ("emu3", "vocabulary_map.<|visual token 000000|>", 10**12, "must be a token id"),
]


@pytest.mark.parametrize("family,field,value,expected", CONFIG_CASES,
                         ids=[f"{f}-{k}-{v!r}" for f, k, v, _ in CONFIG_CASES])
def test_a_config_field_that_sizes_a_tensor_is_checked_before_anything_is_built(
        run_cli, janus_folder, emu3_folder, tmp_path, family, field, value, expected) -> None:
    import resource

    import hf_tiny

    folder = _copy(janus_folder if family == "janus" else emu3_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    if field.startswith("vocabulary_map.") and not isinstance(value, list):
        config["vocabulary_map"][field.split(".", 1)[1]] = value
    else:
        _set(config, field, value)
    (folder / "config.json").write_text(json.dumps(config))
    size = ("--image-size", str(hf_tiny.EMU3_GRID * 8)) if family == "emu3" else ()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = run_cli("run", "--model", str(folder), *size, "--prompts", _prompts(tmp_path), "--method", "ar",
                  "--device", "cpu", "--out", str(tmp_path / "out"))
    one_line(res, "config.json", expected)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB more
    assert not (tmp_path / "out").exists()


def test_a_config_nested_too_deep_is_one_line(run_cli, janus_folder, tmp_path) -> None:
    folder = _copy(janus_folder, tmp_path)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    res = run_cli("run", "--model", str(folder), "--prompts", _prompts(tmp_path), "--method", "ar", "--device", "cpu",
                  "--out", str(tmp_path / "out"))
    one_line(res, "config.json nests its JSON too deep")


# -- what a damaged folder is called -----------------------------------------------------------------

def _damage(folder: Path, how: str) -> None:
    config = folder / "config.json"
    if how == "empty folder":
        for item in folder.iterdir():
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    elif how == "no model_type":
        data = json.loads(config.read_text())
        del data["model_type"]
        config.write_text(json.dumps(data))
    elif how == "/dev/zero":
        config.unlink()
        config.symlink_to("/dev/zero")
    elif how == "dangling":
        config.unlink()
        config.symlink_to(folder / "nowhere.json")
    elif how == "a folder":
        config.unlink()
        config.mkdir()


DAMAGE = {"empty folder": "an empty folder", "no model_type": "names no model_type",
          "/dev/zero": "config.json is not a regular file", "dangling": "config.json is a link to nothing",
          "a folder": "config.json is a folder"}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_folder_is_named_for_what_it_lacks(run_cli, janus_folder, tmp_path, how) -> None:
    folder = _copy(janus_folder, tmp_path)
    _damage(folder, how)
    res = run_cli("run", "--model", str(folder), "--prompts", _prompts(tmp_path), "--device", "cpu",
                  "--out", str(tmp_path / "out"))
    one_line(res, DAMAGE[how])
    assert "manifest.json)" not in res.stderr or how == "no model_type"


def test_an_empty_model_path_is_named_as_empty(run_cli, tmp_path) -> None:
    one_line(run_cli("run", "--model", "", "--device", "cpu", "--out", str(tmp_path / "o")), "--model is empty")
    one_line(run_cli("run", "--drafter", " ", "--device", "cpu", "--out", str(tmp_path / "o")), "--drafter is empty")


@pytest.mark.parametrize("size,expected", [(0, "--image-size 0: Emu3 makes images in steps of"),
                                           (10**6, "does not fit this model's"),
                                           (4000, "does not fit this model's")])
def test_an_emu3_image_size_it_cannot_make_is_one_line(run_cli, emu3_folder, tmp_path, size, expected) -> None:
    res = run_cli("run", "--model", str(emu3_folder), "--image-size", str(size), "--prompts", _prompts(tmp_path),
                  "--device", "cpu", "--out", str(tmp_path / "out"))
    one_line(res, expected)
    assert "RoPE table" not in res.stderr


def test_a_chameleon_configs_sizes_are_checked_too(tmp_path) -> None:
    from runtime.models.config_checks import check_config_fields
    from runtime.utils.errors import UserError

    with pytest.raises(UserError, match=r"config.json: hidden_size must be an integer in \[1, 65,536\], got 64.0"):
        check_config_fields({"model_type": "chameleon", "hidden_size": 64.0}, tmp_path, flat=True)
    with pytest.raises(UserError, match=r"config.json: num_hidden_layers must be an integer"):
        check_config_fields({"model_type": "chameleon", "num_hidden_layers": 10**6}, tmp_path, flat=True)
    with pytest.raises(UserError, match=r"vq_config.embed_dim must be an integer"):
        check_config_fields({"model_type": "chameleon", "vq_config": {"embed_dim": -1}}, tmp_path, flat=True)


def test_a_model_bigger_than_the_devices_free_memory_is_refused_before_it_is_moved(janus_folder) -> None:
    """The bytes the target, drafter and VQ take in the run's dtype against what the device reports
    free (a GPU's `mem_get_info`; passed in here, as `ModelSource.load` passes the backend's)."""
    from runtime.generation.loading import load_model
    from runtime.utils.errors import UserError

    args = dict(model=str(janus_folder), gpt_model=None, gpt_ckpt=None, vq_ckpt=None, image_size=None, drafter=None,
                gpt_type="c2i", trust=False, device=torch.device("cpu"))
    with pytest.raises(UserError, match=r"Janus-tiny: the model takes about 0.0 GiB in bfloat16 and cpu has 0.0 GiB "
                                        r"free; free the device \(other processes\), use a lower-precision --dtype"):
        load_model(**args, dtype=torch.bfloat16, device_free=1000)
    loaded = load_model(**args, dtype=torch.float32, device_free=1 << 30)
    assert next(loaded.target.parameters()).dtype == torch.float32


class _RunsCode:
    """Unpickled, runs `touch` on its path: the marker that code from a weight file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_weight_file_that_would_run_code_is_one_line_without_warnings(janus_folder, tmp_path) -> None:
    """A protocol-4 pickle (torch's safe loader warns about the protocol before refusing it), in a
    real process: one line, no torch warning before it, and its code never ran."""
    import pickle

    folder = _copy(janus_folder, tmp_path)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(marker), protocol=4))
    res = subprocess.run([sys.executable, "-m", "runtime", "run", "--model", str(folder), "--prompts",
                          _prompts(tmp_path), "--method", "ar", "--device", "cpu", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: cannot read checkpoint {folder / 'pytorch_model.bin'}: not a PyTorch checkpoint (a pickle the safe "
        "loader refuses: Unsupported operand 149)"], res.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
