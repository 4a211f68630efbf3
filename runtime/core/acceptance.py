"""Acceptance rules for a verified draft tree, vectorised on the device.

All functions take a leading batch dimension B (the decoder uses B = 1; tests use large B to
measure output distributions). No function reads a tensor back to the host, and every loop
has a bound fixed by the tree shape, so a step using them can be captured as a graph.

Inputs shared by the rules:
    tokens  (B, N+1)    long   node tokens (node 0 = root, its token is not judged)
    p       (B, N+1, V) float  target distribution *after* each node (for its children)
    tree    TreeBuffers        parent / children / ancestor_mask / path_table / depth

Result (`Accepted`):
    path    (B, D+1) long  accepted nodes root-first; entries at and past `count` repeat
    count   (B,)     long  accepted nodes including the root (1 .. D+1)
    bonus   (B,)     long  the token the target adds after the accepted path
    depth_accepted (B, D) bool  whether a node at depth d+1 was accepted
    relax_mass (B,)  float sum over accepted drafts of the relaxation mass c they used

Relaxation (LANTERN / LANTERN++). For draft x and the current target r, the proximity set
is x plus the longest prefix n_1..n_j of x's nearest codebook neighbours whose cumulative
target mass c_j = r(n_1)+...+r(n_j) stays within the bound:
    LANTERN   (additive):        c_j <= delta_remaining      (delta for the first sibling)
    LANTERN++ (multiplicative):  c_j <= (lambda - 1) * r(x), i.e. r~(x) <= lambda * r(x)
The relaxed target r~ moves that mass onto x: r~(x) = r(x) + c_j, r~(n_i) = 0 for i <= j.
TVD(r, r~) = c_j exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.core.rng import CounterRNG
from runtime.core.tree import TreeBuffers

_EPS = 1e-12


@dataclass(frozen=True)
class Relaxation:
    """kind: "none" (exact), "delta" (LANTERN, additive) or "lambda" (LANTERN++).

    neighbours: (V, k) long nearest-codebook table (see proximity.py); None when exact.
    """

    kind: str = "none"
    delta: float = 0.0
    lam: float = 1.0
    neighbours: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return (self.kind == "delta" and self.delta > 0) or (self.kind == "lambda" and self.lam > 1)


@dataclass
class Accepted:
    path: torch.Tensor
    count: torch.Tensor
    bonus: torch.Tensor
    depth_accepted: torch.Tensor
    relax_mass: torch.Tensor


def relaxed_target(r: torch.Tensor, x: torch.Tensor, relax: Relaxation,
                   budget: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the proximity-set mass of neighbours onto x.

    r: (B, V) target; x: (B,) drafts; budget: (B,) additive bound (kind "delta"; defaults to
    relax.delta). Returns (r~ (B, V), c (B,)) with TVD(r, r~) = c <= the bound.
    """
    if not relax.active:
        return r, torch.zeros(r.size(0), device=r.device, dtype=r.dtype)
    nb = relax.neighbours[x]  # (B, k)
    mass = r.gather(1, nb)  # (B, k)
    cum = mass.cumsum(1)
    if relax.kind == "delta":
        bound = budget if budget is not None else torch.full_like(cum[:, 0], relax.delta)
    else:
        bound = (relax.lam - 1.0) * r.gather(1, x[:, None]).squeeze(1)
    inside = cum <= bound[:, None]  # a prefix, since masses are >= 0
    c = (mass * inside).sum(1)
    r_t = r.scatter(1, nb, torch.where(inside, torch.zeros_like(mass), mass))
    r_t = r_t.scatter_add(1, x[:, None], c[:, None])
    return r_t, c


def _parent_dists(p: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
    """(B, N+1, V): the distribution each node's token is judged against (its parent's)."""
    return p[:, tree.parent]


def accept_greedy(tokens: torch.Tensor, p: torch.Tensor, tree: TreeBuffers,
                  relax: Relaxation = Relaxation()) -> Accepted:
    """Greedy verification.

    Exact: a node is accepted if its token is the target argmax after its parent; the
    accepted path is the deepest node whose ancestors are all accepted (lowest index on
    ties), and the bonus is the argmax after it. With relaxation a node is also accepted if
    its relaxed probability r(x) + c is the maximum of the relaxed distribution, i.e.
    >= max_y r(y) (neighbours' own probabilities are not lowered, as in the reference).
    Guarantee (exact): the output equals AR greedy decoding token for token.
    """
    b, n1 = tokens.shape
    par = _parent_dists(p, tree)  # (B, N+1, V)
    best_tok = par.argmax(-1)
    ok = tokens == best_tok
    mass_used = torch.zeros_like(tokens, dtype=p.dtype)
    if relax.active:
        flat = par.reshape(b * n1, -1)
        x = tokens.reshape(-1)
        _, c = relaxed_target(flat, x, relax)
        px = flat.gather(1, x[:, None]).squeeze(1)
        relaxed_ok = (px + c >= flat.max(-1).values).view(b, n1)
        mass_used = torch.where(ok, torch.zeros_like(mass_used), c.view(b, n1))
        ok = ok | relaxed_ok
    ok[:, 0] = True
    all_ok = ~(tree.ancestor_mask[None] & ~ok[:, None, :]).any(-1)  # (B, N+1)
    score = torch.where(all_ok, tree.depth[None] + 1, torch.zeros_like(tree.depth)[None])
    best = score.argmax(-1)  # first (lowest index) of the deepest
    count = tree.depth[best] + 1
    path = tree.path_table[best]
    bonus = p[torch.arange(b, device=p.device), best].argmax(-1)
    d = torch.arange(1, tree.max_depth + 1, device=p.device)
    depth_accepted = count[:, None] > d[None]
    on_path = tree.ancestor_mask[best]  # (B, N+1)
    relax_mass = (mass_used * on_path).sum(-1)
    return Accepted(path, count, bonus, depth_accepted, relax_mass)


# A sampled draft's relaxation is computed for the proposal's top-m tokens only (see below).
MIXTURE_CANDIDATES = 64


def relaxed_mixture(r: torch.Tensor, q: torch.Tensor, relax: Relaxation,
                    budget: torch.Tensor | None = None,
                    candidates: int = MIXTURE_CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """The relaxed target for a draft *sampled* from q: M = E_{x~q}[ r~_x ].

    r, q: (B, V). Each of q's top-`candidates` tokens x gets its proximity set and mass c_x
    (as in `relaxed_target`); every other token keeps r~_x = r (no relaxation), which keeps
    the cost at O(candidates * k) instead of O(V * k) and only makes the relaxation smaller.
    The top-m set depends on q alone, never on which sample came out, so M is a fixed target.
    Returns (M (B, V), tvd (B,)) with tvd = TVD(r, M) <= E_q[c_x], which is <= delta
    (LANTERN) or <= (lambda - 1) * E_q[r(x)] (LANTERN++). A deterministic draft
    (q = one-hot x) gives M = r~_x, i.e. `relaxed_target`.
    """
    b, v = r.shape
    m = min(candidates, v)
    qc, xc = torch.topk(q, m, dim=-1)  # (B, m)
    nb = relax.neighbours[xc]  # (B, m, k)
    mass = r.gather(1, nb.reshape(b, -1)).view(nb.shape)
    cum = mass.cumsum(-1)
    if relax.kind == "delta":
        bound = (budget if budget is not None else torch.full((b,), relax.delta, device=r.device,
                                                               dtype=r.dtype))[:, None].expand(b, m)
    else:
        bound = (relax.lam - 1.0) * r.gather(1, xc)
    moved = mass * (cum <= bound[..., None])  # (B, m, k) mass moved from neighbour j onto x
    c = moved.sum(-1)  # (B, m)
    gained = torch.zeros_like(r).scatter_add_(1, xc, qc * c)
    taken = torch.zeros_like(r).scatter_add_(1, nb.reshape(b, -1), (qc[..., None] * moved).reshape(b, -1))
    mix = r + gained - taken
    tvd = 0.5 * (mix - r).abs().sum(-1)
    return mix, tvd


def accept_sampling(tokens: torch.Tensor, p: torch.Tensor, tree: TreeBuffers, rng: CounterRNG,
                    q: torch.Tensor | None = None, relax: Relaxation = Relaxation()) -> Accepted:
    """Multi-draft recursive rejection sampling over the tree, depth by depth.

    At the current node with target r (p after the node) the children are tried in rank
    order. Child x, drawn from proposal q_i, is accepted with probability
    min(1, t(x) / q_i(x)) where t is the stage's target; on rejection
    r <- norm(max(t - q_i, 0)) and, for sampled drafts, x leaves the proposal:
    q_{i+1} = norm(q_i with x removed). On acceptance the walk moves to x with r = p after x.
    When no child is accepted (or the node is a leaf) the bonus token is sampled from r.

    q: (B, N+1, V) the drafter distribution each node's children were sampled from without
    replacement, or None for deterministic drafts (top-k / EAGLE-2), which behave as
    q_i = one-hot(x).

    The stage target t. Exact: t = r. Relaxed, deterministic draft: t = r~_x (mass of x's
    proximity set moved onto x, `relaxed_target`). Relaxed, sampled draft: t = M =
    E_{x~q_i}[r~_x] (`relaxed_mixture`): the relaxation may not depend on which sample came
    out, or the output would drift from any fixed target.

    Guarantees. Every stage is an exact speculative-sampling step toward t, so its output
    (accepted draft, or what the remaining siblings and the residual produce) is distributed
    exactly as t. Exact mode is therefore lossless, for sampled and deterministic drafts. In
    relaxed mode TVD(t, r) = c_x (deterministic) or <= E_q[c_x] (sampled), with c bounded by
    delta (LANTERN) or (lambda - 1) * r(x) (LANTERN++). For LANTERN the additive budget is
    shared by the siblings of a node: after a stage with rejection probability beta the next
    stage may use (budget - TVD) / beta, so each node's output stays within TVD delta of p.

    Where this differs from the reference code (jadohu/LANTERN): the reference accepts a
    sampled draft with min(1, r~_x(x) / q(x)) using the per-draft target r~_x, whose output is
    not bounded by delta (measured here: TVD 0.15-0.29 at delta 0.1); its residuals also
    differ between model files (dynamic trees zero p on x's k+1 nearest neighbours; static
    trees subtract a q masked on those neighbours; Lumina-mGPT zeroes p before subtracting).
    Here one residual, norm(max(t - q_i, 0)), serves every model and keeps the stage exact.
    """
    b = tokens.size(0)
    dev = p.device
    rows = torch.arange(b, device=dev)
    depth_max = tree.max_depth
    node = torch.zeros(b, dtype=torch.long, device=dev)
    r = p[:, 0]
    qcur = q[:, 0] if q is not None else None
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    count = torch.ones(b, dtype=torch.long, device=dev)
    path = torch.zeros(b, depth_max + 1, dtype=torch.long, device=dev)
    depth_accepted = torch.zeros(b, depth_max, dtype=torch.bool, device=dev)
    relax_mass = torch.zeros(b, dtype=p.dtype, device=dev)
    budget = torch.full((b,), float(relax.delta), dtype=p.dtype, device=dev)
    uniforms = rng.uniform(max(sum(tree.children_at), 1), b)  # one draw per sibling stage
    stage = 0
    for d in range(depth_max):
        level_ok = torch.zeros(b, dtype=torch.bool, device=dev)
        for s in range(tree.children_at[d]):
            child = tree.children[node, s]
            valid = (child >= 0) & ~done & ~level_ok
            child_c = child.clamp(min=0)
            x = tokens[rows, child_c]
            if qcur is None:
                target, shift = relaxed_target(r, x, relax, budget)
                qx = torch.ones(b, device=dev, dtype=p.dtype)
            else:
                if relax.active:
                    target, shift = relaxed_mixture(r, qcur, relax, budget)
                else:
                    target, shift = r, torch.zeros(b, device=dev, dtype=p.dtype)
                qx = qcur[rows, x]
            tx = target[rows, x]
            accept_prob = torch.clamp(tx / qx.clamp(min=_EPS), max=1.0)
            u = uniforms[stage]
            stage += 1
            valid = valid & (qx > 0)  # a sample past the proposal's support is not a draft
            acc = valid & (u < accept_prob)
            rej = valid & ~acc
            if qcur is None:
                residual = target.scatter(1, x[:, None], torch.zeros_like(tx)[:, None])
                reject_prob = 1.0 - accept_prob
            else:
                residual = (target - qcur).clamp(min=0)
                reject_prob = residual.sum(-1)  # = TV(target, q) = P(reject) averaged over x ~ q
            residual = residual / residual.sum(-1, keepdim=True).clamp(min=_EPS)
            r = torch.where(rej[:, None], residual, torch.where(acc[:, None], p[rows, child_c], r))
            if qcur is not None:
                q_rm = qcur.scatter(1, x[:, None], torch.zeros_like(qx)[:, None])
                q_rm = q_rm / q_rm.sum(-1, keepdim=True).clamp(min=_EPS)
                qcur = torch.where(rej[:, None], q_rm, torch.where(acc[:, None], q[rows, child_c], qcur))
            if relax.kind == "delta":
                left = ((budget - shift) / reject_prob.clamp(min=_EPS)).clamp(min=0.0)
                budget = torch.where(rej, left, torch.where(acc, torch.full_like(budget, relax.delta), budget))
            relax_mass = relax_mass + torch.where(acc, shift, torch.zeros_like(shift))
            node = torch.where(acc, child_c, node)
            level_ok = level_ok | acc
        done = done | ~level_ok
        depth_accepted[:, d] = level_ok
        count = count + level_ok.long()
        path[:, d + 1] = node
    bonus = torch.argmax(torch.log(r) + rng.gumbel(*r.shape), dim=-1)
    return Accepted(path, count, bonus, depth_accepted, relax_mass)
