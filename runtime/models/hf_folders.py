"""Loading Janus-Pro and Emu3 folders in `transformers`' layout (a Hub snapshot or a local copy):
`config.json` (`model_type` janus / emu3), the weights, and the model's own tokenizer.

- **Janus / Janus-Pro** (`JanusForConditionalGeneration`): the prompt is the processor's: the chat
  template over `[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]` with the
  generation prompt, then the image start `<begin_of_image>`, tokenized with the tokenizer's
  special tokens (bos); guidance is Janus's (the prompt with all but bos and the image start
  padded), scale 5; 24 x 24 codes of LlamaGen's VQ-16 at 384 px, decoded by `JanusVQVAE`.
- **Emu3** (`Emu3ForConditionalGeneration`): the prompt is the processor's with
  `return_for_image_generation=True`: `bos + PROMPT + <|image start|> + "{H}*{W}" + <|image token|>`;
  the unconditional prompt is BAAI's negative prompt in the same template (Emu3's generation
  script); the image is H rows of W codes each followed by the row-end token `<|extra_200|>`
  (forced there, forbidden elsewhere, as its `prefix_allowed_tokens_fn`); 90 x 90 codes at 720 px,
  decoded by `Emu3VQVAE` (8 px per code).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from runtime.utils.errors import UserError
from runtime.models.chameleon import ChameleonConfig, ChameleonTarget, config_from_hf
from runtime.models.chameleon_folder import read_model_config
from runtime.models.config_checks import check_config_fields

JANUS_SAMPLING: dict[str, Any] = {"cfg": 5.0, "top_k": 0, "temperature": 1.0, "top_p": 1.0}
JANUS_SAMPLING_SOURCE = "model default (Janus-Pro's generation: guidance 5, temperature 1)"
EMU3_SAMPLING: dict[str, Any] = {"cfg": 3.0, "top_k": 2048, "temperature": 1.0, "top_p": 1.0}
EMU3_SAMPLING_SOURCE = "model default (Emu3-Gen's generation config: guidance 3.0, top-k 2048)"
EMU3_NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, "
                        "cropped, worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, "
                        "username, blurry.")
EMU3_ROW_END = "<|extra_200|>"
EMU3_DEFAULT_SIZE = 720
FAMILIES = ("chameleon", "janus", "emu3")


def read_family(folder: Path) -> str | None:
    """The folder's model family from its config.json `model_type` (chameleon, janus, emu3); None
    where the folder has no config.json; one line for a config this runtime does not run."""
    config = read_model_config(folder)
    if config is None:
        return None
    kind = config.get("model_type")
    if kind in FAMILIES:
        return str(kind)
    if kind == "multi_modality" or kind == "Emu3":
        raise UserError(f"{folder}: this is the original release's layout (model_type {kind!r}, remote code); the "
                        "runtime reads transformers' layout: use deepseek-community/Janus-Pro-1B / -7B or "
                        "BAAI/Emu3-Gen-hf (`runtime models` lists them)")
    if kind is None:
        return None
    raise UserError(f"{folder}: model_type {kind!r} is not a family --model runs (chameleon, janus, emu3; a LlamaGen "
                    "folder goes in --gpt-ckpt); `runtime models` lists what the runtime runs")


@dataclass
class ChatPromptEncoder:
    """Text -> prompt token ids (n, L) left-padded, and their mask (n, L), through the model's own
    tokenizer: `render(text)` is the prompt's text (template and image start included), tokenized
    with the tokenizer's special tokens as the model's processor does. `min_length`: the shortest
    L (the unconditional prompt must fit)."""

    tokenizer: Any
    pad: int
    render: Any  # Callable[[str], str]
    min_length: int = 2

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(self.render(text))["input_ids"])

    def __call__(self, texts: Sequence[str], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.ids(text) for text in texts]
        longest = max(len(r) for r in rows)
        if length is not None and longest > length:
            raise UserError(f"a prompt is {longest} tokens, more than --prompt-length {length}; shorten it or "
                            "raise --prompt-length")
        if length is not None and length < self.min_length:
            raise UserError(f"--prompt-length {length}: this model's unconditional prompt is {self.min_length} "
                            f"tokens; give at least {self.min_length}")
        length = max(longest, self.min_length) if length is None else length
        tokens = torch.full((len(rows), length), self.pad, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.bool)
        for i, row in enumerate(rows):
            tokens[i, length - len(row):] = torch.tensor(row)
            mask[i, length - len(row):] = True
        return tokens, mask


def _config(folder: Path) -> dict[str, Any]:
    config = read_model_config(folder)
    if config is None:
        raise UserError(f"{folder}: no config.json; give the model's folder (or its Hub id)")
    check_config_fields(config, folder)
    return config


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    missing = [name for name in ("tokenizer.json", "tokenizer_config.json") if not (folder / name).is_file()]
    if missing:
        raise UserError(f"{folder}: no {missing[0]}; the folder needs tokenizer.json and tokenizer_config.json "
                        "(re-download the model)")
    if _asks_for_code(folder / "tokenizer_config.json"):
        raise UserError(f"{folder}: its tokenizer_config.json names code of its own (auto_map), which the runtime "
                        "never runs; use the model's transformers-layout repository (runtime models lists them)")
    try:
        # never the folder's own code: with trust_remote_code unset transformers would ask in a terminal
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise UserError(f"{folder}: its tokenizer does not load ({str(err).splitlines()[0]}); the folder needs "
                        "tokenizer.json and tokenizer_config.json (re-download the model)") from None


def _asks_for_code(config: Path) -> bool:
    """Whether a tokenizer config names Python of its own (`auto_map`: remote code)."""
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False  # transformers' own reading reports it
    return isinstance(data, dict) and "auto_map" in data


TEMPLATE_SECONDS = 5.0  # a chat template renders a prompt within this, or is refused
TEMPLATE_CHARS = 1 << 20  # and into at most this many characters


class _TemplateLimit(Exception):
    """A chat template past TEMPLATE_SECONDS or TEMPLATE_CHARS."""


def _conversation(prompt: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": prompt}]}]


@contextmanager
def _template_faults(folder: Path) -> Iterator[None]:
    """What rendering a folder's chat template can raise (its own errors, its sandbox's refusals,
    the limits above), as one line naming the folder."""
    import jinja2

    try:
        yield
    except _TemplateLimit as err:
        raise UserError(f"{folder}: its chat template {err}; the runtime renders templates within "
                        f"{TEMPLATE_SECONDS:g} s and {TEMPLATE_CHARS:,} characters (re-download the model)") from None
    except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
            RecursionError, MemoryError) as err:
        what = "is not valid Jinja" if isinstance(err, jinja2.TemplateSyntaxError) else "fails"
        raise UserError(f"{folder}: its chat template {what} ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else '-'}); re-download the model") from None


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """SIGALRM after `seconds` (main thread only; elsewhere the output limit alone holds)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(*_: Any) -> None:
        raise _TemplateLimit(f"ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_chat_template(template: str, tokenizer: Any, folder: Path) -> None:
    """Render the template once on a probe prompt in transformers' own sandbox, within
    TEMPLATE_SECONDS and TEMPLATE_CHARS: a template that raises, is not Jinja, escapes the
    sandbox, runs away or renders nothing is refused in one line before anything is built."""
    import time

    from transformers.utils.chat_template_utils import _compile_jinja_template

    with _template_faults(folder):
        compiled = _compile_jinja_template(template)
        context = {**tokenizer.special_tokens_map, "messages": _conversation("a red cat"),
                   "add_generation_prompt": True}
        size, parts, start = 0, [], time.monotonic()
        with _deadline(TEMPLATE_SECONDS):
            for chunk in compiled.generate(**context):
                size += len(chunk)
                parts.append(chunk)
                if size > TEMPLATE_CHARS:
                    raise _TemplateLimit(f"renders more than {TEMPLATE_CHARS:,} characters")
                if time.monotonic() - start > TEMPLATE_SECONDS:
                    raise _TemplateLimit(f"ran past {TEMPLATE_SECONDS:g} s")
    if "a red cat" not in "".join(parts):
        raise UserError(f"{folder}: its chat template renders a prompt without the prompt's text "
                        f"({'empty' if not ''.join(parts).strip() else 'the text is dropped'}); re-download the model")


def _chat_template(folder: Path, tokenizer: Any) -> str:
    """The processor's chat template: chat_template.jinja, chat_template.json, processor_config.json,
    or the tokenizer's own."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "processor_config.json"):
        path = folder / name
        if path.is_file():
            template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, str):
                return template
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        return tokenizer.chat_template
    raise UserError(f"{folder}: no chat template (chat_template.jinja) to build Janus's prompt; re-download the model")


def _vocab_id(tokenizer: Any, token: str, folder: Path) -> int:
    ids = tokenizer.convert_tokens_to_ids([token])
    if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
        raise UserError(f"{folder}: the tokenizer has no {token}; is this the model's own tokenizer?")
    return int(ids[0])


def _text_config(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"{folder / 'config.json'}: no text_config; re-download the model folder")
    if text.get("hidden_act", "silu") != "silu":
        raise UserError(f"{folder / 'config.json'}: hidden_act {text.get('hidden_act')!r}; the adapter computes "
                        "SwiGLU with silu")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise UserError(f"{folder / 'config.json'}: rope type {rope.get('rope_type')!r}; the adapter computes the "
                        "default rotary embedding only")
    head_dim = text.get("head_dim")
    if head_dim is not None and head_dim * text.get("num_attention_heads", 0) != text.get("hidden_size"):
        raise UserError(f"{folder / 'config.json'}: head_dim x heads != hidden_size, which the adapter does not compute")
    return text


def load_janus_folder(folder: Path, *, image_size: int | None = None, with_vq: bool = True):
    """(target, VQ or None, prompt encoder, weight files) from a Janus folder in transformers' layout."""
    from runtime.models.hf_vq import build_vq
    from runtime.models.janus import JanusTarget
    from runtime.models.loading import read_hf_weights

    config = _config(folder)
    text = _text_config(config, folder)
    vq_cfg = config.get("vq_config") or {}
    vision = config.get("vision_config") or {}
    tokens = int(vision.get("num_image_tokens", 576))
    side = int(round(tokens ** 0.5))
    downsample = 2 ** (len(vq_cfg.get("channel_multiplier", (1, 1, 2, 2, 4))) - 1)
    if side * side != tokens:
        raise UserError(f"{folder / 'config.json'}: num_image_tokens {tokens} is not a square grid")
    if image_size is not None and image_size != side * downsample:
        raise UserError(f"--image-size {image_size}: {folder.name} generates {side * downsample} px images "
                        "(its config); drop --image-size")
    tokenizer = _tokenizer(folder)
    boi = _vocab_id(tokenizer, getattr(tokenizer, "boi_token", None) or "<begin_of_image>", folder)
    codes = int(vq_cfg.get("num_embeddings", 16384))
    base = config_from_hf(text, torch.arange(codes), tokens)
    cfg = replace(base, qk_norm=False, family="janus",
                  bos_token_id=int(tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0),
                  pad_token_id=int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0),
                  boi_token_id=boi)
    state = read_hf_weights(folder)
    target = JanusTarget.from_hf_state_dict(
        cfg, state, embed_dim=int(vq_cfg.get("embed_dim", 8)), projection=int(vq_cfg.get("projection_dim", 2048)),
        aligner_layers=int(vq_cfg.get("num_hidden_layers", 2)), source=str(folder))
    template = _chat_template(folder, tokenizer)
    check_chat_template(template, tokenizer, folder)
    boi_token = tokenizer.convert_ids_to_tokens(boi)

    def render(prompt: str) -> str:
        with _template_faults(folder):
            return tokenizer.apply_chat_template(_conversation(prompt), chat_template=template,
                                                 add_generation_prompt=True, tokenize=False) + boi_token

    encoder = ChatPromptEncoder(tokenizer, pad=cfg.pad_token_id, render=render)
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    vq = build_vq("janus", vq_cfg, state, side, side, 0, str(folder)) if with_vq else None
    return target, vq, encoder, files


def load_emu3_folder(folder: Path, *, image_size: int | None = None, with_vq: bool = True):
    """(target, VQ or None, prompt encoder, weight files) from an Emu3 folder in transformers' layout."""
    from runtime.models.hf_vq import build_vq
    from runtime.models.loading import read_hf_weights

    config = _config(folder)
    text = _text_config(config, folder)
    vq_cfg = config.get("vq_config") or {}
    vocab_map = config.get("vocabulary_map") or {}
    visual = sorted((int(name[-8:-2]), int(bpe)) for name, bpe in vocab_map.items()
                    if name.startswith("<|visual token"))
    if not visual or [code for code, _ in visual] != list(range(len(visual))):
        raise UserError(f"{folder / 'config.json'}: vocabulary_map does not name <|visual token NNNNNN|> for codes "
                        "0..n-1; is this an Emu3 config.json?")
    if EMU3_ROW_END not in vocab_map:
        raise UserError(f"{folder / 'config.json'}: the vocabulary has no {EMU3_ROW_END} (Emu3's row end)")
    downsample = 2 ** (len(vq_cfg.get("channel_multiplier", (1, 2, 2, 4))) - 1)
    size = EMU3_DEFAULT_SIZE if image_size is None else image_size
    if size < downsample or size % downsample:
        raise UserError(f"--image-size {size}: Emu3 makes images in steps of {downsample} px (e.g. 512, 720)")
    side = size // downsample
    positions = text.get("max_position_embeddings", 1 << 22)
    if side * (side + 1) + 2 > positions:
        largest = next((s for s in range(side, 0, -1) if s * (s + 1) + 2 <= positions), 0) * downsample
        raise UserError(f"--image-size {size}: an Emu3 image of {side} x {side + 1} tokens does not fit this model's "
                        f"{positions:,} positions (max_position_embeddings); give at most --image-size {largest}")
    ids = torch.tensor([bpe for _, bpe in visual] + [int(vocab_map[EMU3_ROW_END])])
    base = config_from_hf(text, ids, side * (side + 1))
    tokenizer = _tokenizer(folder)
    boi_token = getattr(tokenizer, "boi_token", None) or "<|image start|>"
    wrapper = getattr(tokenizer, "image_wrapper_token", None) or "<|image token|>"
    bos = tokenizer.bos_token or ""

    def render(prompt: str) -> str:
        return f"{bos}{prompt}{boi_token}{side}*{side}{wrapper}"

    encoder = ChatPromptEncoder(tokenizer, pad=int(tokenizer.pad_token_id or 0), render=render)
    null = tuple(encoder.ids(EMU3_NEGATIVE_PROMPT))
    encoder.min_length = len(null)
    cfg: ChameleonConfig = replace(
        base, qk_norm=False, family="emu3", row_width=side + 1, newline=len(ids) - 1, null_prompt=null,
        bos_token_id=int(tokenizer.bos_token_id or 0), pad_token_id=int(tokenizer.pad_token_id or 0),
        boi_token_id=_vocab_id(tokenizer, boi_token, folder))
    state = _emu3_keys(read_hf_weights(folder))
    target = ChameleonTarget.from_hf_state_dict(cfg, state, ids, str(folder))
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    vq = build_vq("emu3", vq_cfg, state, side, side, side + 1, str(folder)) if with_vq else None
    return target, vq, encoder, files


# Emu3's weights on the Hub keep the original names (transformers renames them when it loads):
# text_model.model.* / text_model.lm_head.* / vqmodel.*; saved from memory they read
# model.text_model.* / lm_head.* / model.vqmodel.*. Both -> the Chameleon adapter's model.* / lm_head.*.
_EMU3_RENAMES = (("text_model.lm_head.", "lm_head."), ("text_model.model.", "model."), ("model.text_model.", "model."),
                 ("vqmodel.", "model.vqmodel."))


def _emu3_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for prefix, new in _EMU3_RENAMES:
            if key.startswith(prefix):
                key = new + key[len(prefix):]
                break
        out[key] = value
    return out
