"""Loading a Chameleon-family model folder in the Hugging Face layout (Anole: `config.json` with
`model_type: chameleon`, `model.safetensors` (or shards / `pytorch_model.bin`), `tokenizer.json`).

The folder gives the decoder and the VQ codebook; the VQ *decoder* comes from the folder when it
holds `model.vqmodel.decoder.*`, else from Meta's `vqgan.ckpt` (`--vq-ckpt`), which `transformers`
does not ship. Prompts are built as Anole's generation code builds them: `[bos] + text +
[<reserved08706>] + [<racm3:break>]` (the end-of-turn token only where the vocabulary has it),
left-padded to the longest prompt, with the unconditional prompt `[bos, <racm3:break>]`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from runtime.errors import UserError
from runtime.models.chameleon import ChameleonTarget, config_from_hf
from runtime.models.chameleon_vq import ChameleonVQ, ChameleonVQConfig

END_OF_TURN = "<reserved08706>"
# Anole's generation settings as LANTERN evaluates it (CFG 3.0, image top-k 2000, temperature 1.0)
ANOLE_SAMPLING: dict[str, Any] = {"cfg": 3.0, "top_k": 2000, "temperature": 1.0, "top_p": 1.0}
ANOLE_SAMPLING_SOURCE = "model default (Anole as LANTERN evaluates it: cfg 3.0, top-k 2000)"
_CODE_NAME = re.compile(r"IMGIMG([A-J]+)Z")


def read_config(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json when it describes a Chameleon model, else None."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) and config.get("model_type") == "chameleon" else None


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
    """Text -> prompt token ids (n, L) left-padded, and their mask (n, L), through `tokenizer.json`."""

    tokenizer: Any
    bos: int
    pad: int
    boi: int
    end_of_turn: int | None

    def __call__(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for text in texts:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            rows.append([self.bos, *ids, *([self.end_of_turn] if self.end_of_turn is not None else []), self.boi])
        length = max(len(r) for r in rows)
        tokens = torch.full((len(rows), length), self.pad, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.bool)
        for i, row in enumerate(rows):
            tokens[i, length - len(row):] = torch.tensor(row)
            mask[i, length - len(row):] = True
        return tokens, mask


def load_chameleon_folder(folder: str | Path, vq_ckpt: str | None, *, trust: bool = False, with_vq: bool = True
                          ) -> tuple[ChameleonTarget, ChameleonVQ | None, PromptEncoder, list[Path]]:
    """(target, VQ, prompt encoder, weight files read) from a Chameleon folder (+ Meta's vqgan.ckpt);
    `with_vq=False` skips the VQ (None; drafter training needs no images)."""
    from runtime.models.loading import read_checkpoint, read_hf_weights

    folder = Path(folder)
    config = read_config(folder)
    if config is None:
        raise UserError(f"{folder}: config.json does not describe a Chameleon model (model_type 'chameleon')")
    if any("XLLMX" in a for a in config.get("architectures") or []):
        raise UserError(f"{folder}: a Lumina-mGPT model; its image layout (size and row-end tokens) is not "
                        "supported yet, only Anole's plain token grid")
    vocab_map = config.get("vocabulary_map") or {}
    ids = image_token_ids(vocab_map, str(folder / "config.json"))
    vq_cfg = ChameleonVQConfig.from_hf(config.get("vq_config") or {})
    if vq_cfg.codebook_size != len(ids):
        raise UserError(f"{folder / 'config.json'}: {len(ids)} image tokens but a codebook of "
                        f"{vq_cfg.codebook_size}; the vocabulary and vq_config disagree")
    grid = vq_cfg.resolution // vq_cfg.downsample
    state = read_hf_weights(folder)
    target = ChameleonTarget.from_hf_state_dict(config_from_hf(config, ids, grid * grid), state, ids, str(folder))
    parts = {k[len("model.vqmodel."):]: v for k, v in state.items() if k.startswith("model.vqmodel.")}
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    encoder = _prompt_encoder(folder, target, vocab_map)
    if not with_vq:
        return target, None, encoder, files
    vq = ChameleonVQ(vq_cfg)
    if not any(k.startswith("decoder.") for k in parts):
        if vq_ckpt is None:
            raise UserError(f"{folder}: holds no VQ decoder (transformers does not ship one); give Chameleon's "
                            "vqgan.ckpt (Meta's tokenizer release) with --vq-ckpt")
        ckpt = read_checkpoint(vq_ckpt, trust=trust)
        parts = {**{k: v for k, v in parts.items() if not k.startswith("decoder.")}, **ckpt}
        files.append(Path(vq_ckpt))
    vq.load_parts(parts, str(vq_ckpt or folder))
    return target, vq.eval(), encoder, files


def _prompt_encoder(folder: Path, target: ChameleonTarget, vocab_map: dict[str, int]) -> PromptEncoder:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise UserError(f"{folder}: no tokenizer.json to turn --prompts into tokens")
    from tokenizers import Tokenizer

    return PromptEncoder(Tokenizer.from_file(str(tokenizer_file)), bos=target.config.bos_token_id,
                         pad=target.config.pad_token_id, boi=target.config.boi_token_id,
                         end_of_turn=vocab_map.get(END_OF_TURN))
