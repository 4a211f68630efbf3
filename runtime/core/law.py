"""What an acceptance rule does to the law of one step: the output distribution at a node.

At a node with target p whose children x_1..x_K are tried in rank order, a rule accepts x_s
with probability a_s (given the earlier ones were rejected) and otherwise draws the bonus
from the last residual R. Given the drafts, the next token is therefore distributed as

    L(y) = sum_s w_s a_s [y = x_s] + w_K R(y) / |R|,    w_s = prod_{t<s} (1 - a_t),

and the step's output law is the expectation of L over how the drafts were made. This module
computes it for one node of each image, with the same stage functions the decoder runs
(`acceptance.py`), so what it measures is what the runtime does:

    deterministic drafts (top-k, EAGLE-2 trees): L is the law. Exact.
    sampled drafts (static trees, sjd): exact rule p, bounded rule its relaxed mixture (closed
        forms); paper rule estimated (the first draft enumerated over q's likeliest tokens,
        the later siblings drawn; exact for one child per node where the vocabulary fits).

`step_tvd` turns it into TV(L, p), and `nominal_bound` gives the bound the relaxation is
stated with for the same drafts: delta (LANTERN), or (lambda - 1) times the drafts'
target mass (sum of p(x_s) for deterministic drafts, E_q[p(x)] for sampled ones), or 1 - 1/w_1
(COOL-SD, whose sampled drafts' law is estimated as the paper rule's).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runtime.core.relaxation import Relaxation, deterministic_stages, relaxed_mixture, sampled_stages
from runtime.core.rng import CounterRNG
from runtime.core.sampling import sample_without_replacement
from runtime.core.tree import static_buffers, validate_paths
from runtime.config.method_options import AcceptKind, Drafting, RelaxKind

if TYPE_CHECKING:
    from runtime.core.methods import MethodSpec
    from runtime.core.state import DecodeConfig

# the paper rule's sampled drafts: the first draft runs over this many of q's most likely
# tokens, and about SAMPLES draws of the later siblings are spread over them by q
CANDIDATES = 512
SAMPLES = 2048


def _mix(a: torch.Tensor, xs: torch.Tensor, residual: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """L (M, V) from acceptance probabilities a (M, K), drafts xs (M, K) (V = none: a = 0)
    and the unnormalised last residual (M, V); a residual of zero mass falls back to p (M, V)."""
    m, v = p.shape
    a = a.clamp(0.0, 1.0)
    left = torch.cumprod(1.0 - a, -1)
    w = torch.cat([torch.ones_like(a[:, :1]), left[:, :-1]], -1) * a  # (M, K)
    law = torch.zeros(m, v + 1, dtype=p.dtype, device=p.device).scatter_add_(1, xs, w)[:, :v]
    mass = residual.sum(-1, keepdim=True)
    rest = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
    return law + left[:, -1:] * rest


def _exact_deterministic(xs: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rule, deterministic drafts: a_s = p(x_s) / (1 - earlier siblings' p), residual p
    without the drafts."""
    p_pad = torch.nn.functional.pad(p, (0, 1))
    px = p_pad.gather(1, xs)
    a = px / (1.0 - (px.cumsum(-1) - px)).clamp(min=1e-12)
    return a, p_pad.scatter(1, xs, 0.0)[:, :-1]


def node_law(p: torch.Tensor, xs: torch.Tensor, relax: Relaxation, q: torch.Tensor | None = None, *,
             samples: int = SAMPLES, candidates: int = CANDIDATES, seed: int = 0,
             estimate: bool = False) -> torch.Tensor:
    """The output law (B, V) at one node per image.

    p (B, V) the target after the node; xs (B, K) its children's tokens in rank order, V
    where a node has fewer (deterministic drafts: the drafts themselves; sampled drafts: only
    their number is read, the law averages over the drafts q could give); q (B, V) the
    distribution sampled drafts were drawn from, None for deterministic drafts. relax: the
    rule ("none" kind = exact).

    Sampled drafts: the exact rule's law is p and the bounded rule's is its relaxed mixture
    (`relaxed_mixture`: every stage is exact toward it), both in closed form; the paper rule's
    is estimated: the first draft x_1 runs over q's `candidates` most likely tokens, each
    given about q(x_1) * `samples` draws of the later siblings (at least one), weighted so
    the estimate is unbiased. `estimate=True` estimates the other rules the same way (to see
    the estimator's noise where the answer is known).
    """
    b, v = p.shape
    if q is None:
        if relax.active:
            stages = deterministic_stages(relax)
            a, _, rows = stages(xs[:, None], p[:, None], relax)
            residual = rows(torch.zeros(b, dtype=torch.long, device=p.device), torch.arange(b, device=p.device))
            return _mix(a[:, 0], xs, residual, p)
        a, residual = _exact_deterministic(xs, p)
        return _mix(a, xs, residual, p)
    if not estimate and not relax.paper and not relax.anneal:
        return relaxed_mixture(p, q, relax)[0] if relax.active else p.clone()
    siblings = int((xs < v).sum(-1).max())  # a static tree gives every image the same number
    tree = static_buffers(validate_paths("node", [(i,) for i in range(siblings)])).to(p.device)
    stages = sampled_stages(relax)
    rng = CounterRNG(p.device, seed)
    out = []
    for i in range(b):  # each image its own allocation of draws
        top = torch.topk(q[i], min(candidates, v))
        draws = (top.values * samples).round().clamp(min=1).long()
        first = top.indices.repeat_interleave(draws)  # (M,)
        weight = (top.values / draws).repeat_interleave(draws)
        m = first.numel()
        drafts = first[:, None]
        if siblings > 1:  # the later siblings: drawn from q without the first
            rest = q[i].expand(m, v).scatter(1, first[:, None], 0.0)
            drafts = torch.cat([drafts, sample_without_replacement(rest, siblings - 1, rng)], -1)
        tokens = torch.cat([torch.zeros_like(first[:, None]), drafts], -1)
        pp, qq = p[i].expand(m, siblings + 1, v), q[i].expand(m, siblings + 1, v)
        a, _, rows = stages(tokens, pp, qq, tree, relax)
        residual = rows(torch.zeros(m, dtype=torch.long, device=p.device), torch.arange(m, device=p.device))
        law = _mix(a[:, 1:], tokens[:, 1:], residual, pp[:, 0])  # (M, V)
        out.append((law * weight[:, None]).sum(0) / weight.sum())
    return torch.stack(out)


def step_tvd(p: torch.Tensor, xs: torch.Tensor, relax: Relaxation, q: torch.Tensor | None = None,
             **kwargs: Any) -> torch.Tensor:
    """(B,) total variation between the node's output law and p (see `node_law`)."""
    return 0.5 * (node_law(p, xs, relax, q, **kwargs) - p).abs().sum(-1)


def nominal_bound(p: torch.Tensor, xs: torch.Tensor, relax: Relaxation, q: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """(B,) the relaxation's stated bound at this node: delta, or (lambda - 1) times the drafts'
    target mass (sum over the children of p(x), or E_q[p(x)] for sampled drafts), or COOL-SD's
    1 - 1/w at a depth-1 node (its output is at most w p pointwise; relaxation.py); 0 when exact."""
    if not relax.active:
        return torch.zeros(p.size(0), dtype=p.dtype, device=p.device)
    if relax.anneal:
        assert relax.weights is not None
        # on the device: no host read while a run measures its law
        bound = (1.0 - 1.0 / relax.weights[1]).clamp(min=0.0).to(device=p.device, dtype=p.dtype)
        return bound.expand(p.size(0)).clone()
    if relax.kind == RelaxKind.DELTA:
        return torch.full((p.size(0),), relax.delta, dtype=p.dtype, device=p.device)
    if q is not None:
        mass = (q * p).sum(-1)
    else:
        mass = torch.nn.functional.pad(p, (0, 1)).gather(1, xs).sum(-1)
    return (relax.lam - 1.0) * mass


# -- watching a run: does the relaxation keep the bound it is stated with? -------------------------
# `runtime run`, `sample` and `serve` measure the law at one iteration in WATCH_EVERY (eager work
# between the captured steps; bench measures it in its untimed pass). A measured step TVD is a
# mean over the iterations measured; it counts as past its bound only beyond both margins, so a
# relaxation at its bound is not flagged for the estimate's noise.
WATCH_EVERY = 8
MARGIN_ABS = 0.05
MARGIN_REL = 0.25
MIN_STEPS = 16  # fewer measured steps than this: no verdict


def watches_law(spec: "MethodSpec") -> bool:
    """Whether a run of `spec` measures its law: a relaxed drafting method under sampling (greedy
    output is no draw from a law; grouped acceptance reports its own bound)."""
    return (spec.drafting != Drafting.NONE and spec.relaxation_kind != RelaxKind.NONE and not spec.sampling.greedy
            and spec.accept != AcceptKind.GROUPED)


def exceeds_bound(measured: float, bound: float) -> bool:
    """A measured mean step TVD clearly past the stated mean bound."""
    return measured > bound + max(MARGIN_ABS, MARGIN_REL * bound)


def bound_warning(spec: "MethodSpec", measured: float | None, bound: float | None, steps: int) -> str | None:
    """One line (printed after "warning: ") when `spec`'s measured step TVD is clearly past its
    stated bound, else None."""
    if measured is None or bound is None or steps < MIN_STEPS or not exceeds_bound(measured, bound):
        return None
    if spec.relaxation_kind == RelaxKind.ANNEAL:
        return (f"{spec.method} (delta {spec.cool_delta:g}, nu {spec.cool_nu:g}) moved each step's output "
                f"{measured:.3f} in total variation from the target's law (mean of {steps} measured steps), past "
                f"its stated bound {bound:.3f}; a smaller --cool-delta keeps each step closer to it")
    if spec.relaxation_kind == RelaxKind.DELTA:
        setting, knob = f"delta {spec.lantern_delta:g}", "--lantern-delta"
    else:
        setting, knob = f"lambda {spec.lantern_lambda:g}", "--lantern-lambda"
    fix = ("--relax-rule bounded keeps each step within it" if spec.relax_rule == "paper"
           else f"a smaller {knob} keeps each step closer to it")
    return (f"{spec.method} ({setting}, --relax-rule {spec.relax_rule}) moved each step's output "
            f"{measured:.3f} in total variation from the target's law (mean of {steps} measured steps), "
            f"past its stated bound {bound:.3f}; {fix}")


@torch.no_grad()
def tv_from_ar(config: DecodeConfig, cond: torch.Tensor, mask: torch.Tensor | None, tokens: np.ndarray,
               judged: torch.Tensor, judged_mask: np.ndarray) -> tuple[float, int]:
    """(summed TV distance, tokens) between the p (S, V) each token of a finished image (S,) was
    judged under (`judged`, where `judged_mask`; pjd's released loop records them) and AR's p at its
    index given the image's tokens before it (one causal forward over the image in a
    fresh cache): what conditioning on a partly generated row above, and KV computed once, cost
    each token. Tokens no p judged (forced row ends) are left out. The bound reported beside it
    is TV's own, 1 per token: the released rule states none."""
    cond, mask = config.guided(cond, mask)
    s = config.num_tokens
    cache = config.new_cache(config.target, cond.size(0), config.cls + s)
    hidden = config.target.prefill(cond, cache, mask)
    ids = torch.from_numpy(tokens).to(config.device)
    x = config.target.tok_embeddings(ids[None, :-1].expand(cond.size(0), -1))
    causal = torch.ones(s - 1, s - 1, dtype=torch.bool, device=config.device).tril()
    out = config.target.forward_cached(x, config.cls + torch.arange(s - 1, device=config.device), causal, cache)
    logits = config.target.logits(torch.cat([hidden[:, -1:], out], 1))  # (rows, S, V): p for 0 .. S-1
    alone = dataclasses.replace(config, batch=1, rows=cond.size(0))  # this image's rows only
    zero = torch.zeros(1, dtype=torch.long, device=config.device)
    ar = alone.dist(logits, zero, torch.arange(s, device=config.device)[None])[0]
    at = torch.from_numpy(judged_mask).to(config.device)
    tv = 0.5 * (judged[at] - ar[at]).abs().sum(-1)
    return float(tv.sum()), int(at.sum())
