"""Loading a Chameleon-family model folder in the Hugging Face layout (`config.json` with
`model_type: chameleon`, `model.safetensors` (or shards / `pytorch_model.bin`), `tokenizer.json`):
Anole, and Lumina-mGPT (architecture `ChameleonXLLMXForConditionalGeneration`).

The folder gives the decoder and the VQ codebook; the VQ *decoder* comes from the folder when it
holds `model.vqmodel.decoder.*`, else from Meta's `vqgan.ckpt` (`--vq-ckpt`), which `transformers`
does not ship. Prompts are built as Anole's generation code builds them: `[bos] + text +
[<reserved08706>] + [<racm3:break>]` (the end-of-turn token only where the vocabulary has it),
left-padded to the longest prompt, with the unconditional prompt `[bos, <racm3:break>]`.

Lumina-mGPT, as its `inference_solver.py` / `item_processor.py` do: the text is
`"Generate an image of {S}x{S} according to the following prompt:\n" + prompt`, and the prompt ends
with the image's start `[<racm3:break>, <reserved{8800+g}>, <reserved{8800+g}>]` (g = S / 32 grid
units, each 2 x 2 tokens); the image is S/16 rows of S/16 codes each followed by the row-end token
`<reserved08799>` (forced there, forbidden elsewhere); the unconditional prompt is that start alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from runtime.utils.errors import UserError
from runtime.models.chameleon import ChameleonTarget, config_from_hf
from runtime.models.config_checks import check_config_fields
from runtime.models.chameleon_vq import ChameleonVQ, ChameleonVQConfig

END_OF_TURN = "<reserved08706>"
# Anole's generation settings as LANTERN evaluates it (CFG 3.0, image top-k 2000, temperature 1.0)
ANOLE_SAMPLING: dict[str, Any] = {"cfg": 3.0, "top_k": 2000, "temperature": 1.0, "top_p": 1.0}
ANOLE_SAMPLING_SOURCE = "model default (Anole as LANTERN evaluates it: cfg 3.0, top-k 2000)"
LUMINA_SAMPLING: dict[str, Any] = {"cfg": 3.0, "top_k": 2000, "temperature": 1.0, "top_p": 1.0}
LUMINA_SAMPLING_SOURCE = "model default (Lumina-mGPT's create_logits_processor: cfg 3.0, image top-k 2000)"
LUMINA_ROW_END = "<reserved08799>"
LUMINA_PATCH = 32  # pixels per size-token grid unit (2 x 2 VQ tokens)
LUMINA_DEFAULT_SIZE = 768
_CODE_NAME = re.compile(r"IMGIMG([A-J]+)Z")


def read_config(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json when it describes a Chameleon model, else None."""
    config = read_model_config(folder)
    return config if config is not None and config.get("model_type") == "chameleon" else None


CONFIG_BYTES = 16 << 20  # a config.json past this is not a model config (Emu3's, the largest, is ~3 MB)


def read_model_config(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json as a dict (any model type); None where the folder has none. Not
    JSON, or not an object: one line naming the file and the fix."""
    path = folder / "config.json"
    if path.is_symlink() and not path.exists():
        raise UserError(f"{path} is a link to nothing (a damaged download); re-download the model folder")
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise UserError(f"{path} is {kind}, not a model config (a damaged download); re-download the model folder")
    if not path.is_file():
        return None
    if path.stat().st_size > CONFIG_BYTES:
        raise UserError(f"{path} is {path.stat().st_size:,} bytes, more than a model config holds "
                        f"({CONFIG_BYTES:,}); fix or re-download the model folder's config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({str(err).splitlines()[0]}); fix or re-download the model "
                        "folder's config.json") from None
    except RecursionError:
        raise UserError(f"{path} nests its JSON too deep to be a model config; fix or re-download the model "
                        "folder's config.json") from None
    except OSError:
        return None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object (a model config), found a JSON {type(config).__name__}; "
                        "fix or re-download the model folder's config.json")
    return config


def image_token_ids(vocabulary_map: dict[str, int], source: str) -> torch.Tensor:
    """BPE id of each VQ code, (codebook_size,), from the `IMGIMG<digits as A-J>Z` token names."""
    codes: dict[int, int] = {}
    for name, bpe in vocabulary_map.items():
        match = _CODE_NAME.fullmatch(name)
        if match:
            codes[int("".join(str(ord(c) - ord("A")) for c in match.group(1)))] = int(bpe)
    if not codes or sorted(codes) != list(range(len(codes))):
        raise UserError(f"{source}: vocabulary_map does not name image tokens IMGIMG...Z for codes 0..n-1; "
                        "is this a Chameleon / Anole config.json?")
    return torch.tensor([codes[i] for i in range(len(codes))], dtype=torch.long)


@dataclass
class PromptEncoder:
    """Text -> prompt token ids (n, L) left-padded, and their mask (n, L), through `tokenizer.json`:
    `prefix` + tokens of `template.format(text)` + `suffix` per prompt."""

    tokenizer: Any
    pad: int
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    template: str = "{}"

    def __call__(self, texts: Sequence[str], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`length`: pad every prompt to that many tokens (the decoders' prompt length), refusing a
        longer one; default the longest prompt's."""
        rows = [self.ids(text) for text in texts]
        longest = max(len(r) for r in rows)
        if length is not None and longest > length:
            raise UserError(f"a prompt is {longest} tokens, more than --prompt-length {length}; shorten it or "
                            f"raise --prompt-length")
        length = longest if length is None else length
        tokens = torch.full((len(rows), length), self.pad, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.bool)
        for i, row in enumerate(rows):
            tokens[i, length - len(row):] = torch.tensor(row)
            mask[i, length - len(row):] = True
        return tokens, mask

    def ids(self, text: str) -> list[int]:
        """One prompt's token ids, template, prefix and suffix included (unpadded)."""
        return [*self.prefix, *self.tokenizer.encode(self.template.format(text), add_special_tokens=False).ids,
                *self.suffix]


def is_lumina(config: dict[str, Any]) -> bool:
    return any("XLLMX" in a for a in config.get("architectures") or [])


def load_chameleon_folder(folder: str | Path, vq_ckpt: str | None, *, trust: bool = False, with_vq: bool = True,
                          image_size: int | None = None
                          ) -> tuple[ChameleonTarget, ChameleonVQ | None, PromptEncoder, list[Path]]:
    """(target, VQ, prompt encoder, weight files read) from a Chameleon folder (+ Meta's vqgan.ckpt);
    `with_vq=False` skips the VQ (None; drafter training needs no images)."""
    from runtime.models.loading import read_checkpoint, read_hf_weights

    folder = Path(folder)
    config = read_config(folder)
    if config is None:
        raise UserError(f"{folder}: config.json does not describe a Chameleon model (model_type 'chameleon')")
    check_config_fields(config, folder, flat=True)
    vocab_map = config.get("vocabulary_map") or {}
    ids = image_token_ids(vocab_map, str(folder / "config.json"))
    vq_cfg = ChameleonVQConfig.from_hf(config.get("vq_config") or {})
    if vq_cfg.codebook_size != len(ids):
        raise UserError(f"{folder / 'config.json'}: {len(ids)} image tokens but a codebook of "
                        f"{vq_cfg.codebook_size}; the vocabulary and vq_config disagree")
    base = config_from_hf(config, ids, (vq_cfg.resolution // vq_cfg.downsample) ** 2)
    lumina = is_lumina(config)
    size = (LUMINA_DEFAULT_SIZE if image_size is None else image_size) if lumina else vq_cfg.resolution
    if lumina:
        ids, cfg, start = _lumina_layout(base, ids, vocab_map, size, vq_cfg.downsample, str(folder / "config.json"))
    else:
        if image_size is not None and image_size != size:
            raise UserError(f"--image-size {image_size}: {folder} generates {size} px images (its VQ config); "
                            "drop --image-size")
        cfg, start = base, (base.boi_token_id,)
    state = read_hf_weights(folder)
    target = ChameleonTarget.from_hf_state_dict(cfg, state, ids, str(folder))
    parts = {k[len("model.vqmodel."):]: v for k, v in state.items() if k.startswith("model.vqmodel.")}
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    encoder = _prompt_encoder(folder, target, vocab_map, start, size if lumina else None)
    if not with_vq:
        return target, None, encoder, files
    vq = ChameleonVQ(vq_cfg, row_width=cfg.row_width)
    if not any(k.startswith("decoder.") for k in parts):
        if vq_ckpt is None:
            raise UserError(f"{folder}: holds no VQ decoder (transformers does not ship one); give Chameleon's "
                            "vqgan.ckpt (Meta's tokenizer release) with --vq-ckpt")
        ckpt = read_checkpoint(vq_ckpt, trust=trust)
        parts = {**{k: v for k, v in parts.items() if not k.startswith("decoder.")}, **ckpt}
        files.append(Path(vq_ckpt))
    vq.load_parts(parts, str(vq_ckpt or folder))
    return target, vq.eval(), encoder, files


def _prompt_encoder(folder: Path, target: ChameleonTarget, vocab_map: dict[str, int], start: tuple[int, ...],
                    lumina_size: int | None) -> PromptEncoder:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise UserError(f"{folder}: no tokenizer.json to turn --prompts into tokens")
    from tokenizers import Tokenizer

    end_of_turn = (vocab_map[END_OF_TURN],) if END_OF_TURN in vocab_map else ()
    template = ("{}" if lumina_size is None else
                f"Generate an image of {lumina_size}x{lumina_size} according to the following prompt:\n{{}}")
    return PromptEncoder(Tokenizer.from_file(str(tokenizer_file)), pad=target.config.pad_token_id,
                         prefix=(target.config.bos_token_id,), suffix=(*end_of_turn, *start), template=template)


def _lumina_layout(base, ids: torch.Tensor, vocab_map: dict[str, int], size: int, downsample: int, source: str):
    """(token ids with the row-end token last, config, image start) for Lumina-mGPT at `size` px."""
    from dataclasses import replace

    if size < LUMINA_PATCH or size % LUMINA_PATCH:
        raise UserError(f"--image-size {size}: Lumina-mGPT makes square images in steps of {LUMINA_PATCH} px "
                        f"(e.g. 512, 768, 1024)")
    size_token = f"<reserved{8800 + size // LUMINA_PATCH:05d}>"
    missing = [t for t in (LUMINA_ROW_END, size_token) if t not in vocab_map]
    if missing:
        raise UserError(f"{source}: the vocabulary has no {missing[0]}; is this a Lumina-mGPT config.json?")
    side = size // downsample
    ids = torch.cat([ids, torch.tensor([vocab_map[LUMINA_ROW_END]])])
    start = (base.boi_token_id, vocab_map[size_token], vocab_map[size_token])
    cfg = replace(base, vocab_size=len(ids), block_size=side * (side + 1), row_width=side + 1, newline=len(ids) - 1,
                  null_prompt=start)
    return ids, cfg, start
