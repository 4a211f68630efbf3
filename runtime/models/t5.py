"""T5 text encoder for LlamaGen t2i (flan-t5-xl encoder), loaded from a local directory only.

LlamaGen tokenises captions to exactly `max_length` (120) tokens, right-padded by the tokenizer,
then moves the valid tokens to the END (left padding) and zeroes the padded rows; the caption
mask is flipped accordingly. The GPT's `cls_embedding` consumes the (B, 120, 2048) result.

Text normalisation: captions are lower-cased and stripped (LlamaGen's behaviour with
`use_text_preprocessing=False`); its optional web-caption cleaning (ftfy/BeautifulSoup rules) is
not reproduced, so only prompts with URLs, HTML or odd punctuation can tokenise differently.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from runtime.utils.errors import UserError

T5_MAX_LENGTH = 120


def left_pad_captions(emb: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Move each row's valid tokens to the end, as LlamaGen's t2i sampler does.

    emb: (B, L, D) encoder states with the valid tokens first (right padding);
    mask: (B, L) with ones on the valid prefix.
    Returns (emb', mask') where row b's n_b valid tokens occupy positions L-n_b..L-1 in their
    original order, padded rows are exactly zero, and mask' is a bool (B, L) mask of the valid
    positions. Computed with index ops only (no host sync).
    """
    batch, length = mask.shape
    n_valid = mask.to(torch.long).sum(dim=1, keepdim=True)  # (B, 1)
    # Rolling right by L-n: new[j] = old[(j + n) % L] puts the n-token prefix at the end.
    source = (torch.arange(length, device=mask.device)[None, :] + n_valid) % length  # (B, L)
    rolled = torch.gather(emb, 1, source[:, :, None].expand(batch, length, emb.shape[-1]))
    new_mask = torch.arange(length, device=mask.device)[None, :] >= (length - n_valid)
    return rolled * new_mask[:, :, None].to(emb.dtype), new_mask


class T5Encoder:
    """Caption encoder: `encode(prompts)` -> (emb (B, max_length, D), mask (B, max_length) bool).

    `path` is a local directory holding a transformers T5 encoder (config.json + weights) and its
    tokenizer files; nothing is downloaded.
    """

    def __init__(self, path: str | os.PathLike[str], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_length: int = T5_MAX_LENGTH):
        folder = Path(path)
        if not folder.is_dir():
            raise UserError(f"T5 encoder folder not found: {folder}; pass a local directory holding a "
                            "transformers T5 model and tokenizer (e.g. flan-t5-xl)")
        if not (folder / "config.json").is_file():
            raise UserError(f"{folder}: no config.json; expected a local transformers T5 model directory")
        import transformers
        from transformers import AutoTokenizer, T5EncoderModel

        # transformers 5 renamed `torch_dtype` to `dtype`; older releases ignore the new name.
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        except Exception as err:
            raise UserError(f"{folder}: cannot load the T5 tokenizer ({_first_line(err)})") from None
        try:
            model = T5EncoderModel.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False,
                                                  **{dtype_kw: dtype})
        except Exception as err:
            raise UserError(f"{folder}: cannot load the T5 encoder ({_first_line(err)})") from None
        self._setup(tokenizer, model.to(device).eval(), max_length)

    @classmethod
    def from_components(cls, tokenizer: Any, model: torch.nn.Module,
                        max_length: int = T5_MAX_LENGTH) -> "T5Encoder":
        """Wrap an already-built tokenizer and encoder (tests, callers that manage loading)."""
        self = cls.__new__(cls)
        self._setup(tokenizer, model.eval(), max_length)
        return self

    def _setup(self, tokenizer: Any, model: torch.nn.Module, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.max_length = max_length

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.d_model)

    @staticmethod
    def normalize_text(text: str) -> str:
        return text.lower().strip()

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """prompts (B strings) -> (emb (B, max_length, D) left-padded with zero pad rows,
        mask (B, max_length) bool, True on the valid tokens at the end of each row)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        tokens = self.tokenizer(
            [self.normalize_text(p) for p in prompts],
            max_length=self.max_length, padding="max_length", truncation=True,
            return_attention_mask=True, add_special_tokens=True, return_tensors="pt",
        )
        input_ids = tokens["input_ids"].to(self.device)
        attention_mask = tokens["attention_mask"].to(self.device)
        emb = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return left_pad_captions(emb, attention_mask)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
