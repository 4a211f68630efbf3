"""The decode state: what the phases of one decoder share, as one object.

The decoder builds a `DecodeState` and hands it to its drafting policy (the policy never sees the
decoder): the fixed settings (method, models, sizes) and the preallocated buffers the phases read
and fill. Buffers are allocated once (`allocate`) and keep their identities, which graph capture
relies on; every phase writes them in place.

Shapes: B images (`batch`), R model rows (`rows`: 2B with classifier-free guidance, else B),
N+1 tree nodes (node 0 the root), V the vocabulary, D the target's width, M = max_depth + 1 the
longest accepted block, S = num_tokens the image tokens.

    tokens     (B, N+1) long   node tokens; the policy fills the drafts, accept sets the root
    q          (B, N+1, V)     q[:, i] = the distribution node i's children were drawn from
                               (None when the policy's drafts are not sampled)
    p          (B, N+1, V)     the target's processed distribution after each node (verify)
    hidden     (R, N+1, D)     the target's last hidden state at each node (verify)
    count      (B,) long       tokens known per image, the pending root included
    out        (B, S + 2M + 1) each image's tokens so far
    block      (B, M) long     the last accept's new tokens (accepted drafts, then the bonus)
    block_ids  (M,) long       arange(M)
    accepted   (B,) long       the last accept's node count (root included; 0 once done)
    live_now   (B,) long       1 for images still generating (what `live()` last wrote)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from runtime.core.methods import MethodSpec
from runtime.core.rng import CounterRNG
from runtime.core.sampling import SamplingParams, apply_cfg, cfg_off_mask, probabilities

if TYPE_CHECKING:
    from runtime.models.target import DrafterModel, Target


@dataclass(eq=False)
class DecodeState:
    spec: MethodSpec
    target: Target
    drafter: DrafterModel | None  # None for the policies that draft without one (AR, jacobi)
    device: torch.device
    dtype: torch.dtype
    batch: int
    rows: int
    cls: int  # condition positions per row
    vocab: int
    num_tokens: int
    rng: CounterRNG  # one counter-based stream per image
    # a layout's fixed tokens: constrain(logits (B, T, V), image index (B, T)) -> logits, or None
    constrain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    max_depth: int = 0  # set once the policy has built its tree
    n1: int = 0  # N+1 tree nodes, root included (set by `allocate`)
    group: Any = None  # the grouped acceptance rule, or None
    tokens: torch.Tensor = None  # type: ignore[assignment]
    q: torch.Tensor | None = None
    p: torch.Tensor = None  # type: ignore[assignment]
    hidden: torch.Tensor = None  # type: ignore[assignment]
    count: torch.Tensor = None  # type: ignore[assignment]
    out: torch.Tensor = None  # type: ignore[assignment]
    block: torch.Tensor = None  # type: ignore[assignment]
    block_ids: torch.Tensor = None  # type: ignore[assignment]
    accepted: torch.Tensor = None  # type: ignore[assignment]
    live_now: torch.Tensor = None  # type: ignore[assignment]

    @property
    def params(self) -> SamplingParams:
        return self.spec.sampling

    def allocate(self, nodes: int, dim: int, sampled_q: bool) -> None:
        """The buffers, once the tree's size (`nodes` = N+1) and depth are known."""
        b, m, dev = self.batch, self.max_depth + 1, self.device
        self.n1 = nodes
        # a done image's block still lands (unread) past its end: room for two blocks
        self.out = torch.zeros(b, self.num_tokens + 2 * m + 1, dtype=torch.long, device=dev)
        self.count = torch.zeros(b, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(b, nodes, dtype=torch.long, device=dev)
        self.p = torch.zeros(b, nodes, self.vocab, device=dev)
        self.q = torch.zeros(b, nodes, self.vocab, device=dev) if sampled_q else None
        self.hidden = torch.zeros(self.rows, nodes, dim, device=dev, dtype=self.dtype)
        self.block_ids = torch.arange(m, device=dev)
        self.block = torch.zeros(b, m, dtype=torch.long, device=dev)
        self.accepted = torch.ones(b, dtype=torch.long, device=dev)
        self.live_now = torch.ones(b, dtype=torch.long, device=dev)

    def dist(self, logits: torch.Tensor, depth: torch.Tensor | int | None = None, *, draft: bool = False,
             log: bool = False) -> torch.Tensor:
        """(R, T, V) logits -> (B, T, V) processed distribution (CFG, temperature, top-k/p).

        depth: tree depth of the T nodes these logits follow ((T,) or per image (B, T) tensor,
        or an int for all); the token they predict has image index count + depth, which
        decides whether `cfg_interval` has switched guidance off. None = the prefill (guidance
        always on). draft: the drafter's logits, mixed by the fused CFG (`apply_cfg`); log:
        the log of the distribution (`probabilities`).
        """
        params = self.params
        off = None
        if depth is not None and params.uses_cfg and params.cfg_interval >= 0:
            index = (self.count[:, None] + depth).expand(self.batch, logits.size(1))
            off = cfg_off_mask(index, params.cfg_interval)
        mixed = apply_cfg(logits, params.cfg, off, fused=draft)
        if self.constrain is not None:  # tokens the model's layout fixes or forbids at an image index
            index = (self.count[:, None] + depth if depth is not None else torch.zeros_like(self.count)[:, None])
            mixed = self.constrain(mixed, index.expand(mixed.size(0), mixed.size(1)))
        return probabilities(mixed, params, log=log)

    def expand_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Per-image (B, ...) -> per model row (R, ...): the cond and uncond rows share it."""
        # a view at B = 1 (the stride-0 dim merges), one copy for larger batches
        return t[None].expand(2, *t.shape).flatten(0, 1) if self.params.uses_cfg else t

    def live(self) -> torch.Tensor:
        """(B,) long: 1 for images still generating, 0 for those done (their advances are 0).
        Written into `live_now` (one kernel, no conversion): the same tensor every call."""
        return torch.lt(self.count, self.num_tokens, out=self.live_now)
