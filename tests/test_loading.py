"""Loading weights: official layouts, every wrapper format, HF folders, drafter folders, bundles,
the T5 wrapper, and the one-line message of every bad-file case."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.utils.errors import UserError
from runtime.models import loading
from runtime.models.configs import DrafterConfig, gpt_config
from runtime.models.loading import (
    TRUST_FLAG, build_drafter, build_gpt, build_vq, drafter_config_from_json, gpt_config_from_hf,
    hf_config_from_gpt, hf_llamagen_to_official, load_drafter_folder, load_hf_llamagen_folder,
    load_state_dict_strict, official_to_hf_llamagen, read_bundle, read_checkpoint, save_bundle,
    save_drafter_folder, write_json, write_safetensors,
)


def shapes(state) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def assert_same_state(a, b) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ----------------------------------------------------------------------------------------------
# Official layouts of the full-size models (meta device: no allocation)
# ----------------------------------------------------------------------------------------------


def official_gpt_layout(dim: int, n_layer: int, ffn: int, model_type: str) -> dict[str, tuple[int, ...]]:
    """LlamaGen GPT state-dict keys/shapes (reference: autoregressive/models/gpt.py)."""
    layout = {"tok_embeddings.weight": (16384, dim)}
    if model_type == "c2i":
        layout["cls_embedding.embedding_table.weight"] = (1001, dim)
    else:
        layout["cls_embedding.cap_proj.fc1.weight"] = (dim, 2048)
        layout["cls_embedding.cap_proj.fc2.weight"] = (dim, dim)
        layout["cls_embedding.uncond_embedding"] = (120, 2048)
    for n in range(n_layer):
        layout[f"layers.{n}.attention.wqkv.weight"] = (3 * dim, dim)
        layout[f"layers.{n}.attention.wo.weight"] = (dim, dim)
        layout[f"layers.{n}.feed_forward.w1.weight"] = (ffn, dim)
        layout[f"layers.{n}.feed_forward.w3.weight"] = (ffn, dim)
        layout[f"layers.{n}.feed_forward.w2.weight"] = (dim, ffn)
        layout[f"layers.{n}.attention_norm.weight"] = (dim,)
        layout[f"layers.{n}.ffn_norm.weight"] = (dim,)
    layout["norm.weight"] = (dim,)
    layout["output.weight"] = (16384, dim)
    return layout


LANTERN_DRAFTER_LAYOUT = {  # jadohu/llamagen_drafter (cnets_llamagen.Model, GPT-XL t2i target)
    "embed_tokens.weight": (16384, 1280),
    "fc.weight": (1280, 2560),
    "fc.bias": (1280,),
    "layers.0.self_attn.q_proj.weight": (1280, 1280),
    "layers.0.self_attn.k_proj.weight": (1280, 1280),
    "layers.0.self_attn.v_proj.weight": (1280, 1280),
    "layers.0.self_attn.o_proj.weight": (1280, 1280),
    "layers.0.mlp.gate_proj.weight": (3584, 1280),
    "layers.0.mlp.up_proj.weight": (3584, 1280),
    "layers.0.mlp.down_proj.weight": (1280, 3584),
    "layers.0.post_attention_layernorm.weight": (1280,),
}

# data/configs/llamagen_t2i_config.json of jadohu/LANTERN, as released with the drafter.
LANTERN_DRAFTER_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 1280, "caption_dim": 2048, "class_dropout_p": 0.0, "initializer_range": 0.02,
    "intermediate_size": 3584, "max_position_embeddings": 2048, "model_type": "llama",
    "num_attention_heads": 20, "num_hidden_layers": 1, "num_key_value_heads": 20, "pretraining_tp": 1,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.32.0.dev0", "use_cache": True, "vocab_size": 16384, "input_type": "t2i",
}


def test_gpt_b_c2i_state_dict_equals_official_layout():
    from runtime.models.gpt import Transformer

    with torch.device("meta"):
        model = Transformer(gpt_config("GPT-B", model_type="c2i", image_size=256))
    got = shapes(model.state_dict())
    assert got == official_gpt_layout(768, 12, 2048, "c2i")
    assert len(got) == 2 + 12 * 7 + 2


def test_gpt_xl_t2i_state_dict_equals_official_layout():
    from runtime.models.gpt import Transformer

    with torch.device("meta"):
        model = Transformer(gpt_config("GPT-XL", model_type="t2i", image_size=256))
    got = shapes(model.state_dict())
    assert got == official_gpt_layout(1280, 36, 3584, "t2i")
    assert len(got) == 4 + 36 * 7 + 2


def test_lantern_drafter_config_builds_the_released_layout():
    from runtime.models.drafter import Drafter

    cfg = drafter_config_from_json(LANTERN_DRAFTER_CONFIG)
    assert (cfg.block_size, cfg.cls_token_num, cfg.rms_norm_eps) == (256, 120, 1e-6)
    with torch.device("meta"):
        model = Drafter(cfg)
    assert shapes(model.state_dict()) == LANTERN_DRAFTER_LAYOUT


def test_hf_names_of_gpt_xl_t2i_are_lanterns_and_convert_back():
    from runtime.models.gpt import Transformer

    with torch.device("meta"):
        official = Transformer(gpt_config("GPT-XL", model_type="t2i", image_size=256)).state_dict()
    hf = official_to_hf_llamagen(official)
    assert shapes(hf)["model.layers.35.self_attn.q_proj.weight"] == (1280, 1280)
    assert shapes(hf)["model.layers.0.mlp.gate_proj.weight"] == (3584, 1280)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.cls_embedding.cap_proj.fc1.weight", "model.cls_embedding.uncond_embedding",
            "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= set(hf)
    assert all(k.startswith(("model.", "lm_head.")) for k in hf)
    assert len(hf) == 4 + 36 * 9 + 2
    assert shapes(hf_llamagen_to_official(hf)) == shapes(official)


# ----------------------------------------------------------------------------------------------
# read_checkpoint: every wrapper format, bare and wrapped
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(4),
            "half.weight": torch.randn(2, 2).to(torch.bfloat16)}


@pytest.mark.parametrize("wrap", [
    lambda sd: sd,  # bare (LlamaGen FSDP consolidated.pth)
    lambda sd: {"model": sd, "steps": 7, "optimizer": {"state": {}, "param_groups": []}},  # DDP
    lambda sd: {"module": sd},  # DeepSpeed
    lambda sd: {"state_dict": sd},
    lambda sd: {"model": sd, "ema": {k: v + 1 for k, v in sd.items()}},  # "model" wins over "ema"
    lambda sd: {"model": {f"module.{k}": v for k, v in sd.items()}},  # DDP-wrapped module names
    lambda sd: {f"_orig_mod.{k}": v for k, v in sd.items()},  # torch.compile'd module
], ids=["bare", "model", "module", "state_dict", "model-over-ema", "module-prefix", "compiled"])
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_read_checkpoint_unwraps_every_official_format(tmp_path, state, wrap, suffix):
    path = tmp_path / f"ckpt{suffix}"
    torch.save(wrap(state), path)
    assert_same_state(read_checkpoint(path), state)


def test_read_checkpoint_reads_legacy_torch_save_format(tmp_path, state):
    path = tmp_path / "legacy.pt"
    torch.save({"model": state}, path, _use_new_zipfile_serialization=False)
    assert_same_state(read_checkpoint(path), state)


def test_read_checkpoint_reads_safetensors(tmp_path, state):
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    assert_same_state(read_checkpoint(path), state)


def test_pickled_args_are_refused_without_trust_and_read_with_it(tmp_path, state):
    path = tmp_path / "0050000.pt"
    torch.save({"model": state, "args": argparse.Namespace(gpt_model="GPT-B")}, path)
    with pytest.raises(UserError) as err:
        read_checkpoint(path)
    message = str(err.value)
    assert message == (f"{path} contains pickled Python objects (argparse.Namespace) besides tensors and "
                       f"is refused by the safe loader; if you trust its source, pass {TRUST_FLAG}")
    assert_same_state(read_checkpoint(path, trust=True), state)


def test_missing_checkpoint_file(tmp_path):
    with pytest.raises(UserError, match=r"^checkpoint not found: .*nope\.pt; check the path$"):
        read_checkpoint(tmp_path / "nope.pt")


def test_directory_instead_of_checkpoint_file(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        read_checkpoint(tmp_path)


def test_garbage_checkpoint_files(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"definitely not a checkpoint")
    with pytest.raises(UserError, match=r"^cannot read checkpoint .*junk\.pt: not a PyTorch checkpoint"):
        read_checkpoint(junk)
    junk_st = tmp_path / "junk.safetensors"
    junk_st.write_bytes(b"definitely not safetensors")
    with pytest.raises(UserError, match=r"junk\.safetensors is not a readable safetensors file"):
        read_checkpoint(junk_st)


def test_checkpoint_without_any_state_dict(tmp_path):
    path = tmp_path / "meta.pt"
    torch.save({"steps": 3, "note": "no tensors"}, path)
    with pytest.raises(UserError, match=r"meta\.pt holds no state dict \(top-level keys: note, steps\)"):
        read_checkpoint(path)


# ----------------------------------------------------------------------------------------------
# Strict loading: one line naming file, key and both shapes
# ----------------------------------------------------------------------------------------------


def small_module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))


def test_strict_load_copies_weights():
    src, dst = small_module(), torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    torch.nn.init.zeros_(dst[0].weight)
    load_state_dict_strict(dst, src.state_dict(), "a.pt")
    assert_same_state(dst.state_dict(), src.state_dict())


def test_missing_key_message():
    sd = small_module().state_dict()
    del sd["0.bias"]
    with pytest.raises(UserError) as err:
        load_state_dict_strict(small_module(), sd, "c2i_B_256.pt")
    assert str(err.value) == "c2i_B_256.pt: missing key '0.bias' (expected shape (4), found none)"


def test_unexpected_key_message():
    sd = small_module().state_dict()
    sd["2.weight"] = torch.zeros(5, 6)
    with pytest.raises(UserError) as err:
        load_state_dict_strict(small_module(), sd, "c2i_B_256.pt")
    assert str(err.value) == "c2i_B_256.pt: unexpected key '2.weight' (expected none, found shape (5, 6))"


def test_shape_mismatch_message_and_count_of_further_problems():
    sd = small_module().state_dict()
    sd["0.weight"] = torch.zeros(4, 5)
    sd["1.weight"] = torch.zeros(7)
    with pytest.raises(UserError) as err:
        load_state_dict_strict(small_module(), sd, "vq_ds16_c2i.pt", hint="check --vq-ckpt")
    assert str(err.value) == ("vq_ds16_c2i.pt: shape mismatch for '0.weight': expected (4, 3), found (4, 5) "
                              "(and 1 more problems); check --vq-ckpt")


def test_harmless_extras_and_missing_usage_buffer_are_accepted(tiny_vq_config):
    from runtime.models.vq import VQModel

    torch.manual_seed(0)
    src, dst = VQModel(tiny_vq_config), VQModel(tiny_vq_config)
    sd = dict(src.state_dict())
    del sd["quantize.codebook_used"]  # saved with show_usage=False
    sd["freqs_cis"] = torch.zeros(17, 4, 2)  # RoPE table in some old LlamaGen checkpoints
    sd["layers.0.attention.kv_cache.k_cache"] = torch.zeros(1, 2, 3, 4)  # taken after setup_caches
    load_state_dict_strict(dst, sd, "vq.pt")
    assert torch.equal(dst.quantize.embedding.weight, src.quantize.embedding.weight)


# ----------------------------------------------------------------------------------------------
# Official GPT / VQ files through the CLI builders
# ----------------------------------------------------------------------------------------------


def test_build_gpt_from_official_ddp_and_fsdp_files(tmp_path):
    from runtime.models.gpt import Transformer

    torch.manual_seed(0)
    model = Transformer(gpt_config("GPT-tiny", model_type="c2i", image_size=64))
    torch.save({"model": model.state_dict(), "steps": 10}, tmp_path / "c2i_tiny_64.pt")
    torch.save(model.state_dict(), tmp_path / "consolidated.pth")
    for name in ("c2i_tiny_64.pt", "consolidated.pth"):
        loaded = build_gpt("GPT-tiny", tmp_path / name, image_size=64, model_type="c2i")
        assert not loaded.training and loaded.config == model.config
        assert_same_state(loaded.state_dict(), model.state_dict())


def test_build_gpt_with_the_wrong_model_type_names_key_and_hint(tmp_path):
    from runtime.models.gpt import Transformer

    model = Transformer(gpt_config("GPT-tiny", model_type="c2i", image_size=64))
    torch.save({"model": model.state_dict()}, tmp_path / "c2i.pt")
    with pytest.raises(UserError) as err:
        build_gpt("GPT-tiny", tmp_path / "c2i.pt", image_size=64, model_type="t2i")
    assert str(err.value) == (
        f"{tmp_path / 'c2i.pt'}: missing key 'cls_embedding.uncond_embedding' (expected shape (120, 2048), "
        "found none) (and 3 more problems); check that --gpt-model and the model type (c2i/t2i) match "
        "the checkpoint")


def test_build_vq_from_an_official_vq_file(tmp_path, monkeypatch, tiny_vq_config):
    from runtime.models.vq import VQModel

    # the VQ-16 layout itself is checked on the meta device; a toy width keeps this test fast
    monkeypatch.setitem(loading.VQ_CONFIGS, "VQ-toy", tiny_vq_config)
    torch.manual_seed(0)
    vq = VQModel(tiny_vq_config)
    torch.save({"model": vq.state_dict(), "steps": 1}, tmp_path / "vq_toy.pt")
    loaded = build_vq(tmp_path / "vq_toy.pt", "VQ-toy")
    assert not loaded.training
    assert_same_state(loaded.state_dict(), vq.state_dict())


def test_build_vq_with_a_gpt_checkpoint_fails_on_the_first_key(tmp_path):
    torch.save({"model": {"tok_embeddings.weight": torch.zeros(3, 2)}}, tmp_path / "c2i_B_256.pt")
    with pytest.raises(UserError, match=r"c2i_B_256\.pt: missing key 'encoder\.conv_in\.weight' "
                                        r"\(expected shape \(128, 3, 3, 3\), found none\) \(and \d+ more"):
        build_vq(tmp_path / "c2i_B_256.pt")


# ----------------------------------------------------------------------------------------------
# HF-converted LlamaGen folders
# ----------------------------------------------------------------------------------------------


def write_hf_folder(folder: Path, model) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", hf_config_from_gpt(model.config))
    write_safetensors(folder / "model.safetensors", official_to_hf_llamagen(model.state_dict()))
    return folder


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_hf_state_dict_round_trip_is_exact(make_tiny_gpt, model_type):
    official = make_tiny_gpt(model_type).state_dict()
    hf = official_to_hf_llamagen(official)
    q = hf["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(q, official["layers.1.attention.wqkv.weight"][:64])  # q rows first, unpermuted
    assert_same_state(hf_llamagen_to_official(hf), official)


def test_hf_folder_loads_to_the_same_model(tmp_path, make_tiny_gpt):
    model = make_tiny_gpt("t2i")
    folder = write_hf_folder(tmp_path / "LlamaGen-T2I-tiny", model)
    cfg, state = load_hf_llamagen_folder(folder)
    assert cfg == model.config
    assert_same_state(state, model.state_dict())
    loaded = build_gpt(None, folder)
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_hf_config_of_lanterns_target_is_gpt_xl_t2i():
    released = {  # the fields LANTERN's modeling_llamagen_kv.py reads, with GPT-XL t2i values
        "hidden_size": 1280, "num_hidden_layers": 36, "num_attention_heads": 20, "num_key_value_heads": 20,
        "intermediate_size": 3584, "vocab_size": 16384, "block_size": 256, "cls_token_num": 120,
        "input_type": "t2i", "caption_dim": 2048, "class_dropout_p": 0.1, "num_classes": 1000,
        "rope_base": 10000, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
    }
    assert gpt_config_from_hf(released) == gpt_config("GPT-XL", model_type="t2i", image_size=256)


def test_hf_folder_problems(tmp_path, make_tiny_gpt):
    model = make_tiny_gpt("t2i")
    folder = write_hf_folder(tmp_path / "hf", model)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"config\.json is not valid JSON"):
        load_hf_llamagen_folder(folder)
    config = hf_config_from_gpt(model.config)
    del config["block_size"]
    write_json(folder / "config.json", config)
    with pytest.raises(UserError, match=r"config\.json: missing field 'block_size'"):
        load_hf_llamagen_folder(folder)
    write_json(folder / "config.json", {**hf_config_from_gpt(model.config), "intermediate_size": 100})
    with pytest.raises(UserError, match="intermediate_size 100 is not LlamaGen's SwiGLU width"):
        load_hf_llamagen_folder(folder)
    write_json(folder / "config.json", hf_config_from_gpt(model.config))
    state = official_to_hf_llamagen(model.state_dict())
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # harmless, dropped
    state["model.extra.weight"] = torch.ones(2, 3)
    write_safetensors(folder / "model.safetensors", state)
    with pytest.raises(UserError, match=r"unexpected key 'model\.extra\.weight' \(found shape \(2, 3\)\)"):
        load_hf_llamagen_folder(folder)
    del state["model.extra.weight"], state["model.layers.1.self_attn.v_proj.weight"]
    write_safetensors(folder / "model.safetensors", state)
    with pytest.raises(UserError, match=r"missing key 'model\.layers\.1\.self_attn\.v_proj\.weight'"):
        load_hf_llamagen_folder(folder)


# ----------------------------------------------------------------------------------------------
# Drafter folders
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_drafter(make_tiny_gpt):
    from runtime.models.drafter import Drafter

    target = make_tiny_gpt("t2i")
    torch.manual_seed(1)
    return Drafter(DrafterConfig.for_target(target.config)), target.config


@pytest.mark.parametrize("fmt,weights_file", [("bin", "pytorch_model.bin"),
                                              ("safetensors", "model.safetensors")])
def test_drafter_folder_round_trip(tmp_path, tiny_drafter, fmt, weights_file):
    drafter, target_cfg = tiny_drafter
    folder = save_drafter_folder(tmp_path / "drafter", drafter.config, drafter, fmt=fmt)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", weights_file])
    cfg, state = load_drafter_folder(folder)
    assert cfg == drafter.config
    assert_same_state(state, drafter.state_dict())
    loaded = build_drafter(folder, target_cfg)
    assert not loaded.training
    assert_same_state(loaded.state_dict(), drafter.state_dict())


@pytest.mark.parametrize("input_type,block_size,cls_token_num",
                         [("t2i", 256, 120), ("t2i2", 1024, 120), ("c2i", 576, 1)])
def test_lantern_input_type_sets_the_target_geometry(input_type, block_size, cls_token_num):
    cfg = drafter_config_from_json({**LANTERN_DRAFTER_CONFIG, "input_type": input_type})
    assert (cfg.block_size, cfg.cls_token_num) == (block_size, cls_token_num)


def test_lantern_style_folder_with_a_plain_torch_save_bin(tmp_path, tiny_drafter):
    drafter, _ = tiny_drafter
    folder = tmp_path / "llamagen_drafter"
    folder.mkdir()
    torch.save(drafter.state_dict(), folder / "pytorch_model.bin")
    cfg = drafter.config
    (folder / "config.json").write_text(json.dumps({
        **LANTERN_DRAFTER_CONFIG, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "vocab_size": cfg.vocab_size}))
    loaded_cfg, state = load_drafter_folder(folder)
    assert (loaded_cfg.block_size, loaded_cfg.cls_token_num) == (256, 120)
    assert_same_state(state, drafter.state_dict())


def test_drafter_folder_problems(tmp_path, tiny_drafter):
    drafter, target_cfg = tiny_drafter
    with pytest.raises(UserError, match=r"^drafter folder not found: .*absent; pass the folder holding config\.json$"):
        load_drafter_folder(tmp_path / "absent")
    folder = tmp_path / "d"
    folder.mkdir()
    with pytest.raises(UserError, match=r"d: no config\.json"):
        load_drafter_folder(folder)
    (folder / "config.json").write_text("[1, 2")
    with pytest.raises(UserError, match=r"config\.json is not valid JSON"):
        load_drafter_folder(folder)
    (folder / "config.json").write_text(json.dumps({**LANTERN_DRAFTER_CONFIG, "input_type": "video"}))
    with pytest.raises(UserError, match=r"input_type 'video' is not one of t2i, t2i2, c2i"):
        load_drafter_folder(folder)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in LANTERN_DRAFTER_CONFIG.items()
                                                    if k != "hidden_size"}))
    with pytest.raises(UserError, match=r"config\.json: missing field 'hidden_size' for a drafter config"):
        load_drafter_folder(folder)
    (folder / "config.json").write_text(json.dumps(LANTERN_DRAFTER_CONFIG))
    with pytest.raises(UserError, match=r"no weights found \(expected model\.safetensors or pytorch_model\.bin\)"):
        load_drafter_folder(folder)

    other = gpt_config("GPT-tiny", model_type="t2i", image_size=64, dim=128, n_head=2)
    save_drafter_folder(folder, drafter.config, drafter)
    with pytest.raises(UserError, match="drafter hidden_size 64 does not match the target model's dim 128"):
        build_drafter(folder, other)
    state = dict(drafter.state_dict())
    state["fc.weight"] = state["fc.weight"][:, :10].clone()
    save_drafter_folder(folder, drafter.config, state)
    with pytest.raises(UserError, match=r"shape mismatch for 'fc\.weight': expected \(64, 128\), found \(64, 10\)"):
        build_drafter(folder, target_cfg)


# ----------------------------------------------------------------------------------------------
# The project's own bundles
# ----------------------------------------------------------------------------------------------


def test_bundle_round_trip(tmp_path, make_tiny_gpt, tiny_vq_config):
    from runtime.models.vq import VQModel

    gpt = make_tiny_gpt("c2i")
    vq = VQModel(tiny_vq_config)
    folder = save_bundle(tmp_path / "bundle", {
        "gpt": (gpt, gpt.config.to_dict()),
        "vq": (vq.state_dict(), tiny_vq_config.to_dict()),
    }, manifest={"name": "tiny", "classes": ["a", "b"]})
    assert sorted(p.name for p in folder.iterdir()) == ["gpt.safetensors", "manifest.json", "vq.safetensors"]
    bundle = read_bundle(folder)
    assert bundle.manifest == {"name": "tiny", "classes": ["a", "b"]}
    assert bundle.part("gpt").config == gpt.config.to_dict()
    assert bundle.part("vq").config == tiny_vq_config.to_dict()
    assert_same_state(bundle.part("gpt").state, gpt.state_dict())
    assert_same_state(bundle.part("vq").state, vq.state_dict())
    with pytest.raises(UserError, match=r"bundle has no 'drafter' part \(has: gpt, vq\)"):
        bundle.part("drafter")


def test_bundle_keeps_tied_weights_and_dtypes(tmp_path):
    shared = torch.randn(3, 2).to(torch.bfloat16)
    save_bundle(tmp_path / "b", {"m": ({"a": shared, "b": shared, "c": shared[1:]}, {})})
    state = read_bundle(tmp_path / "b").part("m").state
    assert torch.equal(state["a"], shared) and torch.equal(state["b"], shared)
    assert torch.equal(state["c"], shared[1:]) and state["a"].dtype == torch.bfloat16


def test_bundle_problems(tmp_path, make_tiny_gpt):
    with pytest.raises(UserError, match=r"^model bundle not found: .*missing; check the --model path$"):
        read_bundle(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty is not a model bundle \(no manifest\.json\)"):
        read_bundle(tmp_path / "empty")
    gpt = make_tiny_gpt()
    folder = save_bundle(tmp_path / "b", {"gpt": (gpt, gpt.config.to_dict())})
    (folder / "gpt.safetensors").unlink()
    with pytest.raises(UserError, match=r"part 'gpt' file gpt\.safetensors is missing"):
        read_bundle(folder)


# ----------------------------------------------------------------------------------------------
# T5 text encoder
# ----------------------------------------------------------------------------------------------


def llamagen_left_pad(emb: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaGen sample_t2i.py's loop, restated: roll the valid prefix to the end, flip the mask,
    zero the padded rows."""
    new_mask = torch.flip(mask, dims=[-1])
    rows = []
    for row, m in zip(emb, mask):
        n = int(m.sum())
        rows.append(torch.cat([row[n:], row[:n]]))
    return torch.stack(rows) * new_mask[:, :, None], new_mask


def test_left_pad_captions_matches_llamagen():
    from runtime.models.t5 import left_pad_captions

    torch.manual_seed(0)
    emb = torch.randn(3, 7, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1] * 7, [1, 0, 0, 0, 0, 0, 0]])
    out, out_mask = left_pad_captions(emb, mask)
    ref, ref_mask = llamagen_left_pad(emb, mask)
    assert torch.equal(out, ref)
    assert out_mask.dtype == torch.bool and torch.equal(out_mask, ref_mask.bool())
    assert torch.equal(out[0, 4:], emb[0, :3]) and out[0, :4].abs().sum() == 0


@pytest.fixture
def tiny_t5_dir(tmp_path) -> Path:
    """A randomly initialised 1-layer T5 encoder and a word-level tokenizer saved like an HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    words = "a photo of cat red car on the street dog sleeps bird flies over sea".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>")
    torch.manual_seed(0)
    model = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                    num_heads=2, relative_attention_num_buckets=8))
    folder = tmp_path / "tiny-t5"
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def test_t5_encoder_left_pads_to_120_tokens(tiny_t5_dir):
    from transformers import AutoTokenizer, T5EncoderModel

    from runtime.models.t5 import T5Encoder

    encoder = T5Encoder(tiny_t5_dir)
    prompts = ["A cat", "the red dog sleeps over the sea "]
    emb, mask = encoder.encode(prompts)
    assert emb.shape == (2, 120, 16) and mask.shape == (2, 120) and mask.dtype == torch.bool
    assert mask.sum(dim=1).tolist() == [3, 8]  # words + </s>, lower-cased
    assert mask[0, -3:].all() and not mask[0, :-3].any()
    assert emb[0, :-3].abs().sum() == 0

    # the valid rows are the encoder's own output on the right-padded tokens, moved to the end
    tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir, local_files_only=True)
    plain = T5EncoderModel.from_pretrained(tiny_t5_dir, local_files_only=True).eval()
    tokens = tokenizer([p.lower().strip() for p in prompts], max_length=120, padding="max_length",
                       truncation=True, return_tensors="pt")
    with torch.no_grad():
        ref = plain(**tokens).last_hidden_state
    torch.testing.assert_close(emb[1, -8:], ref[1, :8])
    torch.testing.assert_close(emb[0, -3:], ref[0, :3])


def test_t5_encoder_needs_a_local_folder(tmp_path):
    from runtime.models.t5 import T5Encoder

    with pytest.raises(UserError, match=r"^T5 encoder folder not found: .*flan-t5-xl"):
        T5Encoder(tmp_path / "flan-t5-xl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty: no config\.json"):
        T5Encoder(tmp_path / "empty")



def test_drafter_fused_projections_load_every_part(tiny_drafter):
    """q/k/v and gate/up run as one matmul each, but load from (and save as) the separate
    layers' keys: every part of a state dict lands in the fused weight."""
    from runtime.models.drafter import Drafter

    drafter, _ = tiny_drafter
    state = drafter.state_dict()
    torch.manual_seed(7)
    fresh = load_state_dict_strict(Drafter(drafter.config), state, "drafter.safetensors")
    attn, mlp = fresh.layers[0].self_attn, fresh.layers[0].mlp
    q, k, v = (state[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.qkv.weight, torch.cat([q, k, v]))
    assert torch.equal(mlp.gate_up.weight, torch.cat([state["layers.0.mlp.gate_proj.weight"],
                                                      state["layers.0.mlp.up_proj.weight"]]))
    x = torch.randn(2, 3, drafter.config.hidden_size)
    assert torch.equal(fresh.layers[0].mlp(x), drafter.layers[0].mlp(x))


def test_strict_load_refuses_a_module_whose_hooks_drop_a_key():
    """A key the check accepted but the module never loaded is a bug, not a silent random weight."""
    module = small_module()
    module.register_load_state_dict_pre_hook(lambda _m, state, prefix, *_: state.pop(prefix + "0.bias"))
    with pytest.raises(RuntimeError, match="left '0.bias' unloaded"):
        load_state_dict_strict(module, small_module().state_dict(), "a.pt")
