"""Chameleon-family targets through the decoding core (issue 19, item 1), on a tiny random
`transformers` Chameleon built from its config classes (no downloads).

- the adapter's logits equal `transformers`' own forward (image tokens only);
- AR greedy through the core equals a greedy loop over `transformers`' forward with every
  non-image token masked (the reference generation scripts' rule), without and with CFG;
- every drafted method reproduces AR greedy token for token with a random drafter.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "ChameleonForConditionalGeneration"):
    pytest.skip("this transformers has no Chameleon", allow_module_level=True)

from runtime.core import MethodSpec, SamplingParams, generate  # noqa: E402
from runtime.models.chameleon import ChameleonTarget, config_from_hf  # noqa: E402
from runtime.models.configs import DrafterConfig  # noqa: E402
from runtime.models.drafter import Drafter  # noqa: E402

IMAGE_CODES = 64
GRID = 4
BOI = 69


def _code_name(i: int) -> str:
    """Chameleon's name of VQ code i: IMGIMG + the digits as letters A-J + Z."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z"


def tiny_hf_chameleon(seed: int = 0):
    """A 2-layer, width-64 Chameleon with 64 image codes (ids 4..67) in a 92-token vocabulary."""
    torch.manual_seed(seed)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{_code_name(i): 4 + i for i in range(IMAGE_CODES)},
             "<image>": 68, "<racm3:break>": BOI, "<eoss>": 70}
    vq = dict(embed_dim=8, num_embeddings=IMAGE_CODES, latent_channels=8, resolution=64, in_channels=3,
              base_channels=32, channel_multiplier=[1, 1, 2, 2, 4], num_res_blocks=1, attn_resolutions=[])
    cfg = transformers.ChameleonConfig(
        vocab_size=92, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, vq_config=vq, vocabulary_map=vocab,
        bos_token_id=0, eos_token_id=2, pad_token_id=1)
    model = transformers.ChameleonForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # non-trivial norms and a sharp head, so errors show in tokens
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        model.lm_head.weight.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf_chameleon()
    image_ids = torch.tensor(hf.model.vocabulary_mapping.image_tokens)
    ours = ChameleonTarget.from_hf_state_dict(config_from_hf(hf.config, image_ids, GRID * GRID), hf.state_dict(),
                                              image_ids)
    return hf, ours, image_ids


PROMPTS = torch.tensor([[0, 80, 81, 85, 86, 87, BOI], [1, 1, 0, 83, 84, 87, BOI]])  # the second left-padded
MASKS = PROMPTS != 1
MASKS[1, :2] = False


def _reference_greedy(hf, image_ids: torch.Tensor, prompt: torch.Tensor, mask: torch.Tensor, cfg: float,
                      null_prompt: tuple[int, ...] = (0, BOI), row_width: int = 0, steps: int = GRID * GRID
                      ) -> list[int]:
    """Greedy image tokens from `transformers`' forward: full recompute per token, logits of
    non-image tokens dropped, CFG over [cond, uncond] rows with the uncond prompt left-padded.
    Positions are slots (padding included) and padded queries see themselves, as in the runtime.
    `row_width` > 0: Lumina-mGPT's rule (the last id of `image_ids`, the row-end token, forced at
    each row's end and forbidden elsewhere), applied after CFG as its logits processors do."""
    length = prompt.size(0)
    rows = [prompt]
    masks = [mask]
    if cfg > 1:
        null = torch.full_like(prompt, 1)
        null[-len(null_prompt):] = torch.tensor(null_prompt)
        rows.append(null)
        masks.append(torch.arange(length) >= length - len(null_prompt))
    ids, valid = torch.stack(rows), torch.stack(masks)
    out: list[int] = []
    with torch.no_grad():
        for i in range(steps):
            s = ids.size(1)
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            attend = (causal[None] & valid[:, None, :]) | torch.eye(s, dtype=torch.bool)[None]
            h = hf.model(input_ids=ids, attention_mask=attend[:, None],
                         position_ids=torch.arange(s).expand(len(ids), s)).last_hidden_state[:, -1]
            logits = hf.lm_head(h)[:, image_ids].float()
            if cfg > 1:
                logits = logits[1:] + cfg * (logits[:1] - logits[1:])
            if row_width:
                logits[:, -1] = float("-inf")
            k = len(image_ids) - 1 if row_width and (i + 1) % row_width == 0 else int(logits[0].argmax())
            out.append(k)
            ids = torch.cat([ids, image_ids[k].expand(len(ids), 1)], dim=1)
            valid = torch.cat([valid, torch.ones(len(ids), 1, dtype=torch.bool)], dim=1)
    return out


def test_logits_equal_transformers_forward(pair) -> None:
    hf, ours, image_ids = pair
    prompt = PROMPTS[:1]
    tokens = torch.randint(0, IMAGE_CODES, (1, GRID * GRID), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = torch.cat([prompt, image_ids[tokens]], dim=1)
        want = hf.lm_head(hf.model(input_ids=full).last_hidden_state)[:, prompt.size(1) - 1:-1][..., image_ids]
        got, hidden = ours.forward_train(prompt, tokens)
        # the cached path (prefill, then the image tokens as one block) computes the same
        ours.for_prompts(prompt.size(1))
        cache = ours.new_cache(1, 64, "cpu")
        h_prompt = ours.prefill(prompt, cache)
        block = ours.forward_cached(ours.tok_embeddings(tokens[:, :-1]), torch.arange(7, 7 + 15),
                                    torch.ones(15, 15, dtype=torch.bool).tril(), cache)
        cached = ours.logits(torch.cat([h_prompt[:, -1:], block], dim=1))
    assert torch.allclose(got, want.float(), atol=1e-5, rtol=0)
    assert torch.allclose(cached, want.float(), atol=1e-5, rtol=0)
    assert hidden.shape == (1, 7 + 15, 64)


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_ar_greedy_equals_the_transformers_reference(pair, cfg: float) -> None:
    hf, ours, image_ids = pair
    ours.for_prompts(PROMPTS.size(1))
    result = generate(ours, None, MethodSpec(method="ar", sampling=SamplingParams(greedy=True, cfg=cfg)), PROMPTS,
                      cond_masks=MASKS)
    for row in range(len(PROMPTS)):
        assert result.tokens[row].tolist() == _reference_greedy(hf, image_ids, PROMPTS[row], MASKS[row], cfg), row


EXACT = dict(tree="small_12", depth=3, top_k_draft=3, total_tokens=10, lantern_k=4, lantern_delta=0.0,
             lantern_lambda=1.0)


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_every_method_reproduces_ar_greedy(pair, cfg: float) -> None:
    _, ours, _ = pair
    ours.for_prompts(PROMPTS.size(1))
    torch.manual_seed(3)
    drafter = Drafter(DrafterConfig.for_target(ours.config)).eval()
    assert drafter.config.rope == "1d"
    drafter.embed_tokens.weight.data.copy_(ours.tok_embeddings.weight)
    g = torch.Generator().manual_seed(1)
    neighbours = torch.stack([torch.randperm(IMAGE_CODES, generator=g)[:IMAGE_CODES - 1] for _ in range(IMAGE_CODES)])
    params = SamplingParams(greedy=True, cfg=cfg)
    ar = generate(ours, None, MethodSpec(method="ar", sampling=params), PROMPTS, cond_masks=MASKS)
    for method in ("sd", "eagle2", "ddd", "lantern", "lantern++", "sjd", "pjd"):
        out = generate(ours, None if method in ("sjd", "pjd") else drafter, MethodSpec(method=method, sampling=params, **EXACT),
                       PROMPTS, cond_masks=MASKS, neighbours=neighbours)
        assert torch.equal(out.tokens, ar.tokens), method
        assert out.stats["target_forwards"] < ar.stats["target_forwards"], method  # drafts were accepted


def test_a_prompt_of_another_length_than_the_decoders_is_refused(pair) -> None:
    _, ours, _ = pair
    ours.for_prompts(5)
    with pytest.raises(ValueError, match="prompt length 7"):
        generate(ours, None, MethodSpec(method="ar", sampling=SamplingParams(greedy=True)), PROMPTS, cond_masks=MASKS)
    ours.for_prompts(PROMPTS.size(1))


def test_state_dicts_of_another_shape_are_refused(pair) -> None:
    from runtime.utils.errors import UserError

    hf, _, image_ids = pair
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(4, 8)
    with pytest.raises(UserError, match="q_norm.weight has shape"):
        ChameleonTarget.from_hf_state_dict(config_from_hf(hf.config, image_ids, 16), state, image_ids)
    del state["lm_head.weight"]
    with pytest.raises(UserError, match="missing"):
        ChameleonTarget.from_hf_state_dict(config_from_hf(hf.config, image_ids, 16), state, image_ids)


# -- a Chameleon folder through `runtime run` ---------------------------------------------------------

WORDS = ["a", "red", "cat", "blue", "dog", "on", "the", "grass"]


def write_folder(hf, root, name: str, extra_tokens: dict[str, int], architectures: list[str] | None = None):
    """Save `hf` as an HF-layout folder `root/name` whose vocabulary also holds `extra_tokens`, with a
    word-level tokenizer.json over it, and Meta's vqgan.ckpt layout for its VQ decoder in `root`."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from runtime.models.chameleon_vq import ChameleonVQ, ChameleonVQConfig

    vocab = {**hf.config.vocabulary_map, **extra_tokens}
    hf.config.vocabulary_map = vocab
    model_dir = root / name
    hf.save_pretrained(model_dir)
    if architectures is not None:
        config = json.loads((model_dir / "config.json").read_text())
        config["architectures"] = architectures
        (model_dir / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    torch.manual_seed(7)
    vq = ChameleonVQ(ChameleonVQConfig.from_hf(hf.config.vq_config.to_dict()))
    torch.save({"state_dict": vq.state_dict()}, root / "vqgan.ckpt")
    return model_dir


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Anole-layout folder (config.json, model.safetensors, tokenizer.json), Meta's
    vqgan.ckpt layout for the VQ decoder beside it, and a drafter folder for it."""
    from runtime.models.loading import save_drafter_folder

    root = tmp_path_factory.mktemp("chameleon")
    hf = tiny_hf_chameleon()
    write_folder(hf, root, "Anole-tiny", {"<reserved08706>": 71, **{w: 72 + i for i, w in enumerate(WORDS)}})
    image_ids = torch.tensor(hf.model.vocabulary_mapping.image_tokens)
    target = ChameleonTarget.from_hf_state_dict(config_from_hf(hf.config, image_ids, GRID * GRID), hf.state_dict(),
                                                image_ids)
    drafter = Drafter(DrafterConfig.for_target(target.config))
    drafter.embed_tokens.weight.data.copy_(target.tok_embeddings.weight)
    save_drafter_folder(root / "drafter", drafter.config, drafter)
    (root / "prompts.txt").write_text("a red cat\nthe blue dog on the grass\n")
    return root


def _run(run_cli, root, out, *extra):
    return run_cli("run", "--model", str(root / "Anole-tiny"), "--vq-ckpt", str(root / "vqgan.ckpt"), "--prompts",
                   str(root / "prompts.txt"), "--device", "cpu", "--out", str(out), *extra)


def test_runtime_run_writes_images_with_lantern_pp_equal_to_ar(run_cli, folder, tmp_path) -> None:
    import json

    import numpy as np

    ar = _run(run_cli, folder, tmp_path / "ar", "--method", "ar", "--greedy")
    lpp = _run(run_cli, folder, tmp_path / "lpp", "--method", "lantern++", "--drafter", str(folder / "drafter"),
               "--tree", "chain3", "--lantern-lambda", "1", "--greedy")
    assert ar.exit_code == 0, ar.stderr
    assert lpp.exit_code == 0, lpp.stderr
    tokens_ar, tokens_lpp = np.load(tmp_path / "ar" / "tokens.npy"), np.load(tmp_path / "lpp" / "tokens.npy")
    assert tokens_ar.shape == (2, GRID * GRID) and (tokens_ar == tokens_lpp).all()
    assert len(list((tmp_path / "lpp").glob("*.png"))) >= 2
    result = json.loads((tmp_path / "lpp" / "result.json").read_text())
    assert result["sampling"]["cfg"] == 3.0 and result["model"]["type"] == "chameleon"  # Anole's guidance
    sampled = _run(run_cli, folder, tmp_path / "s", "--method", "lantern++", "--drafter", str(folder / "drafter"),
                   "--tree", "chain3", "--num-images", "3")
    assert sampled.exit_code == 0, sampled.stderr


@pytest.mark.parametrize("extra, words", [
    (["--classes", "1"], "--classes does nothing for a Chameleon model"),
    (["--gpt-model", "GPT-B"], "--gpt-model is for LlamaGen checkpoints"),
    (["--image-size", "256"], "generates 64 px images"),
])
def test_chameleon_flags_that_do_not_apply_are_refused(run_cli, folder, tmp_path, extra, words) -> None:
    res = _run(run_cli, folder, tmp_path / "o", "--method", "ar", *extra)
    assert res.exit_code == 2 and words in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()


def test_a_folder_without_vq_decoder_needs_the_vqgan_checkpoint(run_cli, folder, tmp_path) -> None:
    res = run_cli("run", "--model", str(folder / "Anole-tiny"), "--prompts", str(folder / "prompts.txt"),
                  "--device", "cpu", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "holds no VQ decoder" in res.stderr and "--vq-ckpt" in res.stderr


def test_a_llamagen_drafter_is_refused_for_a_chameleon_target(run_cli, folder, tmp_path) -> None:
    from runtime.models.configs import gpt_config
    from runtime.models.loading import save_drafter_folder

    cfg = DrafterConfig.for_target(gpt_config("GPT-tiny", image_size=64, vocab_size=IMAGE_CODES))
    save_drafter_folder(tmp_path / "d", cfg, Drafter(cfg))
    res = _run(run_cli, folder, tmp_path / "o", "--method", "sd", "--drafter", str(tmp_path / "d"))
    assert res.exit_code == 2 and "cannot serve a Chameleon target" in res.stderr, res.stderr


# -- LANTERN's Chameleon drafter layout (jadohu/anole_drafter) ------------------------------------------


def _lantern_drafter_folder(hf, path):
    """A LANTERN-layout Anole drafter built from transformers' own decoder layer (so the key names
    are the reference's, not ours): config.json + pytorch_model.bin."""
    import json

    layer_cfg = transformers.ChameleonConfig(**{**hf.config.to_dict(), "num_hidden_layers": 1})
    module = torch.nn.Module()
    module.embed_tokens = torch.nn.Embedding(92, 64)
    module.fc = torch.nn.Linear(128, 64, bias=True)
    module.layers = torch.nn.ModuleList([transformers.models.chameleon.modeling_chameleon.ChameleonDecoderLayer(
        layer_cfg, 0)])
    torch.manual_seed(11)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if "norm" in name else 0.0))
        module.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
    path.mkdir()
    torch.save(module.state_dict(), path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps({
        "model_type": "chameleon", "architectures": ["ChameleonForConditionalGeneration"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 92, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "swin_norm": False}))
    return module


def test_lantern_drafter_layout_loads_strictly_and_computes_what_transformers_does(pair, tmp_path) -> None:
    from runtime.utils.errors import UserError
    from runtime.models.chameleon_drafter import load_chameleon_drafter

    hf, ours, image_ids = pair
    reference = _lantern_drafter_folder(hf, tmp_path / "d")
    drafter = load_chameleon_drafter(tmp_path / "d", ours)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, IMAGE_CODES, (1, 9), generator=g)
    hidden = torch.randn(1, 9, 64, generator=g)
    rotary = transformers.models.chameleon.modeling_chameleon.ChameleonRotaryEmbedding(hf.config)
    with torch.no_grad():
        x = reference.fc(torch.cat([reference.embed_tokens(image_ids[tokens]), hidden], -1))
        position_ids = torch.arange(9)[None]
        causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]  # the layer alone gets no mask of its own
        want = reference.layers[0](x, attention_mask=causal, position_ids=position_ids,
                                   position_embeddings=rotary(x, position_ids))
        want = want[0] if isinstance(want, tuple) else want
        got = drafter.forward_train(hidden, tokens)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    # strict: a missing key and a wrong shape are named
    state = torch.load(tmp_path / "d" / "pytorch_model.bin")
    torch.save({k: v for k, v in state.items() if k != "fc.bias"}, tmp_path / "d" / "pytorch_model.bin")
    with pytest.raises(UserError, match="missing"):
        load_chameleon_drafter(tmp_path / "d", ours)
    torch.save({**state, "fc.bias": torch.zeros(3)}, tmp_path / "d" / "pytorch_model.bin")
    with pytest.raises(UserError, match="fc.bias has shape"):
        load_chameleon_drafter(tmp_path / "d", ours)


@pytest.mark.parametrize("method", ["sd", "eagle2", "lantern++", "cool-sd", "cool-eagle2"])
def test_lantern_drafter_runs_every_method_exactly(pair, tmp_path, method) -> None:
    from runtime.models.chameleon_drafter import load_chameleon_drafter

    hf, ours, _ = pair
    _lantern_drafter_folder(hf, tmp_path / "d")
    drafter = load_chameleon_drafter(tmp_path / "d", ours)
    ours.for_prompts(PROMPTS.size(1))
    params = SamplingParams(greedy=True, cfg=3.0)
    ar = generate(ours, None, MethodSpec(method="ar", sampling=params), PROMPTS, cond_masks=MASKS)
    out = generate(ours, drafter, MethodSpec(method=method, sampling=params, **EXACT, cool_delta=0.5, cool_nu=0.3),
                   PROMPTS, cond_masks=MASKS,
                   neighbours=torch.zeros(IMAGE_CODES, 4, dtype=torch.long))
    assert torch.equal(out.tokens, ar.tokens)


def test_runtime_run_with_a_lantern_drafter_folder(run_cli, folder, tmp_path) -> None:
    hf = tiny_hf_chameleon()
    _lantern_drafter_folder(hf, tmp_path / "d")
    res = _run(run_cli, folder, tmp_path / "o", "--method", "lantern++", "--drafter", str(tmp_path / "d"),
               "--tree", "chain3")
    assert res.exit_code == 0, res.stderr


def test_drafter_round_trip_train_load_and_run_lantern_pp(run_cli, folder, tmp_path) -> None:
    import json

    import numpy as np

    out = tmp_path / "drafter"
    train = run_cli("train", "drafter", "--model", str(folder / "Anole-tiny"), "--prompts", str(folder / "prompts.txt"),
                    "--num-images", "16", "--steps", "30", "--batch", "4", "--lr", "3e-3", "--eval-images", "2",
                    "--device", "cpu", "--threads", "1", "--out", str(out))
    assert train.exit_code == 0, train.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"]["kind"] == "chameleon" and manifest["data"]["images"] == 16
    assert manifest["data"]["settings"]["cfg"] == 3.0 and manifest["metrics"]["greedy_tau_sd_depth4"] >= 1.0
    assert json.loads((out / "config.json").read_text())["rope"] == "1d"
    ar = _run(run_cli, folder, tmp_path / "ar", "--method", "ar", "--greedy")
    lpp = _run(run_cli, folder, tmp_path / "lpp", "--method", "lantern++", "--drafter", str(out), "--tree", "chain3",
               "--lantern-lambda", "1", "--greedy")
    assert ar.exit_code == 0 and lpp.exit_code == 0, lpp.stderr
    assert (np.load(tmp_path / "ar" / "tokens.npy") == np.load(tmp_path / "lpp" / "tokens.npy")).all()


def test_training_flags_of_llamagen_targets_are_refused_for_a_chameleon_folder(run_cli, folder, tmp_path) -> None:
    res = run_cli("train", "drafter", "--model", str(folder / "Anole-tiny"), "--prompts", str(folder / "prompts.txt"),
                  "--classes", "1", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "--classes does not apply to a Chameleon folder" in res.stderr, res.stderr
    res = run_cli("train", "drafter", "--model", str(folder / "Anole-tiny"), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "needs --prompts FILE" in res.stderr


# -- Lumina-mGPT's layout: size tokens in the prompt, a row-end token after every row ----------------


@pytest.fixture(scope="module")
def lumina_folder(tmp_path_factory):
    """A tiny Lumina-mGPT-layout folder: 64 px = 2 grid units = 4 x 4 codes + a row-end token per row."""
    root = tmp_path_factory.mktemp("lumina")
    hf = tiny_hf_chameleon(seed=1)
    words = ["a", "red", "cat", "Generate", "image", "prompt"]
    write_folder(hf, root, "Lumina-mGPT-tiny",
                 {"<reserved08706>": 71, "<reserved08799>": 72, "<reserved08802>": 73,
                  **{w: 74 + i for i, w in enumerate(words)}}, ["ChameleonXLLMXForConditionalGeneration"])
    (root / "prompts.txt").write_text("a red cat\n")
    return root, hf


def test_lumina_layout_greedy_equals_the_transformers_reference_with_its_rules(lumina_folder) -> None:
    from runtime.models.chameleon_folder import load_chameleon_folder

    root, hf = lumina_folder
    target, vq, encoder, _ = load_chameleon_folder(root / "Lumina-mGPT-tiny", str(root / "vqgan.ckpt"), image_size=64)
    cfg = target.config
    assert (cfg.row_width, cfg.block_size, cfg.vocab_size, cfg.newline) == (5, 20, 65, 64)
    ids, mask = encoder(["a red cat"])
    assert ids[0, -3:].tolist() == [BOI, 73, 73] and ids[0, 0].item() == 0  # the image start ends the prompt
    target.for_prompts(ids.size(1))
    image_ids = target.image_token_ids
    for guidance in (1.0, 3.0):
        ours = generate(target, None, MethodSpec(method="ar", sampling=SamplingParams(greedy=True, cfg=guidance)),
                        ids, cond_masks=mask).tokens[0].tolist()
        want = _reference_greedy(hf, image_ids, ids[0], mask[0], guidance, null_prompt=(BOI, 73, 73), row_width=5,
                                 steps=20)
        assert ours == want
        assert [t for i, t in enumerate(ours) if (i + 1) % 5 == 0] == [64] * 4
        assert 64 not in [t for i, t in enumerate(ours) if (i + 1) % 5]
    images = vq.decode_code(torch.tensor([ours]))
    assert images.shape == (1, 3, 64, 64)


def test_lumina_layout_every_method_reproduces_ar_and_sampling_respects_the_rows(lumina_folder) -> None:
    from runtime.models.chameleon_folder import load_chameleon_folder

    root, _ = lumina_folder
    target, _, encoder, _ = load_chameleon_folder(root / "Lumina-mGPT-tiny", None, with_vq=False, image_size=64)
    ids, mask = encoder(["a red cat", "cat"])
    target.for_prompts(ids.size(1))
    torch.manual_seed(3)
    drafter = Drafter(DrafterConfig.for_target(target.config)).eval()
    drafter.embed_tokens.weight.data.copy_(target.tok_embeddings.weight)
    g = torch.Generator().manual_seed(1)
    neighbours = torch.stack([torch.randperm(64, generator=g)[:63] for _ in range(65)])
    params = SamplingParams(greedy=True, cfg=3.0)
    ar = generate(target, None, MethodSpec(method="ar", sampling=params), ids, cond_masks=mask)
    for method in ("sd", "eagle2", "lantern", "lantern++", "sjd", "pjd"):
        out = generate(target, None if method in ("sjd", "pjd") else drafter, MethodSpec(method=method, sampling=params, **EXACT),
                       ids, cond_masks=mask, neighbours=neighbours)
        assert torch.equal(out.tokens, ar.tokens), method
    sampled = generate(target, drafter, MethodSpec(method="lantern++", sampling=SamplingParams(cfg=3.0, top_k=10),
                                                   **{**EXACT, "lantern_lambda": 4.0}),
                       ids, cond_masks=mask, neighbours=neighbours, seed=5).tokens
    row_end = (torch.arange(20) + 1) % 5 == 0
    assert (sampled[:, row_end] == 64).all() and (sampled[:, ~row_end] < 64).all()


def test_lumina_layout_published_pjd_commits_rows_in_parallel_with_the_row_ends_in_place(lumina_folder) -> None:
    """--accept published on the layout the released code was written for: a row's lead is the
    row-end token above it, committed when the row starts; one row in flight is AR."""
    from runtime.models.chameleon_folder import load_chameleon_folder

    root, _ = lumina_folder
    target, _, encoder, _ = load_chameleon_folder(root / "Lumina-mGPT-tiny", None, with_vq=False, image_size=64)
    assert (target.config.row_width, target.config.block_size) == (5, 20)
    ids, mask = encoder(["a red cat", "cat"])
    target.for_prompts(ids.size(1))
    greedy = SamplingParams(greedy=True, cfg=3.0)
    ar = generate(target, None, MethodSpec(method="ar", sampling=greedy), ids, cond_masks=mask)
    one = generate(target, None, MethodSpec(method="pjd", sampling=greedy, accept="published", pjd_rows=1, pjd_window=3),
                   ids, cond_masks=mask)
    assert torch.equal(one.tokens, ar.tokens)
    row_end = (torch.arange(20) + 1) % 5 == 0
    for params in (greedy, SamplingParams(cfg=3.0, top_k=10)):
        out = generate(target, None, MethodSpec(method="pjd", sampling=params, accept="published", pjd_rows=4,
                                                pjd_window=2), ids, cond_masks=mask, seed=2, batch_size=2)
        assert (out.tokens[:, row_end] == 64).all() and (out.tokens[:, ~row_end] < 64).all()
        # row ends cost no forward, rows overlap: a code per forward would need 1 + 16 (AR: 20)
        assert all(f <= 13 for _, f in out.image_counts), out.image_counts


def test_runtime_run_on_a_lumina_folder_writes_images_of_the_asked_size(run_cli, lumina_folder, tmp_path) -> None:
    from PIL import Image

    root, _ = lumina_folder
    res = run_cli("run", "--model", str(root / "Lumina-mGPT-tiny"), "--vq-ckpt", str(root / "vqgan.ckpt"), "--prompts",
                  str(root / "prompts.txt"), "--image-size", "64", "--method", "ar", "--device", "cpu",
                  "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.stderr
    pngs = sorted(p for p in (tmp_path / "o").glob("*.png") if p.name != "grid.png")
    assert pngs and Image.open(pngs[0]).size == (64, 64)
    res = run_cli("run", "--model", str(root / "Lumina-mGPT-tiny"), "--vq-ckpt", str(root / "vqgan.ckpt"), "--prompts",
                  str(root / "prompts.txt"), "--image-size", "64", "--method", "pjd", "--accept", "published",
                  "--pjd-window", "2", "--device", "cpu", "--out", str(tmp_path / "p"))
    assert res.exit_code == 0, res.stderr
    assert Image.open(next(p for p in (tmp_path / "p").glob("image_*.png"))).size == (64, 64)
    bad = run_cli("run", "--model", str(root / "Lumina-mGPT-tiny"), "--vq-ckpt", str(root / "vqgan.ckpt"), "--prompts",
                  str(root / "prompts.txt"), "--image-size", "100", "--device", "cpu", "--out", str(tmp_path / "b"))
    assert bad.exit_code == 2 and "steps of 32 px" in bad.stderr


@pytest.mark.parametrize("context", ["all", "valid"])
def test_the_drafter_sees_a_left_padded_prompt_as_it_was_trained(pair, context: str) -> None:
    """LANTERN's Anole drafter attends to every prompt position, padding included ("all", the
    default); a drafter trained with padding masked ("valid") gets it masked. Greedy output
    stays AR's either way."""
    from dataclasses import replace

    from runtime.core import Decoder
    from runtime.models.chameleon_drafter import ChameleonDrafterConfig

    _, ours, _ = pair
    ours.for_prompts(PROMPTS.size(1))
    torch.manual_seed(3)
    drafter = Drafter(replace(DrafterConfig.for_target(ours.config), condition_context=context)).eval()
    drafter.embed_tokens.weight.data.copy_(ours.tok_embeddings.weight)
    spec = MethodSpec(method="eagle2", sampling=SamplingParams(greedy=True, cfg=1.0), **EXACT)
    dec = Decoder(ours, drafter, spec)
    dec.prefill(PROMPTS[1:], MASKS[1:], seed=0)
    width = PROMPTS.size(1) - 1  # the drafter's condition positions (the last one starts the image)
    seen = dec.policy.dcache.prefix_valid[0, :width].tolist()
    assert seen == ([True] * width if context == "all" else MASKS[1, :width].tolist())
    ar = generate(ours, None, MethodSpec(method="ar", sampling=spec.sampling), PROMPTS[1:], cond_masks=MASKS[1:])
    assert torch.equal(dec.generate_one(PROMPTS[1:], MASKS[1:], seed=0)[0].cpu(), ar.tokens[0])
    lantern_cfg = dict(hidden_size=8, intermediate_size=16, num_attention_heads=2, vocab_size=100)
    assert ChameleonDrafterConfig.from_json(lantern_cfg, "x").condition_context == "all"
    assert ChameleonDrafterConfig.from_json(dict(lantern_cfg, condition_context=context), "x").condition_context == context


def test_runtime_serve_answers_chameleon_prompts_as_runtime_run_with_that_prompt_length(run_cli, folder, tmp_path):
    """Chameleon prompts padded to one length (the captured steps' shapes): a request's images are
    `runtime run --prompt-length L`'s for the same prompt and seed; a longer prompt gets 400, and
    --prompt-length is refused where it does nothing."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    import numpy as np
    from fastapi.testclient import TestClient

    from runtime import ImageGenerator
    from runtime.cli.serve_cmd import _conditioner
    from runtime.serve import build_server

    gen = ImageGenerator(str(folder / "Anole-tiny"), vq_ckpt=str(folder / "vqgan.ckpt"), drafter=str(folder / "drafter"),
                         device="cpu", graph=False, method="lantern++", tree="chain3")
    app, engine, _ = build_server(gen.loaded, gen.spec_for(2), gen.backend, batch_size=2, max_queue=8, timeout_s=120,
                                  conditioner=_conditioner(gen, 12))
    try:
        assert engine.ready.wait(120)
        client = TestClient(app)
        answer = client.post("/v1/images/generations",
                             json={"prompt": "a red cat", "n": 2, "seed": 5, "return_tokens": True}).json()
        long = client.post("/v1/images/generations", json={"prompt": " ".join(["the blue dog on the grass"] * 2)})
    finally:
        engine.stop(drain=False, timeout=30)
    assert long.status_code == 400 and "prompt length 12" in long.json()["error"]["message"]
    (tmp_path / "one.txt").write_text("a red cat\n")
    res = run_cli("run", "--model", str(folder / "Anole-tiny"), "--vq-ckpt", str(folder / "vqgan.ckpt"), "--drafter",
                  str(folder / "drafter"), "--prompts", str(tmp_path / "one.txt"), "--num-images", "2", "--seed", "5",
                  "--prompt-length", "12", "--method", "lantern++", "--tree", "chain3", "--device", "cpu",
                  "--no-graph", "--out", str(tmp_path / "run"))
    assert res.exit_code == 0, res.stderr
    assert [d["tokens"] for d in answer["data"]] == np.load(tmp_path / "run" / "tokens.npy").tolist()
    assert all(d["revised_prompt"] == "a red cat" and "class_id" not in d for d in answer["data"])
    refused = run_cli("run", "--device", "cpu", "--prompt-length", "12", "--out", str(tmp_path / "demo"))
    assert refused.exit_code == 2 and "--prompt-length is for prompted models" in refused.stderr
