"""Tiny random Janus and Emu3 checkpoints made with `transformers`' own classes, saved as a
Hugging Face Hub cache holds them (`HF_HOME/hub/models--OWNER--NAME/snapshots/COMMIT/`, `refs/main`),
so loaders resolve them by Hub id with `HF_HUB_OFFLINE=1`. Nothing is downloaded.

Janus: a 2-layer width-64 Llama, 64 codes in a 4 x 4 grid (64 px, VQ-16-like decoder with 4x
upsampling here), a word-level tokenizer with Janus's special tokens and a chat template of
Janus's shape. Emu3: a 2-layer width-64 Llama, 64 visual tokens, 4 x 4 codes (32 px) + a row-end
token per row.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

JANUS_ID = "tiny-random/Janus-Pro"
EMU3_ID = "tiny-random/Emu3-Gen"
JANUS_GRID = 4
EMU3_GRID = 4
CODES = 64
WORDS = ["a", "red", "cat", "the", "blue", "dog", "on", "grass", "photo", "lowres", "bad", "anatomy", ",", ".",
         "hands", "text", "blurry", "4", "*", ":"]
JANUS_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}<|User|> : {% endif %}"
                  "{% for c in message['content'] %}{{ c['text'] }}{% endfor %}{% endfor %}"
                  "{% if add_generation_prompt %} <|Assistant|> :{% endif %}")


def _sharpen(model: Any, heads: list[torch.nn.Module]) -> None:
    """Non-trivial norms and sharp heads, so a numerical slip shows in greedy tokens."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "vqmodel" not in name and "vision" not in name:
                p.add_(torch.randn_like(p) * 0.1)
        for head in heads:
            head.weight.normal_(0, 0.5)


def _word_tokenizer(special: list[str], extra: dict[str, int], **kwargs: Any) -> Any:
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *special, *WORDS])}
    vocab.update({k: len(vocab) + i for i, k in enumerate(extra)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in special])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **kwargs), vocab


def tiny_janus(seed: int = 0) -> tuple[Any, Any, Any]:
    """(JanusForConditionalGeneration, its tokenizer, its processor), random, eval mode."""
    import transformers

    torch.manual_seed(seed)
    special = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<image_placeholder>",
               "<begin_of_image>", "<end_of_image>", "<|User|>", "<|Assistant|>"]
    tokenizer, vocab = _word_tokenizer(
        special, {}, bos_token=special[0], eos_token=special[1], pad_token=special[2],
        extra_special_tokens={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                              "eoi_token": "<end_of_image>"})
    from tokenizers.processors import TemplateProcessing

    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single=f"{special[0]} $A",
                                                                    special_tokens=[(special[0], vocab[special[0]])])
    cfg = transformers.JanusConfig(
        text_config=dict(model_type="llama", vocab_size=len(vocab) + 4, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=vocab[special[0]], eos_token_id=vocab[special[1]],
                         pad_token_id=vocab[special[2]]),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
                           projection_dim=64, num_image_tokens=JANUS_GRID ** 2, depth=1),
        vq_config=dict(embed_dim=8, num_embeddings=CODES, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 1, 2], num_res_blocks=1, num_patches=JANUS_GRID, projection_dim=64,
                       image_token_embed_dim=64, num_hidden_layers=2),
        image_token_id=vocab["<image_placeholder>"])
    model = transformers.JanusForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").eval()
    _sharpen(model, [model.model.generation_head.vision_head])
    with torch.no_grad():  # distinct image embeddings, so the image tokens steer the next ones
        model.model.generation_embeddings.weight.normal_(0, 1.0)
        model.model.language_model.embed_tokens.weight.normal_(0, 1.0)
    model.generation_config.generation_kwargs = {"boi_token_id": vocab["<begin_of_image>"]}
    model.generation_config.bos_token_id = vocab[special[0]]
    model.generation_config.pad_token_id = vocab[special[2]]
    processor = transformers.JanusProcessor(image_processor=transformers.JanusImageProcessorPil(
        size={"height": 64, "width": 64}), tokenizer=tokenizer, num_image_tokens=JANUS_GRID ** 2,
        chat_template=JANUS_TEMPLATE)
    return model, tokenizer, processor


def tiny_emu3(seed: int = 0) -> tuple[Any, Any]:
    """(Emu3ForConditionalGeneration, its tokenizer), random, eval mode."""
    import transformers

    torch.manual_seed(seed)
    special = ["<|extra_203|>", "<|extra_204|>", "<|endoftext|>", "<|image start|>", "<|image end|>",
               "<|image token|>", "<|extra_201|>", "<|extra_200|>", "<image>"]
    visual = {f"<|visual token {i:06d}|>": 0 for i in range(CODES)}
    tokenizer, vocab = _word_tokenizer(
        special, visual, bos_token=special[0], eos_token=special[1], pad_token=special[2],
        extra_special_tokens={"image_token": "<image>", "boi_token": "<|image start|>", "eoi_token": "<|image end|>",
                              "image_wrapper_token": "<|image token|>", "eof_token": "<|extra_201|>"})
    cfg = transformers.Emu3Config(
        text_config=dict(vocab_size=len(vocab) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=vocab[special[0]], eos_token_id=vocab[special[1]],
                         pad_token_id=vocab[special[2]],
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        vq_config=dict(codebook_size=CODES, embed_dim=4, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 2, 2, 4], num_res_blocks=1, attn_resolutions=[], hidden_size=128,
                       temporal_downsample_factor=4),
        vocabulary_map=vocab)
    model = transformers.Emu3ForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").eval()
    _sharpen(model, [model.lm_head])
    with torch.no_grad():
        model.model.text_model.embed_tokens.weight.normal_(0, 1.0)
    return model, tokenizer


def cache_snapshot(hf_home: Path, repo_id: str, files_from: Path) -> Path:
    """Copy a saved folder into the Hub cache layout under `hf_home`; returns the snapshot folder."""
    import shutil

    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    digest = hashlib.sha1()
    for path in sorted(files_from.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    commit = digest.hexdigest()
    snapshot = repo / "snapshots" / commit
    if snapshot.exists():
        shutil.rmtree(snapshot)
    shutil.copytree(files_from, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def write_hub_cache(hf_home: Path) -> dict[str, Any]:
    """Both tiny models saved (save_pretrained) and placed in a Hub cache at `hf_home`; returns
    {"janus": (model, tokenizer, processor, snapshot), "emu3": (model, tokenizer, snapshot)}."""
    staging = hf_home / "staging"
    janus, jtok, jproc = tiny_janus()
    janus.save_pretrained(staging / "janus")
    jproc.save_pretrained(staging / "janus")
    emu3, etok = tiny_emu3()
    emu3.save_pretrained(staging / "emu3")
    etok.save_pretrained(staging / "emu3")
    return {"janus": (janus, jtok, jproc, cache_snapshot(hf_home, JANUS_ID, staging / "janus")),
            "emu3": (emu3, etok, cache_snapshot(hf_home, EMU3_ID, staging / "emu3"))}


def use_hub_cache(patch: Any, hf_home: Path) -> None:
    """Point huggingface_hub at the cache in `hf_home`, offline (`patch`: a pytest MonkeyPatch)."""
    patch.setenv("HF_HOME", str(hf_home))
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.delenv("HF_HUB_CACHE", raising=False)
