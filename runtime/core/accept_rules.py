"""The acceptance rule a decoder applies, chosen once from its settings (greedy or sampling is
the rule's business, as in vLLM's rejection sampler): rule objects over acceptance.py's functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.core.acceptance import Accepted, GroupRule, accept_greedy, accept_grouped, accept_sampling
from runtime.core.relaxation import Relaxation, anneal_weights
from runtime.core.rng import CounterRNG
from runtime.core.tree import TreeBuffers
from runtime.utils.errors import UserError
from runtime.config.method_options import MAX_TREE_DEPTH, AcceptKind, RelaxKind

if TYPE_CHECKING:
    from runtime.core.state import DecodeConfig


# -- the rule a decoder applies, chosen once ---------------------------------------------------
class AcceptRule:
    """Acceptance chosen once per decoder (greedy or sampling is the rule's business, as in
    vLLM's rejection sampler): `rule(tokens, p, q, tree, uniforms)` -> `Accepted`, with the
    shapes of the module docstring; q is None for deterministic drafts, uniforms (B, N+1+V) the
    numbers a policy drew already (None: the rule draws its own; wider is allowed, the bonus
    then reads the last V), cap (B,) long or None: image i accepts no node deeper than cap[i],
    a node at that depth being its leaf (`accept_sampling`)."""

    def __call__(self, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, tree: TreeBuffers,
                 uniforms: torch.Tensor | None = None, cap: torch.Tensor | None = None) -> Accepted:
        raise NotImplementedError


@dataclass(frozen=True)
class GreedyAccept(AcceptRule):
    """The target's argmax (relaxed: a draft lifted to the relaxed maximum), `accept_greedy`."""

    relax: Relaxation

    def __call__(self, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, tree: TreeBuffers,
                 uniforms: torch.Tensor | None = None, cap: torch.Tensor | None = None) -> Accepted:
        return accept_greedy(tokens, p, tree, self.relax, cap)


@dataclass(frozen=True)
class SamplingAccept(AcceptRule):
    """Multi-draft recursive rejection sampling, `accept_sampling`; rows: the decoder's arange(B)."""

    rng: CounterRNG
    relax: Relaxation
    rows: torch.Tensor | None = None

    def __call__(self, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, tree: TreeBuffers,
                 uniforms: torch.Tensor | None = None, cap: torch.Tensor | None = None) -> Accepted:
        return accept_sampling(tokens, p, tree, self.rng, q=q, relax=self.relax, uniforms=uniforms, rows=self.rows,
                               cap=cap)


@dataclass(frozen=True)
class GroupedAccept(AcceptRule):
    """GSD-style grouped acceptance of a sampled chain (lossy), `accept_grouped`."""

    rng: CounterRNG
    group: GroupRule

    def __call__(self, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, tree: TreeBuffers,
                 uniforms: torch.Tensor | None = None, cap: torch.Tensor | None = None) -> Accepted:
        if cap is not None:
            raise ValueError("grouped acceptance takes no per-image depth cap")
        if q is None:
            raise ValueError("grouped acceptance judges sampled drafts: it needs their law q")
        return accept_grouped(tokens, p, q, tree, self.rng, self.group)


def acceptance_rule(greedy: bool, rng: CounterRNG, relax: Relaxation, group: GroupRule | None = None,
                    rows: torch.Tensor | None = None) -> AcceptRule:
    """The rule for a decoder's settings: grouped when a group rule is given (sampling only),
    else greedy or sampling, each with the (possibly inactive) relaxation."""
    if group is not None:
        return GroupedAccept(rng, group)
    return GreedyAccept(relax) if greedy else SamplingAccept(rng, relax, rows)


def acceptance_parts(config: DecodeConfig, neighbours: torch.Tensor | None, levels: int = 1
                     ) -> tuple[Relaxation, GroupRule | None]:
    """The relaxation (over the (V, k) codebook neighbour table, where the method relaxes; COOL-SD's
    weights for a tree of `levels` levels below its root) and the grouped rule (or None) of the
    method's acceptance."""
    spec = config.spec
    kind = spec.relaxation_kind
    if kind == RelaxKind.ANNEAL:
        weights = anneal_weights(spec.cool_delta, spec.cool_nu, spec.cool_mu, levels, MAX_TREE_DEPTH + 2)
        return Relaxation(kind, weights=torch.tensor(weights, dtype=torch.float32, device=config.device)), None
    if kind != RelaxKind.NONE and neighbours is None:
        raise UserError(f"method {spec.method} needs the codebook neighbour table (pass the VQ model)")
    zero_neighbours = None
    if neighbours is not None:
        # the paper rule clears a rejected draft's k+1 nearest codes (where the table has them)
        zero_neighbours = neighbours[:, : spec.lantern_k + 1].to(config.device)
        neighbours = zero_neighbours[:, : spec.lantern_k]
    relax = Relaxation(kind, spec.lantern_delta, spec.lantern_lambda, neighbours, rule=spec.relax_rule,
                       zero_neighbours=zero_neighbours, residual=spec.residual)
    group = None
    if spec.accept == AcceptKind.GROUPED:
        group = GroupRule.for_target(config.target, spec.group_window, spec.group_gap, spec.group_dist)
    return relax, group
