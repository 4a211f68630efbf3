"""Settings that make official LlamaGen checkpoints run as LlamaGen runs them: the token grid from
the file name, the sampling scripts' defaults per model kind, `cfg_interval`, and the math
attention kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY_VQ_CONFIG
from runtime.core import MethodSpec, SamplingParams, generate
from runtime.core.state import DecodeConfig
from runtime.utils.errors import UserError
from runtime.models import layers
from runtime.models.configs import gpt_config
from runtime.models.gpt import ROPE_EXTRA_ROWS, Transformer
from runtime.models.loading import build_gpt, image_size_from_name
from runtime.models.rope import rope_table_2d
from runtime.models.vq import VQModel
from runtime.generation.loading import load_model
from runtime.generation.settings import resolve_spec, sampling_sources
from runtime.config.profiles import parse_profile
from tiny_models import tiny_pair

RELEASED = {"c2i_B_256.pt": 256, "c2i_B_384.pt": 384, "c2i_L_256.pt": 256, "c2i_L_384.pt": 384,
            "c2i_XL_384.pt": 384, "c2i_XXL_384.pt": 384, "c2i_3B_384.pt": 384,
            "t2i_XL_stage1_256.pt": 256, "t2i_XL_stage2_512.pt": 512}


def save_official(folder: Path, name: str, model_type: str = "c2i") -> Path:
    """A GPT-tiny saved as LlamaGen's DDP training saves it; the grid is not in the file."""
    torch.manual_seed(0)
    model = Transformer(gpt_config("GPT-tiny", model_type=model_type, image_size=64))
    model.init_weights()
    path = folder / name
    torch.save({"model": model.state_dict(), "steps": 1}, path)
    return path


@pytest.fixture
def tiny_vq(monkeypatch):
    """`load_model` gets a toy VQ-16 (narrow, with the GPT's 16384 codes) instead of reading the
    72M-parameter tokenizer."""
    from dataclasses import replace

    import runtime.models.loading as loading

    config = replace(TINY_VQ_CONFIG, codebook_size=16384)
    monkeypatch.setattr(loading, "build_vq", lambda path, trust=False: VQModel(config).eval())


def load_official(path: Path, model_type: str = "c2i", image_size: int | None = None):
    return load_model(model=None, gpt_model="GPT-tiny", gpt_ckpt=str(path), vq_ckpt="vq_ds16_c2i.pt",
                      image_size=image_size, drafter=None, gpt_type=model_type, trust=False,
                      device=torch.device("cpu"), dtype=torch.float32)


# -- 1. image size of official checkpoints --------------------------------------------------------


@pytest.mark.parametrize("name, size", sorted(RELEASED.items()))
def test_released_file_names_state_their_image_size(name, size):
    assert image_size_from_name(name) == size
    assert image_size_from_name(f"/ckpts/{name}".replace(".pt", ".safetensors")) == size


@pytest.mark.parametrize("name", ["c2i_tiny.pt", "consolidated.pth", "0050000.pt", "c2i_B_2560.pt",
                                  "c2i_B256.pt", "c2i_256_384.pt"])
def test_names_without_one_size_token_state_none(name):
    assert image_size_from_name(name) is None


def test_a_384_checkpoint_is_built_with_a_24x24_grid_without_image_size(tmp_path):
    model = build_gpt("GPT-tiny", save_official(tmp_path, "c2i_tiny_384.pt"))
    assert model.config.block_size == 24 * 24 and model.config.grid_size == 24
    cfg = model.config
    assert torch.equal(model.freqs_cis, rope_table_2d(24, cfg.head_dim, cfg.rope_base, cfg.cls_token_num,
                                                      ROPE_EXTRA_ROWS))  # token k sits at cell (k // 24, k % 24)


def test_run_and_bench_load_the_named_size(tmp_path, tiny_vq):
    loaded = load_official(save_official(tmp_path, "t2i_tiny_stage2_512.pt", "t2i"), "t2i")
    assert (loaded.image_size, loaded.config.block_size) == (512, 32 * 32)


def test_a_file_name_without_a_size_needs_image_size(tmp_path):
    path = save_official(tmp_path, "c2i_tiny.pt")
    with pytest.raises(UserError, match=r"does not state the image size .*; pass --image-size") as err:
        build_gpt("GPT-tiny", path)
    assert "\n" not in str(err.value)
    assert build_gpt("GPT-tiny", path, image_size=64).config.block_size == 16


def test_image_size_contradicting_the_file_name_is_refused(tmp_path):
    path = save_official(tmp_path, "c2i_tiny_384.pt")
    with pytest.raises(UserError, match=r"file name says 384 px but --image-size is 256; drop --image-size "
                                        r"or pass --image-size 384"):
        build_gpt("GPT-tiny", path, image_size=256)
    assert build_gpt("GPT-tiny", path, image_size=384).config.block_size == 576


@pytest.mark.parametrize("size", [0, -16, 100, 260])
def test_image_size_must_be_a_positive_multiple_of_16(tmp_path, size):
    with pytest.raises(UserError, match=rf"--image-size {size} is not a positive multiple of 16"):
        build_gpt("GPT-tiny", save_official(tmp_path, "c2i_tiny.pt"), image_size=size)


@pytest.mark.parametrize("command", ["run", "bench"])
def test_cli_refuses_an_unsized_checkpoint_in_one_line(tmp_path, run_cli, command):
    path = save_official(tmp_path, "c2i_tiny.pt")
    out = ["--out", str(tmp_path / ("o.json" if command == "bench" else "o"))]
    res = run_cli(command, "--gpt-model", "GPT-tiny", "--gpt-ckpt", str(path), "--vq-ckpt",
                  str(tmp_path / "vq.pt"), "--device", "cpu", *out)
    assert res.exit_code == 2 and res.stderr.count("\n") == 1
    assert "does not state the image size" in res.stderr and "pass --image-size" in res.stderr


def test_demo_refuses_an_image_size_it_cannot_make(run_cli, tmp_path):
    res = run_cli("run", "--image-size", "256", "--device", "cpu", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and res.stderr.count("\n") == 1
    assert "the model bundle generates 64 px images" in res.stderr


# -- 2. reference sampling defaults per model kind ------------------------------------------------


@pytest.mark.parametrize("kind, cfg, top_k, script", [("c2i", 4.0, 2000, "sample_c2i.py"),
                                                       ("t2i", 7.5, 1000, "sample_t2i.py")])
def test_official_models_sample_with_llamagens_script_defaults(tmp_path, tiny_vq, kind, cfg, top_k, script):
    loaded = load_official(save_official(tmp_path, f"{kind}_tiny_256.pt", kind), kind)
    sampling = resolve_spec("ar", {}, None, loaded.recommended).sampling
    assert (sampling.cfg, sampling.top_k, sampling.temperature, sampling.top_p) == (cfg, top_k, 1.0, 1.0)
    sources = sampling_sources({}, None, loaded)
    assert sources["cfg"] == sources["top_k"] == f"model default (LlamaGen {script})"
    assert sources["greedy"] == sources["cfg_interval"] == "default"


def test_flag_beats_profile_beats_model_default(tmp_path, tiny_vq):
    loaded = load_official(save_official(tmp_path, "c2i_tiny_256.pt"))
    profile = parse_profile('[device]\ndtype = "fp32"\ngraph = false\n[tree]\nname = "chain"\n'
                            '[method]\nname = "ar"\ncfg = 2.0\ntop_k = 50\n[bench]\nwarmup = 0\nrepeats = 1\n',
                            source="p.toml", name="p")
    flags = {"top_k": 7}
    sampling = resolve_spec(None, flags, profile, loaded.recommended).sampling
    assert (sampling.top_k, sampling.cfg, sampling.temperature) == (7, 2.0, 1.0)
    sources = sampling_sources(flags, profile, loaded)
    assert (sources["top_k"], sources["cfg"], sources["temperature"]) == (
        "flag (--top-k)", "profile p", "model default (LlamaGen sample_c2i.py)")


def test_the_demo_keeps_its_manifests_recommendation():
    loaded = load_model(model="demo", gpt_model=None, gpt_ckpt=None, vq_ckpt=None, image_size=None, drafter=None,
                        gpt_type="c2i", trust=False, device=torch.device("cpu"), dtype=torch.float32)
    sampling = resolve_spec(None, {}, None, loaded.recommended).sampling
    assert (sampling.cfg, sampling.top_k) == (loaded.recommended["cfg"], loaded.recommended["top_k"])
    assert sampling_sources({}, None, loaded)["cfg"] == "model bundle recommendation (manifest.json)"


# -- 3. cfg_interval --------------------------------------------------------------------------------


def tokens_with(method: str, cfg_interval: int, **sampling) -> torch.Tensor:
    target, drafter = tiny_pair(vocab=8, grid=4, sharpness=1.0)
    spec = MethodSpec(method, SamplingParams(cfg=4.0, cfg_interval=cfg_interval, **sampling), depth=3)
    return generate(target, drafter, spec, conditions=[0, 1, 2, 3, 0, 1], seed=3).tokens


@pytest.mark.parametrize("method, sampling", [("ar", {}), ("sd", {"greedy": True})])
def test_cfg_interval_switches_guidance_off_after_its_step(method, sampling):
    always = tokens_with(method, -1, **sampling)
    assert not torch.equal(tokens_with(method, 0, **sampling), always)
    # guidance never switches off when the interval outlasts the 16 tokens
    assert torch.equal(tokens_with(method, 16, **sampling), always)
    assert torch.equal(tokens_with(method, 1000, **sampling), always)


@pytest.mark.parametrize("cfg_interval, greedy", [(-1, True), (1, False)])
def test_drafts_mix_guidance_before_the_head_at_half_its_rows(cfg_interval, greedy):
    """The head is linear, so the drafts' guided distribution from the hidden states mixed first
    (B head rows) is the one from the mixed logits (2B rows), cfg_interval's switch included."""
    target, drafter = tiny_pair(vocab=8, grid=4, sharpness=1.0)
    spec = MethodSpec("sd", SamplingParams(cfg=4.0, cfg_interval=cfg_interval, greedy=greedy), depth=3)
    config = DecodeConfig.for_models(target, drafter, spec, batch=3)
    hidden = torch.randn(6, 5, target.config.dim, generator=torch.Generator().manual_seed(0))
    count, depth = torch.tensor([0, 1, 2]), torch.arange(5)
    rows: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        rows.append(h.size(0))
        return target.logits(h)

    mixed_first = config.dist(hidden, count, depth, draft=True, head=head)
    torch.testing.assert_close(mixed_first, config.dist(target.logits(hidden), count, depth, draft=True),
                               rtol=1e-5, atol=1e-6)
    assert rows == [3]
    if cfg_interval >= 0:  # the switch took effect: some positions are the conditional row's alone
        assert not torch.allclose(mixed_first, config.dist(target.logits(hidden), count, None, draft=True))


def test_cfg_interval_without_guidance_is_refused_naming_its_source():
    with pytest.raises(UserError, match=r"^--cfg-interval 3 does nothing without classifier-free guidance "
                                        r"\(cfg 1\); give --cfg above 1"):
        resolve_spec("ar", {"cfg_interval": 3}, None, {})
    profile = parse_profile('[device]\ndtype = "fp32"\ngraph = false\n[tree]\nname = "chain"\n'
                            '[method]\nname = "ar"\ncfg_interval = 3\n[bench]\nwarmup = 0\nrepeats = 1\n',
                            source="p.toml", name="p")
    with pytest.raises(UserError, match=r"^profile p cfg_interval 3 does nothing"):
        resolve_spec("ar", {"cfg": 1.0}, profile, {"cfg": 4.0})
    assert resolve_spec("ar", {}, profile, {"cfg": 4.0}).sampling.cfg_interval == 3
    assert resolve_spec("ar", {"cfg_interval": -1}, None, {}).sampling.cfg_interval == -1  # "always": harmless


def test_cfg_interval_is_recorded_with_the_sampling_settings():
    spec = resolve_spec("ar", {"cfg_interval": 5}, None, {"cfg": 4.0})
    assert spec.describe()["cfg_interval"] == 5


@pytest.mark.parametrize("command", ["run", "bench"])
def test_cli_refuses_cfg_interval_without_guidance(tmp_path, run_cli, command):
    out = tmp_path / ("o.json" if command == "bench" else "o")
    res = run_cli(command, "--device", "cpu", "--cfg", "1", "--cfg-interval", "3", "--num-images", "1",
                  "--out", str(out))
    assert res.exit_code == 2 and res.stderr.count("\n") == 1
    assert "--cfg-interval 3 does nothing without classifier-free guidance" in res.stderr
    assert not out.exists()


# -- 4. the math attention kernel -------------------------------------------------------------------


def test_the_kernel_setting_reaches_attend(monkeypatch):
    seen: list[tuple[bool, bool, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        cuda = torch.backends.cuda
        seen.append((cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", spy)
    target, drafter = tiny_pair()
    spec = MethodSpec("sd", SamplingParams(cfg=2.0), depth=2)
    with layers.use_attention_kernel("math"):
        assert layers.attention_kernel() == "math"
        generate(target, drafter, spec, conditions=[1], seed=0)
    assert seen and set(seen) == {(False, False, True)}  # only the math kernel is allowed, target and drafter
    assert layers.attention_kernel() == "auto"
    seen.clear()
    generate(target, drafter, spec, conditions=[1], seed=0)
    assert seen and set(seen) == {(True, True, True)}


@pytest.mark.parametrize("method", ["ar", "sd", "lantern++"])
def test_math_and_auto_give_the_same_fp32_tokens(method):
    target, drafter = tiny_pair(sharpness=1.0)
    spec = MethodSpec(method, SamplingParams(cfg=3.0), depth=3, tree="small_12", lantern_lambda=1.0)
    auto = generate(target, drafter, spec, conditions=[0, 1, 2], seed=1).tokens
    with layers.use_attention_kernel("math"):
        math = generate(target, drafter, spec, conditions=[0, 1, 2], seed=1).tokens
    assert torch.equal(auto, math)


def test_math_kernel_holds_inside_a_fullgraph_compile_and_matches_eager():
    """The aten graph inductor would receive: the math kernel's bmm/softmax under "math", a fused
    kernel (the CPU flash kernel) under "auto"; a change of setting recompiles."""
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    graphs: list[str] = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def step(q, k, v, mask):
        causal = layers.attend(q, k, v, layer=0, cache=None, slots=None, mask=None)
        masked = layers.attend(q, k, v, layer=0, cache=None, slots=None, mask=mask)
        return causal + masked

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=aot_autograd(fw_compiler=keep_graph))
    with torch.no_grad():
        with layers.use_attention_kernel("math"):
            torch.testing.assert_close(compiled(q, k, v, mask), step(q, k, v, mask))
        torch.testing.assert_close(compiled(q, k, v, mask), step(q, k, v, mask))
    math_graph, auto_graph = graphs
    assert "aten.bmm" in math_graph and "scaled_dot_product" not in math_graph
    assert "scaled_dot_product" in auto_graph and "aten.bmm" not in auto_graph  # a fused kernel


def test_an_unknown_kernel_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^--attention 'flash' is not a kernel setting; choose auto or math"):
        layers.set_attention_kernel("flash")
    assert layers.attention_kernel() == "auto"


@pytest.mark.parametrize("command", ["run", "bench"])
def test_cli_refuses_an_unknown_kernel_before_any_work(tmp_path, run_cli, command):
    out = tmp_path / ("o.json" if command == "bench" else "o")
    res = run_cli(command, "--device", "cpu", "--attention", "flash", "--out", str(out))
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "--attention 'flash'" in res.stderr
    assert not out.exists() and layers.attention_kernel() == "auto"
