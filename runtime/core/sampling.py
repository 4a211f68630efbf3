"""Logit processing and sampling without host synchronisation.

Order follows LlamaGen: classifier-free guidance, then logits / temperature, then top-k,
then top-p, then softmax. Sampling uses the Gumbel-max trick with `CounterRNG` draws, so a
categorical sample (or k samples without replacement) is an argmax/topk on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config.method_options import default

from runtime.core.rng import CounterRNG


@dataclass(frozen=True)
class SamplingParams:
    """greedy=True ignores temperature/top_k/top_p for token choice (argmax).

    cfg_interval: LlamaGen's `cfg_interval`. -1 (default) keeps guidance on for every token;
    n >= 0 switches it off (conditional logits only, rows still doubled) for image tokens with
    index >= n + 2, i.e. after LlamaGen's decode step n (step 0 makes image token 1).
    """

    greedy: bool = default("greedy")
    temperature: float = default("temperature")
    top_k: int = default("top_k")
    top_p: float = default("top_p")
    cfg: float = default("cfg")
    cfg_interval: int = default("cfg_interval")

    @property
    def uses_cfg(self) -> bool:
        return self.cfg > 1.0


def apply_cfg(logits: torch.Tensor, cfg: float, cfg_off: torch.Tensor | None = None,
              fused: bool = False) -> torch.Tensor:
    """Rows are [cond (B), uncond (B)] -> uncond + cfg * (cond - uncond), (B, ..., V).

    With cfg <= 1 the batch is not doubled and logits are returned unchanged. cfg_off: (T,)
    or per image (B, T) bool over the positions of logits (2B, T, V); where True the
    conditional logits are returned as they are (LlamaGen's `cfg_interval`). fused: one
    `lerp` kernel instead of three; it rounds differently, so only drafts use it (the target
    mixes as LlamaGen does).
    """
    if cfg <= 1.0:
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    mixed = torch.lerp(uncond, cond, cfg) if fused else uncond + (cond - uncond) * cfg
    if cfg_off is None:
        return mixed
    return torch.where(cfg_off[..., None], cond, mixed)


def cfg_off_mask(next_index: torch.Tensor, cfg_interval: int) -> torch.Tensor | None:
    """Bool of next_index's shape: which image-token indices are past `cfg_interval`.

    None when the interval is off (-1), so callers skip the select entirely.
    """
    if cfg_interval < 0:
        return None
    return next_index >= cfg_interval + 2


def probabilities(logits: torch.Tensor, params: SamplingParams, log: bool = False) -> torch.Tensor:
    """Target/drafter distribution over the vocabulary (..., V) after temperature/top-k/top-p;
    with `log`, its log (one log_softmax: finite wherever the filters keep a token, -inf where
    they drop one).

    Greedy decoding uses the plain softmax (argmax is unchanged by the filters).
    """
    logits = logits.float()
    normalise = torch.log_softmax if log else torch.softmax
    if params.greedy:
        return normalise(logits, dim=-1)
    if params.temperature != 1.0:  # x / 1 == x: no kernel for the common case
        logits = logits / max(params.temperature, 1e-5)
    if params.top_k > 0:
        k = min(params.top_k, logits.size(-1))
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop tokens once the mass *before* them already exceeds top_p (keeps the first above it)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) > params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return normalise(logits, dim=-1)


def sample(probs: torch.Tensor, rng: CounterRNG) -> torch.Tensor:
    """One categorical sample per row of probs (..., V) -> (...) long, on the device.

    The exponential race argmax(p / E) (= Gumbel-max argmax(log p - log E)): a token of
    probability 0 scores 0 and any positive one scores above it, E being positive and finite."""
    return rng.race(probs)


def sample_without_replacement(probs: torch.Tensor, k: int, rng: CounterRNG) -> torch.Tensor:
    """k distinct samples per row, in draw order (Gumbel-top-k as an exponential race), (..., k) long."""
    return torch.topk(probs / rng.exponential(*probs.shape), k, dim=-1).indices
