"""Bad input is refused in one line with exit code 2, and nothing is written (issue 21).

Each case states the input, the words its message must carry, and what must stay untouched.
The docs' "Refused inputs" page (docs/refusals.md) lists the same cases.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from runtime.utils.errors import UserError
from runtime.models.configs import gpt_config
from runtime.models.gpt import Transformer
from tiny_models import save_tiny_official

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    """GPT-tiny (4x4 tokens at 64 px) and VQ-16 in LlamaGen's layout, plus broken variants."""
    d = tmp_path_factory.mktemp("ckpt")
    state = save_tiny_official(d, "c2i_tiny.pt", "vq_ds16_c2i.pt").state_dict()
    nan = dict(state, **{"output.weight": state["output.weight"].clone().fill_(float("nan"))})
    torch.save({"model": nan}, d / "nan.pt")
    torch.save({"model": dict(state, **{"norm.weight": state["norm.weight"].to(torch.int32)})}, d / "int32.pt")
    torch.save({"model": dict(state, **{"norm.weight": state["norm.weight"] > 0})}, d / "bool.pt")
    t2i = Transformer(gpt_config("GPT-tiny", model_type="t2i", image_size=64, vocab_size=16384))
    t2i.init_weights()
    torch.save({"model": t2i.state_dict()}, d / "t2i_tiny.pt")
    return d


def official(ckpts: Path, gpt: str = "c2i_tiny.pt") -> list[str]:
    return ["--gpt-model", "GPT-tiny", "--gpt-ckpt", str(ckpts / gpt), "--vq-ckpt", str(ckpts / "vq_ds16_c2i.pt"),
            "--image-size", "64", "--device", "cpu"]


def refused(res, *words: str) -> None:
    """Exit 2, one line on stderr starting with `error:`, carrying every word, no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("gpt, words", [
    ("nan.pt", ("'output.weight' holds", "NaN or infinite")),
    ("int32.pt", ("'norm.weight' is stored as int32", "float32")),
    ("bool.pt", ("'norm.weight' is stored as bool",)),
])
def test_weights_that_are_not_finite_floats_are_refused_at_load(ckpts, tmp_path, run_cli, gpt, words):
    out = tmp_path / "out"
    refused(run_cli("run", *official(ckpts, gpt), "--method", "ar", "--num-images", "1", "--out", str(out)), *words)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", [["--gpt-model", "GPT-B"], ["--vq-ckpt", "vq.pt"], ["--drafter", "d"],
                                  ["--trust-checkpoint"], ["--gpt-type", "t2i"]])
def test_model_flags_without_gpt_ckpt_are_refused(tmp_path, run_cli, flag):
    out = tmp_path / "out"
    res = run_cli("run", *flag, "--num-images", "1", "--out", str(out))
    refused(res, f"{flag[0]} applies to official checkpoints only", "--gpt-ckpt")
    assert not out.exists()


@pytest.mark.parametrize("field, value, words", [
    ("num_attention_heads", 0, "num_attention_heads must be an integer in [1, 1,024], got 0"),
    ("num_hidden_layers", -1, "num_hidden_layers must be an integer in [1, 1,024], got -1"),
    ("vocab_size", "many", "vocab_size must be an integer in [1, 16,777,216], got 'many'"),
    ("hidden_size", 64.0, "hidden_size must be an integer in [1, 65,536], got 64.0"),
    ("hidden_size", 10**9, "hidden_size must be an integer in [1, 65,536], got 1000000000"),
    ("block_size", True, "block_size must be an integer"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps must be a number in (0, 1), got nan"),
    ("rope_base", -1, "rope_base must be a number in (0, 1e+12), got -1"),
    ("class_dropout_p", 2, "class_dropout_p must be a number in [0, 1], got 2"),
])
def test_hf_config_fields_out_of_range_are_refused(field, value, words):
    from runtime.models.loading import gpt_config_from_hf

    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 192,
           "vocab_size": 32, "block_size": 16, "input_type": "c2i", field: value}
    with pytest.raises(UserError, match="config.json: ") as err:
        gpt_config_from_hf(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("hidden_size", -64), ("vocab_size", 0),
                                          ("intermediate_size", 192.5), ("num_hidden_layers", 10**7)])
def test_drafter_config_fields_out_of_range_are_refused(field, value):
    from runtime.models.loading import drafter_config_from_json

    cfg = {"hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 2, "vocab_size": 32,
           "block_size": 16, "cls_token_num": 1, field: value}
    with pytest.raises(UserError, match=f"config.json: {field} must be an integer in \\[1, "):
        drafter_config_from_json(cfg)


def test_a_llamagen_config_bigger_than_the_host_is_refused_before_it_is_built(monkeypatch):
    """Sizes each within bounds whose product no host holds: refused by the bytes estimate."""
    from runtime.models import config_checks
    from runtime.models.loading import drafter_config_from_json, gpt_config_from_hf

    monkeypatch.setattr(config_checks, "host_free_bytes", lambda: 8 * 2**30)
    big = {"hidden_size": 32768, "num_hidden_layers": 1024, "num_attention_heads": 256, "intermediate_size": 87552,
           "vocab_size": 16384, "block_size": 256, "input_type": "c2i"}
    with pytest.raises(UserError, match=r"the model it describes takes about [\d,.]+ GiB \(hidden_size 32768, "
                                        r"num_hidden_layers 1024.*8.0 GiB free") as err:
        gpt_config_from_hf(big)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="the drafter it describes takes about"):
        drafter_config_from_json({**big, "cls_token_num": 1})


def test_gpt_vocabulary_larger_than_the_codebook_is_refused(ckpts, tmp_path, run_cli, make_tiny_gpt):
    from runtime.models.loading import hf_config_from_gpt, official_to_hf_llamagen, write_json, write_safetensors

    torch.manual_seed(0)
    gpt = Transformer(gpt_config("GPT-tiny", image_size=64, vocab_size=20000))
    folder = tmp_path / "hf"
    folder.mkdir()
    write_json(folder / "config.json", hf_config_from_gpt(gpt.config))
    write_safetensors(folder / "model.safetensors", official_to_hf_llamagen(gpt.state_dict()))
    out = tmp_path / "out"
    res = run_cli("run", "--gpt-ckpt", str(folder), "--vq-ckpt", str(ckpts / "vq_ds16_c2i.pt"), "--device", "cpu",
                  "--method", "ar", "--num-images", "1", "--out", str(out))
    refused(res, "the GPT has 20000 tokens but the VQ codebook has 16384 entries")
    assert not out.exists()


@pytest.mark.parametrize("flags, words", [
    (["--method", "lantern", "--lantern-delta", "2"], "--lantern-delta must be a finite number in [0, 1], got 2.0"),
    (["--cfg", "inf"], "--cfg must be a finite number >= 0, got inf"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--method", "lantern++", "--lantern-lambda", "inf"], "--lantern-lambda must be a finite number"),
    (["--method", "eagle2", "--top-k-draft", "1000000000000"], "--top-k-draft must be an integer in [1, 64], got 1000000000000"),
    (["--method", "eagle2", "--total-tokens", "5000"], "--total-tokens must be an integer in [2, 1025], got 5000"),
    (["--method", "lantern++", "--tree", "chain1000000000000"], "chain depth must be in [1, 32]"),
    (["--method", "lantern++", "--relax-rule", "loose"], "--relax-rule must be one of paper, bounded"),
    (["--method", "eagle2", "--relax-rule", "bounded"], "--relax-rule does nothing for --method eagle2"),
    (["--method", "sjd", "--relax-rule", "bounded"], "--relax-rule does nothing for exact sjd"),
])
def test_values_out_of_their_domain_are_refused(ckpts, tmp_path, run_cli, flags, words):
    out = tmp_path / "out"
    refused(run_cli("run", *official(ckpts), *flags, "--num-images", "1", "--out", str(out)), words)
    assert not out.exists()


def tree_file(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "tree.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("content, words", [
    (b"paths = [[0]]\n# \xff\xfe\n", "is not UTF-8 text"),
    ("paths = [" + ", ".join(f"[{r}]" for r in range(1025)) + "]\n", "1025 nodes; a tree has at most 1024"),
    ("paths = [" + ", ".join("[" + ", ".join(["0"] * d) + "]" for d in range(1, 34)) + "]\n",
     "depth 33; a tree is at most 32 deep"),
    ("paths = [[0], [1000000000000]]\n", "path [1000000000000] has no sibling [999999999999]"),
])
def test_tree_files_out_of_range_or_not_text_are_refused(ckpts, tmp_path, run_cli, content, words):
    path = tree_file(tmp_path, content)
    out = tmp_path / "out"
    res = run_cli("run", *official(ckpts), "--method", "lantern++", "--tree", str(path), "--num-images", "1",
                  "--out", str(out))
    refused(res, words)
    assert not out.exists()


def test_a_tree_rank_at_or_above_the_vocabulary_is_refused(tmp_path):
    from runtime.core import Decoder, MethodSpec
    from tiny_models import tiny_pair

    target, drafter = tiny_pair(vocab=8)
    path = tree_file(tmp_path, "paths = [" + ", ".join(f"[{r}]" for r in range(9)) + "]\n")
    with pytest.raises(UserError, match="gives a node 9 children .* only 8 tokens"):
        Decoder(target, drafter, MethodSpec(method="lantern++", tree=str(path), lantern_lambda=1.0))


def test_a_prompt_file_that_is_not_utf8_is_refused(ckpts, tmp_path, run_cli):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a red fox\n\xff\xfe\n")
    out = tmp_path / "out"
    args = official(ckpts, "t2i_tiny.pt")
    res = run_cli("run", *args, "--gpt-type", "t2i", "--method", "ar", "--prompts", str(prompts), "--t5-path",
                  str(tmp_path), "--out", str(out))
    refused(res, "--prompts", "not UTF-8 text")
    assert not out.exists()


# -- the file system ------------------------------------------------------------------------------

def tiny_run(ckpts: Path, out: Path, *extra: str) -> list[str]:
    return ["run", *official(ckpts), "--method", "ar", "--num-images", "1", "--out", str(out), *extra]


def test_run_out_holding_an_earlier_run_is_refused_without_force_and_replaced_whole_with_it(ckpts, tmp_path,
                                                                                            run_cli):
    out = tmp_path / "out"
    assert run_cli(*tiny_run(ckpts, out, "--num-images", "3")).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert any(n.startswith("image_0002") for n in before)

    refused(run_cli(*tiny_run(ckpts, out)), "holds an earlier run", "--force")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    res = run_cli(*tiny_run(ckpts, out, "--force"))
    assert res.exit_code == 0, res.stderr
    names = sorted(p.name for p in out.iterdir())
    assert not any(n.startswith(("image_0001", "image_0002")) for n in names), names  # no earlier image left
    assert json.loads((out / "result.json").read_text())["num_images"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or old copy left beside


def test_run_out_folder_of_other_files_is_refused_even_with_force(ckpts, tmp_path, run_cli):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    refused(run_cli(*tiny_run(ckpts, out, "--force")), "holds files that are not a run")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_run_out_that_is_a_file_is_refused(ckpts, tmp_path, run_cli):
    out = tmp_path / "file"
    out.write_text("x")
    refused(run_cli(*tiny_run(ckpts, out)), "exists and is not a folder")
    assert out.read_text() == "x"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(ckpts, tmp_path, run_cli, monkeypatch, code):
    import numpy as np

    def fail(*args, **kwargs):
        raise OSError(code, __import__("os").strerror(code))

    monkeypatch.setattr(np, "save", fail)  # tokens.npy is written after the images
    out = tmp_path / "out"
    refused(run_cli(*tiny_run(ckpts, out)), "cannot write --out", __import__("os").strerror(code))
    assert list(tmp_path.iterdir()) == []  # no staging folder left behind


def test_run_out_under_a_path_that_cannot_be_created_is_one_line(ckpts, tmp_path, run_cli):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refused(run_cli(*tiny_run(ckpts, blocker / "sub" / "out")), "cannot write --out")


def test_bench_out_naming_a_folder_is_refused(tmp_path, run_cli):
    res = run_cli("bench", "--methods", "ar", "--num-images", "1", "--repeats", "1", "--warmup", "0",
                  "--out", str(tmp_path))
    refused(res, "is a folder; --out names the result file")
    assert list(tmp_path.iterdir()) == []


def test_cache_variable_naming_a_file_is_refused(ckpts, tmp_path, run_cli, monkeypatch):
    cache = tmp_path / "cache"
    cache.write_text("x")
    monkeypatch.setenv("LANTERN_RUNTIME_CACHE", str(cache))
    out = tmp_path / "out"
    res = run_cli("run", *official(ckpts), "--method", "sjd", "--lantern-lambda", "2", "--num-images", "1",
                  "--out", str(out))
    refused(res, "LANTERN_RUNTIME_CACHE=", "point it at a writable folder")
    assert not out.exists()


def test_eval_of_a_run_whose_records_carry_a_non_numeric_class_is_refused(ckpts, tmp_path, run_cli):
    out = tmp_path / "out"
    assert run_cli(*tiny_run(ckpts, out, "--num-images", "2")).exit_code == 0
    result = json.loads((out / "result.json").read_text())
    result["images"][1]["class"] = "cat"
    (out / "result.json").write_text(json.dumps(result))
    refused(run_cli("eval", str(out)), "has class 'cat', expected an integer >= 0")


def test_eval_of_a_run_whose_records_carry_a_non_numeric_index_is_refused(ckpts, tmp_path, run_cli):
    out = tmp_path / "out"
    assert run_cli(*tiny_run(ckpts, out, "--num-images", "2")).exit_code == 0
    result = json.loads((out / "result.json").read_text())
    result["images"][0]["index"] = "x"
    (out / "result.json").write_text(json.dumps(result))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    refused(run_cli("eval", str(out)), "has index 'x', expected an integer >= 0")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before


# -- NaN / inf met while decoding ------------------------------------------------------------------

@pytest.mark.parametrize("method, greedy", [("ar", True), ("lantern++", False), ("eagle2", True)])
def test_nan_logits_while_decoding_stop_and_name_the_part_and_first_token(method, greedy):
    from runtime.core import Decoder, MethodSpec, SamplingParams
    from runtime.core.slots import NonFiniteError
    from tiny_models import tiny_pair

    target, drafter = tiny_pair(vocab=8, grid=4)
    calls = {"n": 0}
    plain = target.logits

    def logits(hidden):  # the target turns NaN from its 4th call on (prefill's is the 1st)
        calls["n"] += 1
        out = plain(hidden)
        return out * float("nan") if calls["n"] >= 4 else out

    target.logits = logits
    spec = MethodSpec(method=method, sampling=SamplingParams(greedy=greedy), tree="chain3", lantern_lambda=1.0,
                      depth=2, top_k_draft=3, total_tokens=8)
    decoder = Decoder(target, drafter, spec)
    with pytest.raises(NonFiniteError, match=r"the target model produced NaN or infinite logits for image 0 "
                                             r"at image token \d+ \(float32\)") as err:
        decoder.generate_one(torch.tensor([1]), seed=0)
    position = int(str(err.value).split("image token ")[1].split()[0])
    assert 1 <= position < 16


def test_nan_drafter_distribution_under_sampling_is_named():
    from runtime.core import Decoder, MethodSpec, SamplingParams
    from runtime.core.slots import NonFiniteError
    from tiny_models import tiny_pair

    target, drafter = tiny_pair(vocab=8, grid=4)
    with torch.no_grad():
        drafter.fc.weight.fill_(float("nan"))
    spec = MethodSpec(method="lantern++", sampling=SamplingParams(greedy=False), tree="chain3", lantern_lambda=1.0)
    with pytest.raises(NonFiniteError, match="the drafter produced NaN or infinite logits for image 0 at image token 1"):
        Decoder(target, drafter, spec).generate_one(torch.tensor([1]), seed=0)


@pytest.mark.parametrize("part, key, value", [("gpt", "n_head", 0), ("drafter", "num_attention_heads", -1),
                                              ("vq", "codebook_size", 0)])
def test_a_bundle_whose_model_config_is_out_of_range_is_refused(tmp_path, run_cli, part, key, value):
    import shutil

    from runtime.demo.bundle import default_bundle_path

    bundle = tmp_path / "bundle"
    shutil.copytree(default_bundle_path(), bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["parts"][part]["config"][key] = value
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    refused(run_cli("run", "--model", str(bundle), "--num-images", "1", "--out", str(out)),
            f"parts.{part}.config is invalid", f"{key} must be a positive integer")
    assert not out.exists()


def test_nan_in_pjds_lookahead_rows_alone_stops_decoding_too():
    """pjd's lookahead rows are judged by nobody, but their distributions feed the next drafts:
    NaN there stops decoding with the same message (a forward whose other logits are finite)."""
    from runtime.core import Decoder, MethodSpec, SamplingParams
    from runtime.core.slots import NonFiniteError
    from tiny_models import tiny_pair

    target, _ = tiny_pair(vocab=8, grid=4)
    spec = MethodSpec(method="pjd", sampling=SamplingParams(greedy=True), pjd_rows=3, pjd_window=3)
    ahead = (spec.pjd_rows - 1) * spec.pjd_window  # the lookahead nodes: 6, the tree's 3
    plain = target.logits
    target.logits = lambda hidden: plain(hidden) * (float("nan") if hidden.size(1) == ahead else 1.0)
    with pytest.raises(NonFiniteError, match=r"the target model produced NaN or infinite logits for image 0 "
                                             r"at image token \d+"):
        Decoder(target, None, spec).generate_one(torch.tensor([1]), seed=0)
