"""Janus-Pro and Emu3 by Hub id (issue 57), on tiny random checkpoints made with `transformers`'
own classes and placed in a Hugging Face cache (`tests/hf_tiny.py`); HF_HUB_OFFLINE=1 throughout.

- the prompt ids equal the model's own processor's;
- AR greedy tokens equal `transformers`' own `generate` (Janus: `generation_mode="image"`; Emu3:
  its negative prompt and row-end rule), images equal its `decode_image_tokens`;
- every method reproduces AR greedy token for token, sampling keeps the law, batch identity;
- the CLI: run by Hub id (ar, sjd, pjd, lantern++ with a drafter it trained), an uncached id is one
  line and exit 2, serve answers the `openai` client with the Hub id as its model.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not (hasattr(transformers, "JanusForConditionalGeneration") and hasattr(transformers, "Emu3ForConditionalGeneration")):
    pytest.skip("this transformers has no Janus / Emu3", allow_module_level=True)

import hf_tiny  # noqa: E402
from runtime.core import MethodSpec, SamplingParams, generate  # noqa: E402
from runtime.utils.errors import UserError  # noqa: E402

PROMPTS = ["a red cat", "the blue dog on the grass"]
EMU3_SIZE = hf_tiny.EMU3_GRID * 8


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hub cache holding both tiny models; HF_HOME points at it and HF_HUB_OFFLINE=1 for the module."""
    home = tmp_path_factory.mktemp("hf_home")
    made = hf_tiny.write_hub_cache(home)
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_HOME", str(home))
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.delenv("HF_HUB_CACHE", raising=False)
    (home / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    yield home, made
    patch.undo()


def _janus(hub):
    from runtime.models.hf_folders import load_janus_folder
    from runtime.models.hub import resolve_model

    return load_janus_folder(Path(resolve_model(hf_tiny.JANUS_ID)))


def _emu3(hub):
    from runtime.models.hf_folders import load_emu3_folder
    from runtime.models.hub import resolve_model

    return load_emu3_folder(Path(resolve_model(hf_tiny.EMU3_ID)), image_size=EMU3_SIZE)


def test_a_hub_id_resolves_to_its_cached_snapshot_and_an_uncached_one_is_one_line(hub) -> None:
    from runtime.models.hub import resolve_model

    home, made = hub
    assert Path(resolve_model(hf_tiny.JANUS_ID)) == made["janus"][3]
    with pytest.raises(UserError, match=r"not in the Hugging Face cache .* run `hf download nobody/Nothing`"):
        resolve_model("nobody/Nothing")
    with pytest.raises(UserError, match=r"hf download tiny-random/Janus-Pro --revision v9"):
        resolve_model(hf_tiny.JANUS_ID, revision="v9")
    with pytest.raises(UserError, match="original release's layout .* --model deepseek-community/Janus-Pro-1B"):
        resolve_model("deepseek-ai/Janus-Pro-1B")
    with pytest.raises(UserError, match="--model-revision v1: .* is a local folder"):
        resolve_model(str(made["janus"][3]), revision="v1")


def test_janus_prompt_ids_equal_its_processors(hub) -> None:
    _, made = hub
    _, _, processor, _ = made["janus"]
    _, _, encoder, _ = _janus(hub)
    for text in PROMPTS:
        conversation = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        rendered = processor.apply_chat_template(conversation, add_generation_prompt=True)
        want = processor(text=rendered, generation_mode="image", return_tensors="pt")["input_ids"][0].tolist()
        assert encoder.ids(text) == want


def test_emu3_prompt_ids_equal_its_processors(hub) -> None:
    _, made = hub
    _, tokenizer, _ = made["emu3"]
    _, _, encoder, _ = _emu3(hub)
    processor = transformers.Emu3Processor(image_processor=transformers.Emu3ImageProcessor(), tokenizer=tokenizer)
    for text in PROMPTS:
        want = processor(text=text, return_for_image_generation=True, image_area=EMU3_SIZE ** 2,
                         return_tensors="pt")["input_ids"][0].tolist()
        assert encoder.ids(text) == want


@pytest.mark.parametrize("cfg", [2.0, 5.0])
def test_janus_ar_greedy_equals_transformers_generate_and_images_its_decoder(hub, cfg: float) -> None:
    """Janus's generate doubles the batch for guidance even at 1 (and then fails), so cfg > 1 here."""
    _, made = hub
    model, _, processor, _ = made["janus"]
    target, vq, encoder, _ = _janus(hub)
    for text in PROMPTS:
        ids, mask = encoder([text])
        target.for_prompts(ids.size(1))
        conversation = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        inputs = processor(text=processor.apply_chat_template(conversation, add_generation_prompt=True),
                           generation_mode="image", return_tensors="pt")
        want = model.generate(**inputs, generation_mode="image", do_sample=False, guidance_scale=cfg)
        got = generate(target, None, MethodSpec(method="ar", sampling=SamplingParams(greedy=True, cfg=cfg)), ids,
                       cond_masks=mask)
        assert got.tokens.tolist() == want.tolist(), text
        assert len(set(want[0].tolist())) > 2  # the comparison is not of a constant image
        with torch.no_grad():
            assert torch.equal(vq.decode_code(got.tokens).permute(0, 2, 3, 1), model.decode_image_tokens(want))


def _emu3_reference(model, cond: torch.Tensor, negative: torch.Tensor, cfg: float) -> torch.Tensor:
    """`transformers`' generate with Emu3's documented image rules: visual tokens only, the row-end
    token after every row (its `prefix_allowed_tokens_fn`), the negative prompt for guidance."""
    side = hf_tiny.EMU3_GRID
    visual, row_end = model.vocabulary_mapping.image_tokens, model.vocabulary_mapping.eol_token_id

    def allowed(_batch: int, input_ids: torch.Tensor) -> list[int]:
        return [row_end] if (input_ids.shape[0] - cond.shape[1] + 1) % (side + 1) == 0 else visual

    guidance = dict(guidance_scale=cfg, negative_prompt_ids=negative,
                    negative_prompt_attention_mask=torch.ones_like(negative)) if cfg > 1 else {}
    out = model.generate(cond, attention_mask=torch.ones_like(cond), max_new_tokens=side * (side + 1),
                         do_sample=False, prefix_allowed_tokens_fn=allowed, **guidance)
    return out[:, cond.shape[1]:]


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_emu3_ar_greedy_equals_transformers_generate_and_images_its_decoder(hub, cfg: float) -> None:
    from runtime.models.hf_folders import EMU3_NEGATIVE_PROMPT

    _, made = hub
    model, _, _ = made["emu3"]
    target, vq, encoder, _ = _emu3(hub)
    negative = torch.tensor([encoder.ids(EMU3_NEGATIVE_PROMPT)])
    for text in PROMPTS:
        ids, mask = encoder([text])
        target.for_prompts(ids.size(1))
        want = _emu3_reference(model, torch.tensor([encoder.ids(text)]), negative, cfg)
        got = generate(target, None, MethodSpec(method="ar", sampling=SamplingParams(greedy=True, cfg=cfg)), ids,
                       cond_masks=mask)
        assert target.image_token_ids[got.tokens].tolist() == want.tolist(), text
        with torch.no_grad():
            side = hf_tiny.EMU3_GRID
            reference = model.decode_image_tokens(image_tokens=torch.cat([want, want[:, :3]], dim=1), height=side,
                                                  width=side)
            assert torch.allclose(vq.decode_code(got.tokens), reference, atol=1e-5, rtol=0)


EXACT = dict(tree="small_12", depth=3, top_k_draft=3, total_tokens=10, lantern_k=4, lantern_delta=0.0,
             lantern_lambda=1.0)
# COOL-SD with every w_d < 1: its annealed rule runs, and is lossless (runtime.core.relaxation)
COOL_STRICT = dict(cool_delta=0.5, cool_nu=0.3)


def _random_drafter(target):
    from runtime.models.configs import DrafterConfig
    from runtime.models.drafter import Drafter

    torch.manual_seed(3)
    drafter = Drafter(DrafterConfig.for_target(target.config)).eval()
    drafter.embed_tokens.weight.data.copy_(target.tok_embeddings.weight)
    return drafter


@pytest.mark.parametrize("family", ["janus", "emu3"])
def test_every_method_reproduces_ar_greedy_batched(hub, family: str) -> None:
    target, vq, encoder, _ = _janus(hub) if family == "janus" else _emu3(hub)
    ids, mask = encoder(PROMPTS)
    target.for_prompts(ids.size(1))
    drafter = _random_drafter(target)
    params = SamplingParams(greedy=True, cfg=3.0)
    ar = generate(target, None, MethodSpec(method="ar", sampling=params), ids, cond_masks=mask)
    for method in ("sd", "eagle2", "lantern", "lantern++", "cool-sd", "cool-eagle2", "sjd", "pjd"):
        out = generate(target, None if method in ("sjd", "pjd") else drafter,
                       MethodSpec(method=method, sampling=params, **EXACT, **COOL_STRICT), ids, cond_masks=mask,
                       vq=vq, batch_size=2)
        assert torch.equal(out.tokens, ar.tokens), (family, method)
    alone = generate(target, drafter, MethodSpec(method="lantern++", sampling=params, **EXACT), ids[1:],
                     cond_masks=mask[1:], vq=vq)
    assert torch.equal(alone.tokens[0], ar.tokens[1])  # an image's tokens do not depend on its batch-mates


@pytest.mark.parametrize("family", ["janus", "emu3"])
def test_sampling_keeps_ar_law_and_never_a_zero_probability_token(hub, family: str) -> None:
    """The first image token's law over 400 seeds: exact LANTERN++ (lambda 1) and sjd against AR's
    own p, by total variation (the sampling noise of 400 draws is about 0.1 here)."""
    target, _, encoder, _ = _janus(hub) if family == "janus" else _emu3(hub)
    ids, mask = encoder(PROMPTS[:1])
    target.for_prompts(ids.size(1))
    drafter = _random_drafter(target)
    params = SamplingParams(temperature=1.0, cfg=3.0, top_k=8)
    n = 400
    conds, masks = ids.expand(n, -1), mask.expand(n, -1)
    seen = {}
    for method in ("ar", "lantern++", "cool-sd", "sjd"):
        out = generate(target, None if method == "sjd" else drafter,
                       MethodSpec(method=method, sampling=params, **EXACT, **COOL_STRICT), conds, cond_masks=masks,
                       seed=0, batch_size=50)
        seen[method] = out.tokens
    vocab = target.config.vocab_size
    for method in ("lantern++", "cool-sd", "sjd"):
        for position in (0, 5):
            a = torch.bincount(seen["ar"][:, position], minlength=vocab).float() / n
            b = torch.bincount(seen[method][:, position], minlength=vocab).float() / n
            assert 0.5 * (a - b).abs().sum() < 0.2, (family, method, position)
    # top-k 8: no token outside the support the guided distribution allows
    with torch.no_grad():
        cache = target.new_cache(2, target.config.cls_token_num + 4, "cpu")
        guided = torch.cat([ids, target.null_condition(ids)])
        hidden = target.prefill(guided, cache, torch.cat([mask, target.null_condition_mask(mask)]))
        logits = target.logits(hidden[:, -1])
        mixed = logits[1] + 3.0 * (logits[0] - logits[1])
        support = set(mixed.topk(8).indices.tolist())
    for method, tokens in seen.items():
        assert set(tokens[:, 0].tolist()) <= support, method


def _run(run_cli, home: Path, out: Path, model: str, *extra: str):
    size = ("--image-size", str(EMU3_SIZE)) if model == hf_tiny.EMU3_ID else ()
    return run_cli("run", "--model", model, *size, "--prompts", str(home / "prompts.txt"), "--device", "cpu",
                   "--out", str(out), *extra)


@pytest.mark.slow
@pytest.mark.parametrize("model", [hf_tiny.JANUS_ID, hf_tiny.EMU3_ID])
def test_runtime_run_by_hub_id_offline(run_cli, hub, tmp_path, model: str) -> None:
    """ar, sjd, pjd (lossless, published), and lantern++ with a drafter `runtime train drafter`
    made for the target: greedy all equal AR; batched and graph mode where given."""
    home, _ = hub
    ar = _run(run_cli, home, tmp_path / "ar", model, "--method", "ar", "--greedy")
    assert ar.exit_code == 0, ar.stderr
    tokens = np.load(tmp_path / "ar" / "tokens.npy")
    result = json.loads((tmp_path / "ar" / "result.json").read_text())
    assert result["model"]["name"] == model and len(list((tmp_path / "ar").glob("*.png"))) >= 2
    for name, extra in (("sjd", ["--method", "sjd", "--batch-size", "2", "--graph"]),
                        ("pjd", ["--method", "pjd", "--batch-size", "2", "--graph"])):
        res = _run(run_cli, home, tmp_path / name, model, "--greedy", *extra)
        assert res.exit_code == 0, res.stderr
        assert (np.load(tmp_path / name / "tokens.npy") == tokens).all(), name
    published = _run(run_cli, home, tmp_path / "pub", model, "--method", "pjd", "--accept", "published",
                     "--batch-size", "2")
    assert published.exit_code == 0, published.stderr
    drafter = tmp_path / "drafter"
    size = ["--image-size", str(EMU3_SIZE)] if model == hf_tiny.EMU3_ID else []
    train = run_cli("train", "drafter", "--model", model, *size, "--prompts", str(home / "prompts.txt"),
                    "--num-images", "8", "--steps", "20", "--batch", "4", "--eval-images", "2", "--device", "cpu",
                    "--threads", "1", "--out", str(drafter))
    assert train.exit_code == 0, train.stderr
    lpp = _run(run_cli, home, tmp_path / "lpp", model, "--method", "lantern++", "--drafter", str(drafter),
               "--tree", "chain3", "--lantern-lambda", "1", "--greedy", "--batch-size", "2", "--graph")
    assert lpp.exit_code == 0, lpp.stderr
    assert (np.load(tmp_path / "lpp" / "tokens.npy") == tokens).all()
    auto = _run(run_cli, home, tmp_path / "auto", model, "--method", "auto", "--profile-name", "cpu-serve",
                "--drafter", str(drafter), "--no-graph")  # the profile's [auto] table picks the method
    assert auto.exit_code == 0, auto.stderr


def test_an_uncached_hub_id_offline_is_one_line_and_exit_2(run_cli, hub, tmp_path) -> None:
    res = run_cli("run", "--model", "deepseek-community/Janus-Pro-1B", "--device", "cpu", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert "run `hf download deepseek-community/Janus-Pro-1B`" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()


def test_flags_that_do_nothing_for_a_janus_folder_are_refused(run_cli, hub, tmp_path) -> None:
    home, _ = hub
    res = _run(run_cli, home, tmp_path / "o", hf_tiny.JANUS_ID, "--vq-ckpt", "x.ckpt")
    assert res.exit_code == 2 and "--vq-ckpt does nothing for a Janus folder" in res.stderr
    res = _run(run_cli, home, tmp_path / "o", hf_tiny.JANUS_ID, "--image-size", "384")
    assert res.exit_code == 2 and "generates 16 px images" in res.stderr
    res = run_cli("run", "--model-revision", "main", "--device", "cpu", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "--model-revision applies to a model named by its Hub id" in res.stderr


def test_the_original_janus_layout_is_named_with_its_conversion(tmp_path) -> None:
    from runtime.models.hf_folders import read_family

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "multi_modality"}))
    with pytest.raises(UserError, match="deepseek-community/Janus-Pro-1B"):
        read_family(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model", [hf_tiny.JANUS_ID, hf_tiny.EMU3_ID])
def test_runtime_serve_by_hub_id_answers_the_openai_client(hub, tmp_path, model: str) -> None:
    """`runtime serve --model OWNER/NAME` in its own process (HF_HUB_OFFLINE=1): /v1/models names
    the Hub id, the official client gets images for a text prompt, their tokens are `runtime run`'s."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    import base64
    import io
    import os

    from PIL import Image
    from serve_process import serving

    home, _ = hub
    size = ["--image-size", str(EMU3_SIZE)] if model == hf_tiny.EMU3_ID else []
    flags = ["--model", model, *size, "--no-graph", "--method", "sjd", "--batch-size", "2", "--max-queue", "8"]
    env = {"HF_HOME": os.environ["HF_HOME"], "HF_HUB_OFFLINE": "1"}
    with serving(flags, tmp_path / "stderr.txt", env=env) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [model]
        answer = client.images.generate(model=model, prompt="a red cat", n=2, response_format="b64_json",
                                        extra_body={"seed": 5, "return_tokens": True})
    side = EMU3_SIZE if model == hf_tiny.EMU3_ID else 4 * hf_tiny.JANUS_GRID
    assert [Image.open(io.BytesIO(base64.b64decode(d.b64_json))).size for d in answer.data] == [(side, side)] * 2
    served = [d.model_extra["tokens"] for d in answer.data]
    (tmp_path / "one.txt").write_text("a red cat\n")
    from runtime.cli.serve_cmd import DEFAULT_PROMPT_LENGTH

    length = max(DEFAULT_PROMPT_LENGTH, _min_length(model))  # serve's prompt length
    # the image's own reproduce line, with the prompt file and the server's model and device flags
    line = shlex.split(answer.data[0].model_extra["reproduce"])
    assert line[:2] == ["runtime", "run"] and ["--prompt-length", str(length)] == line[line.index("--prompt-length"):][:2]
    argv = [str(tmp_path / "one.txt") if word == "PROMPT_FILE" else word for word in line[2:]]
    res = subprocess_run(["run", *argv, "--model", model, *size, "--no-graph", "--device", "cpu",
                          "--out", str(tmp_path / "run")], env)
    assert res.returncode == 0, res.stderr
    assert served == np.load(tmp_path / "run" / "tokens.npy").tolist()


def _min_length(model: str) -> int:
    from runtime.models.hub import resolve_model

    if model != hf_tiny.EMU3_ID:
        return 2
    from runtime.models.hf_folders import load_emu3_folder

    return load_emu3_folder(Path(resolve_model(model)), image_size=EMU3_SIZE, with_vq=False)[2].min_length


def subprocess_run(args: list[str], env: dict[str, str]):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "runtime", *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)


def test_a_checkpoint_file_by_hub_id_and_file_name(hub, tmp_path) -> None:
    """OWNER/NAME:FILE (official LlamaGen and LANTERN files) resolves to the cached file; a file the
    cache lacks is one line naming the download."""
    from runtime.models.hub import resolve_file

    home, _ = hub
    staged = tmp_path / "repo"
    staged.mkdir()
    (staged / "c2i_B_256.pt").write_bytes(b"weights")
    hf_tiny.cache_snapshot(home, "FoundationVision/LlamaGen", staged)
    path = resolve_file("FoundationVision/LlamaGen:c2i_B_256.pt")
    assert Path(path).read_bytes() == b"weights"
    assert resolve_file(str(staged / "c2i_B_256.pt")) == str(staged / "c2i_B_256.pt")  # a local path stays
    with pytest.raises(UserError, match="run `hf download FoundationVision/LlamaGen vq_ds16_c2i.pt`"):
        resolve_file("FoundationVision/LlamaGen:vq_ds16_c2i.pt")
