"""What a request's `prompt` becomes for models conditioned on text: the caption features of a
LlamaGen text-to-image model (its T5 encoder), or the prompt token ids of a Chameleon-family
model (padded to the server's fixed prompt length). Class-conditional prompts (class ids and
names) are read by `api.Served` itself.

A conditioner: `check(text)` -> one line naming what is wrong, or None; `__call__(text)` ->
(cond (1, L, ...), mask (1, L) bool) on the device, as `runtime run --prompts` conditions an
image on that text; `revised(text)` -> the text as the model reads it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Conditioner(Protocol):
    """How a text-conditioned model reads a request's prompt (see the module docstring)."""

    def check(self, text: str) -> str | None: ...

    def revised(self, text: str) -> str: ...

    def run_flags(self) -> list[str]:
        """The `runtime run` flags that read a prompt as this server does (beside its own flags)."""
        ...

    def __call__(self, text: str) -> tuple[torch.Tensor, torch.Tensor]: ...


class CaptionEncoder(Protocol):
    """LlamaGen's T5 caption encoder, as `Captions` uses it."""

    def normalize_text(self, text: str) -> str: ...

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


class PromptEncoder(Protocol):
    """A Chameleon-family model's prompt tokenizer, as `TokenPrompts` uses it."""

    def ids(self, text: str) -> list[int]: ...

    def __call__(self, texts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class Captions:
    """A LlamaGen t2i model's captions: T5 features (1, cls_token_num, caption_dim) in the model's
    dtype, left-padded to the model's caption length as LlamaGen's sampler pads them."""

    def __init__(self, encoder: CaptionEncoder, device: torch.device, dtype: torch.dtype) -> None:
        self.encoder, self.device, self.dtype = encoder, device, dtype

    def check(self, text: str) -> str | None:
        return "prompt: the caption is empty" if not text.strip() else None

    def revised(self, text: str) -> str:
        return self.encoder.normalize_text(text)

    def run_flags(self) -> list[str]:
        return []  # the caption encoder is the server's --t5-path

    def __call__(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        emb, mask = self.encoder.encode([text])
        return emb.to(device=self.device, dtype=self.dtype), mask.to(self.device)


class TokenPrompts:
    """A Chameleon-family model's prompts: token ids (1, length), left-padded to `length`, the
    prompt length every captured step was built for (`runtime run --prompt-length` pads the same
    way, so a request's images equal that run's)."""

    def __init__(self, encoder: PromptEncoder, length: int, device: torch.device) -> None:
        self.encoder, self.length, self.device = encoder, length, device

    def check(self, text: str) -> str | None:
        if not text.strip():
            return "prompt: the prompt is empty"
        n = len(self.encoder.ids(text))
        if n > self.length:
            return (f"prompt: {n} tokens, more than this server's prompt length {self.length}; shorten it or "
                    f"restart the server with --prompt-length {n}")
        return None

    def revised(self, text: str) -> str:
        return text

    def run_flags(self) -> list[str]:
        return ["--prompt-length", str(self.length)]  # the padding sets the positions, so the tokens

    def __call__(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = self.encoder([text], self.length)
        return ids.to(self.device), mask.to(self.device)
