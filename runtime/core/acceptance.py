"""Acceptance rules for a verified draft tree, vectorised on the device.

All functions take a leading batch dimension B (the decoder's batch of images; tests use
large B to measure output distributions). The tree is shared by the batch (static trees) or
one per image (batched `TreeBuffers`, dynamic trees; deterministic drafts only). No function reads a tensor back to the host, and every loop
has a bound fixed by the tree shape, so a step using them can be captured as a graph.

Inputs shared by the rules:
    tokens  (B, N+1)    long   node tokens (node 0 = root, its token is not judged)
    p       (B, N+1, V) float  target distribution *after* each node (for its children)
    tree    TreeBuffers        parent / children / ancestor_mask / path_table / depth

Result (`Accepted`):
    path    (B, D+1) long  accepted nodes root-first; entries at and past `count` repeat
    count   (B,)     long  accepted nodes including the root (1 .. D+1)
    bonus   (B,)     long  the token the target adds after the accepted path
    relax_mass (B,)  float sum over accepted drafts of the relaxation mass c they used

Relaxation (LANTERN / LANTERN++): the proximity sets, the relaxed target and the stage
functions are relaxation.py's (its module docstring states them).

Sampling acceptance (`accept_sampling`): multi-draft recursive rejection sampling.

The rule. At a node with target r its children are tried in rank order. Child x, drawn
from proposal q_i, is accepted with probability min(1, t(x) / q_i(x)), t being the
stage's target; on rejection r <- norm(max(t - q_i, 0)) and, for sampled drafts, x leaves
the proposal: q_{i+1} = norm(q_i with x removed). On acceptance the walk moves to x with
r = p after x. When no child is accepted (or the node is a leaf) the bonus token is
sampled from r.

q: (B, N+1, V) the drafter distribution each node's children were sampled from without
replacement, or None for deterministic drafts (top-k / EAGLE-2), which behave as
q_i = one-hot(x).

The stage target t. Exact: t = r. Relaxed, deterministic drafts: t = r~_x (mass of x's
proximity set moved onto x, `relaxed_target`), the siblings' proximity sets disjoint (a
token already in an earlier sibling's list, or a sibling draft itself, is never moved
onto a later sibling; see `_deterministic_stages`). Relaxed, sampled drafts: the parent's
target is relaxed once, for its first proposal, t = M = E_{x~q_0}[r~_x]
(`relaxed_mixture`; the relaxation may not depend on which sample came out, or the
output would drift from any fixed target), and the siblings are judged exactly toward M.

How it is computed (the op count of this step is a design constraint, see opcount.py).
Stage i of a parent only matters if stages 0..i-1 rejected, so every stage is computed as
if they did, for every parent of the tree at once. Each node then has an acceptance
probability a and a uniform u; the accepted path is the deepest node whose every
ancestor (itself included) was accepted with no earlier sibling accepted (`walk`).
Deterministic drafts need no loop over sibling ranks: exact, a_i = r(x_i) / (1 - sum of
r over x_i's earlier siblings); relaxed, the same with r(x_i) + c_i, since disjoint sets
make every stage read p itself. Sampled drafts loop over the K ranks for the residual
alone (its normalisers are computed for all ranks at once). A missing child (a parent
with fewer than K children) points at a padding token V whose mass is zero, so it
changes nothing.

Guarantees. Every stage is an exact speculative-sampling step toward t, so its output
(accepted draft, or what the remaining siblings and the residual produce) is distributed
exactly as t. Exact mode is therefore lossless, for sampled and deterministic drafts. In
relaxed mode each node's output lies within TVD sum_i c_i of p (deterministic drafts: c_i
bounded by (lambda - 1) * r(x_i) for LANTERN++, and by delta in total over the siblings
for LANTERN, whose budget they share in rank order) or E_q[c_x] (sampled: c_x bounded by
delta, or (lambda - 1) * r(x)).
`relax_mass` sums c (deterministic, normalised at its stage) or the parent's E_q[c_x]
(sampled) over the accepted drafts.
A residual of zero mass (reachable only through float rounding) falls back to p after
the node, so no token of probability zero is ever returned.

A per-image depth cap (`cap` (B,), --dynamic-depth: the depth image i's own check chose,
when its batch-mates had the tree verified deeper): image i accepts no node below cap[i]
and a node at cap[i] is its leaf (bonus from p after it), which is what it gets verifying
its own prefix alone. Nodes at or above the cap see the same children, the same p and, with
`uniforms` drawn for the whole tree (u first, the bonus's V last), the same numbers.

The rules. Everything above is rule "bounded". Rule "paper" (`relax.rule`, the default of
the methods) does what the reference code (jadohu/LANTERN, `evaluate_posterior` and
`evaluate_posterior_v1` of ea_model_llamagen.py) does, stage by stage against the current
residual g (p at first): each sibling gets the full budget c_x computed on g (delta, or
(lambda - 1) g(x)), and
    deterministic drafts (dynamic trees): accept with g(x) + c_x; on rejection g is zeroed
        at x and, when x's relaxation was used (its nearest code fits the budget), at its
        k+1 nearest codes, then renormalised (`_paper_deterministic_stages`);
    sampled drafts (static trees, sjd): accept with min(1, (g(x) + c_x) / q_s(x)); on
        rejection g <- norm(max(g - q', 0)), q' = q_s zeroed at x's k+1 nearest codes when
        its relaxation was used (`_paper_sampled_stages`).
A sampled draft gains c_x rather than q(x) c_x, so the output is not bounded by delta
(measured: see README); each relaxed *test* is. Two deliberate differences from the
reference, both to keep the promise that no token of probability 0 is returned: a
draft of target probability 0 gets no additive budget, and a residual of zero mass falls
back to p after the node (the reference uses a uniform distribution there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, overload

import torch

import torch.nn.functional as F

from runtime.core.relaxation import (EPS, MIXTURE_CANDIDATES, Relaxation, deterministic_stages, proximity_mass,
                                     sampled_stages)
from runtime.core.rng import CounterRNG, race
from runtime.core.tree import TreeBuffers
from runtime.core.tree_walks import first_wins_walk, path_sum, reference_row_order, sibling_sum, walk, walk_ending_at

if TYPE_CHECKING:
    from runtime.models.target import Target


@dataclass
class Accepted:
    """What acceptance decided, per image: path (B, M) the accepted nodes, root first (padded
    by repeating the last); count (B,) accepted nodes with the root; bonus (B,) the token
    sampled after them; relax_mass (B,) the relaxation used on the accepted drafts; commit
    (B, M) or None: nodes whose tokens, once the root's token is the bonus, are the new block
    (accepted drafts, then the bonus) in one gather (shared trees)."""
    path: torch.Tensor
    count: torch.Tensor
    bonus: torch.Tensor
    relax_mass: torch.Tensor
    commit: torch.Tensor | None = None



def accept_greedy(tokens: torch.Tensor, p: torch.Tensor, tree: TreeBuffers,
                  relax: Relaxation = Relaxation(), cap: torch.Tensor | None = None,
                  bonus_at: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  parent_row: torch.Tensor | None = None) -> Accepted:
    """Greedy verification.

    Exact: a node is accepted if its token is the target argmax after its parent; the
    accepted path is the deepest node whose ancestors are all accepted (lowest index on
    ties), and the bonus is the argmax after it. With relaxation a node is also accepted if
    its relaxed probability r(x) + c is the maximum of the relaxed distribution, i.e.
    >= max_y r(y) (neighbours' own probabilities are not lowered, as in the reference);
    COOL-SD's where w_d r(x) >= max_y r(y), d the node's depth, for w_d > 1 only.
    Guarantee (exact): the output equals AR greedy decoding token for token.
    Rule "paper" on a dynamic (batched) tree: among equally deep accepted paths the one the
    reference commits (`reference_row_order`); several siblings can pass only when relaxed.
    Where p holds only the rows that judge drafts, (B, J, V) for the J nodes with children:
    parent_row (N+1,) the row of each node's parent in it (`StageLayout.parent_row`), and
    bonus_at(best) the target's argmax (B,) after node best (B,) long; else p's row best.
    """
    b, n1 = tokens.shape
    v = p.size(-1)
    rows = torch.arange(b, device=p.device)
    # each node's parent's row of p, which judges it
    parent = (tree.parent if parent_row is None else parent_row).expand(b, n1)
    # per row of p first, then each node reads its parent's: no (B, N+1, V) copy of the parents' rows
    ok = tokens == p.argmax(-1).gather(1, parent)
    if relax.anneal:  # COOL-SD: within a factor w_d of the maximum, where w_d > 1
        assert relax.weights is not None, "COOL-SD needs its weights"
        wd = relax.weights[tree.depth.expand(b, n1)]
        px = p.reshape(b, -1).gather(1, parent * v + tokens)
        top = p.amax(-1).gather(1, parent)
        relaxed_ok = (wd > 1.0) & (wd * px >= top)
        mass_used = ((wd * px).minimum(top) - px).clamp(min=0.0).masked_fill(ok, 0.0)
        ok = ok | relaxed_ok
    elif relax.active:
        assert relax.neighbours is not None, "an active relaxation has its neighbour table"
        flat = p.reshape(b, -1)
        at = parent * v  # where each node's parent row starts in flat
        px = flat.gather(1, at + tokens)  # (B, N+1)
        mass = flat.gather(1, (at[..., None] + relax.neighbours[tokens]).view(b, -1)).view(b, n1, -1)
        c = proximity_mass(mass, px, relax)  # what relaxed_target moves onto each draft
        relaxed_ok = px + c >= p.amax(-1).gather(1, parent)
        mass_used = c.masked_fill(ok, 0.0)
        ok = ok | relaxed_ok
    ok[:, 0] = True
    if cap is not None:  # nothing below an image's own cut (its bonus is the argmax there anyway)
        ok &= tree.depth[None] <= cap[:, None]
    weights = tree.walk_weights()
    tie = reference_row_order(tree, weights) if relax.paper and tree.batched else None
    w = walk(ok.to(p.dtype), tree, rows, weights, tie)
    bonus = p[rows, w.best].argmax(-1) if bonus_at is None else bonus_at(w.best)
    relax_mass = path_sum(mass_used, w) if relax.active else torch.zeros_like(bonus, dtype=p.dtype)
    return Accepted(w.path, w.count, bonus, relax_mass, w.commit)


def accept_greedy_path(tokens: torch.Tensor, tree: TreeBuffers, choice_at: Callable[[torch.Tensor, int], torch.Tensor],
                       cap: torch.Tensor | None = None) -> Accepted:
    """Exact greedy verification that asks for the target's choice only along the path it accepts.

    choice_at(node, d): the target's argmax (B,) after node (B,) long, a node at depth d for
    every image still walking (the others' answers are not read). From the root, a node's
    child is accepted when its token is that choice; the walk stops at the first node none of
    whose children is (or at an image's `cap`), and the choice there is the bonus.

    Same result as `accept_greedy` without relaxation: siblings hold distinct tokens, so at
    most one child of an accepted node passes and the accepted path is unique; but the target's
    distribution is needed at D + 1 nodes per image instead of N + 1 (one small head matmul
    per depth, D + 1 of them, fixed, so the step stays capturable).
    """
    b = tokens.size(0)
    rows = torch.arange(b, device=tokens.device)
    node = torch.zeros(b, dtype=torch.long, device=tokens.device)
    walking = torch.ones(b, dtype=torch.bool, device=tokens.device)
    bonus = torch.zeros_like(node)
    for d in range(tree.max_depth + 1):
        choice = choice_at(node, d)
        if d == tree.max_depth:
            bonus = torch.where(walking, choice, bonus)
            break
        kids = tree.children[rows, node] if tree.batched else tree.children[node]  # (B, K), -1 = none
        passed = (kids >= 0) & (tokens.gather(1, kids.clamp(min=0)) == choice[:, None])
        if cap is not None:  # nothing below an image's own cut
            passed &= (cap > d)[:, None]
        on = passed.any(-1) & walking
        bonus = torch.where(walking & ~on, choice, bonus)
        node = torch.where(on, kids.gather(1, passed.long().argmax(-1, keepdim=True)).squeeze(1), node)
        walking = on
    w = walk_ending_at(node, tree, rows, tree.walk_weights())
    return Accepted(w.path, w.count, bonus, torch.zeros(b, dtype=torch.float32, device=tokens.device), w.commit)


def accept_sampling(tokens: torch.Tensor, p: torch.Tensor, tree: TreeBuffers, rng: CounterRNG,
                    q: torch.Tensor | None = None, relax: Relaxation = Relaxation(),
                    uniforms: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                    cap: torch.Tensor | None = None) -> Accepted:
    """Multi-draft recursive rejection sampling over the tree, every parent at once: the rule,
    the stage target, how it is computed, its guarantees, the depth cap and the paper rule are
    set out in the module docstring ("Sampling acceptance").
    """
    b, n1 = tokens.shape
    v = p.size(-1)
    # one draw per node (its acceptance test) and one noise row for the bonus; `uniforms`
    # (B, N+1+V): these numbers, drawn already (with the drafts' noise, in the draft step)
    noise = rng.uniform(b, n1 + v) if uniforms is None else uniforms
    u, bonus_u = noise[:, :n1], noise[:, noise.size(1) - v:]
    t = tree.per_image(b)
    rows = torch.arange(b, device=p.device) if rows is None else rows  # the caller's arange(B), if it keeps one
    weights = tree.walk_weights()
    if q is None:
        tokens_pad = torch.cat([tokens, torch.full_like(tokens[:, :1], v)], 1)  # node n1 = "no child"

    if q is not None:
        if tree.stages is None or tree.batched:
            raise ValueError("sampled drafts need a static tree (TreeBuffers.stages)")
        stages = sampled_stages(relax)
        a, shift, bonus_rows = stages(tokens, p, q, tree, relax)
    elif relax.active:
        k = tree.max_children
        child = torch.remainder(t.children, n1 + 1)  # (B, N+1, K): a missing child (-1) -> n1
        xs = tokens_pad.gather(1, child.reshape(b, -1)).view(b, n1, k)
        stages = deterministic_stages(relax)
        a_pk, shift_pk, bonus_rows = stages(xs, p, relax, depth=t.depth)
        slot = torch.add(t.rank, t.parent, alpha=k)  # parent * k + rank
        a, shift = a_pk.reshape(b, -1).gather(1, slot), shift_pk.reshape(b, -1).gather(1, slot)
    else:  # exact deterministic drafts: closed form
        px = p.reshape(b, -1).gather(1, t.parent * v + tokens)  # (B, N+1) r(x) at the parent
        a = px / (1.0 - sibling_sum(px, tree, weights)).clamp(min=EPS)
        shift = torch.zeros_like(a)
        bonus_rows = None

    passed = u < a
    if cap is not None:
        passed &= t.depth <= cap[:, None]
    w = first_wins_walk(passed.to(p.dtype), tree, rows, weights)
    best, count, path = w.best, w.count, w.path
    # bonus: from the residual left after every child of `best` was rejected
    p_best = p[rows, best]
    if bonus_rows is None:  # exact deterministic: p after best without its children's tokens
        kids_best = t.children[rows, best]
        kids = tokens_pad[rows[:, None], torch.where(kids_best >= 0, kids_best, n1)]
        r = p_best * torch.ones(b, v + 1, dtype=p.dtype, device=p.device).scatter_(1, kids, 0.0)[:, :v]
    else:
        r = bonus_rows(best, rows, w.stage_position)
    if cap is not None:  # an image's leaf at its cut: p after it, its children never judged
        r = torch.where((count - 1 >= cap)[:, None], p_best, r)
    r = torch.where(r.sum(-1, keepdim=True) > 0, r, p_best)
    bonus = race(r, bonus_u)
    relax_mass = path_sum(shift, w) if relax.active else torch.zeros_like(bonus, dtype=p.dtype)
    return Accepted(path, count, bonus, relax_mass, w.commit)


@dataclass(frozen=True)
class GroupRule:
    """GSD-style grouped acceptance (lossy): a draft is judged with the mass of its cluster.

    The cluster of draft x at a position with target r: the tokens whose rank in r lies
    within `window` of x's rank, whose probability differs from r(x) by less than `gap`, and
    whose input-embedding rows (L2-normalised, so the threshold does not depend on the
    model's embedding scale; GSD uses raw rows) lie within squared distance `dist` of x's.
    x is always in its cluster. embed: (V, dim) float32 normalised rows; near: (V, V) bool
    table of the embedding test, precomputed where it is small (see `for_target`), else None
    and the test is computed per step.
    """

    window: int
    gap: float
    dist: float
    embed: torch.Tensor
    near: torch.Tensor | None = None

    # the (V, V) table is built when it costs at most this many entries / multiply-adds
    TABLE_ENTRIES: ClassVar[int] = 1 << 26
    TABLE_FLOPS: ClassVar[int] = 1 << 33

    @classmethod
    def for_target(cls, target: Target, window: int, gap: float, dist: float) -> "GroupRule":
        emb = F.normalize(target.tok_embeddings.weight.detach().float(), dim=-1)
        v, dim = emb.shape
        near = None
        if v * v <= cls.TABLE_ENTRIES and v * v * dim <= cls.TABLE_FLOPS:
            near = torch.cat([(2.0 - 2.0 * emb[i:i + 1024] @ emb.T) < dist for i in range(0, v, 1024)])
        return cls(window, gap, dist, emb, near)

    def cluster(self, r: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """r (P, V), x (P, m) -> members (P, m, 2W+1) long and inside (P, m, 2W+1) bool."""
        n_par, v = r.shape
        m, w = x.size(1), self.window
        order = r.argsort(-1, descending=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(v, device=r.device).expand(n_par, v))
        pos = rank.gather(-1, x)[..., None] + torch.arange(-w, w + 1, device=r.device)  # (P, m, 2W+1)
        valid = (pos >= 0) & (pos < v)
        members = order.gather(-1, pos.clamp(0, v - 1).view(n_par, -1)).view(n_par, m, -1)
        close = (r.gather(-1, members.view(n_par, -1)).view(members.shape) - r.gather(-1, x)[..., None]).abs() < self.gap
        if self.near is not None:
            near = self.near.index_select(0, x.reshape(-1)).gather(1, members.view(n_par * m, -1))
        else:  # unit rows: |a - b|^2 = 2 - 2 a.b
            dim = self.embed.size(1)
            e_m = self.embed.index_select(0, members.reshape(-1)).view(n_par * m, -1, dim)
            e_x = self.embed.index_select(0, x.reshape(-1)).view(n_par * m, 1, dim)
            near = (2.0 - 2.0 * (e_m * e_x).sum(-1)) < self.dist
        return members, valid & close & near.view(members.shape)

    def acceptance(self, r: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """min(1, r(C_x) / q(C_x)) for drafts x (P, m) at targets r and proposals q (P, V)."""
        members, inside = self.cluster(r, x)
        flat = members.view(r.size(0), -1)
        r_c = (r.gather(-1, flat).view(members.shape) * inside).sum(-1)
        q_c = (q.gather(-1, flat).view(members.shape) * inside).sum(-1)
        return torch.where(q.gather(-1, x) > 0, r_c / q_c.clamp(min=EPS), 0.0).clamp(max=1.0)

    def bound(self, r: torch.Tensor, q: torch.Tensor, candidates: int = MIXTURE_CANDIDATES) -> torch.Tensor:
        """(P,) upper bound on TVD(output, r) of one grouped stage with proposal q.

        Coupled with exact speculative sampling on the same draft x ~ q and uniform, the two
        differ only when their accept decisions do, which happens with probability
        |a(x) - min(1, r(x)/q(x))|; so TVD <= E_q|a - a0|, summed here over q's top
        `candidates` tokens, plus q's remaining mass counted as fully different.
        """
        return self.judge(r, q, None, candidates)[1]

    @overload
    def judge(self, r: torch.Tensor, q: torch.Tensor, x: torch.Tensor,
              candidates: int = MIXTURE_CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def judge(self, r: torch.Tensor, q: torch.Tensor, x: None,
              candidates: int = MIXTURE_CANDIDATES) -> tuple[None, torch.Tensor]: ...

    def judge(self, r: torch.Tensor, q: torch.Tensor, x: torch.Tensor | None,
              candidates: int = MIXTURE_CANDIDATES) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(acceptance of drafts x (P, 1) or None, `bound` (P,)), from one ranking of r."""
        top = torch.topk(q, min(candidates, q.size(-1)), dim=-1)
        cand, qx = top.indices, top.values
        a_all = self.acceptance(r, q, cand if x is None else torch.cat([x, cand], 1))
        a = a_all[:, -cand.size(1):]
        a0 = torch.where(qx > 0, r.gather(-1, cand) / qx.clamp(min=EPS), 0.0).clamp(max=1.0)
        bound = (qx * (a - a0).abs()).sum(-1) + (1.0 - qx.sum(-1)).clamp(min=0.0)
        return (None if x is None else a_all[:, 0]), bound


def accept_grouped(tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, tree: TreeBuffers,
                   rng: CounterRNG, rule: GroupRule) -> Accepted:
    """Grouped acceptance of sampled drafts on a chain (one child per node), every node at once.

    Node i (drafted from q[parent]) is accepted with probability min(1, r(C) / q(C)), C its
    cluster under the target r = p[parent] (`GroupRule`); at the first rejection the bonus is
    sampled from norm(max(r - q, 0)), as in SJD/GSD. Lossy: each committed token's
    distribution lies within TVD `GroupRule.bound` of the target's; `relax_mass` sums those
    bounds over the positions that committed a token from a judged stage (accepted drafts
    and the stage whose residual gave the bonus).
    """
    if tree.max_children != 1:
        raise ValueError("grouped acceptance judges one draft per position (a chain)")
    b, n1 = tokens.shape
    v = p.size(-1)
    noise = rng.uniform(b, n1 + v)
    u, bonus_u = noise[:, :n1], noise[:, n1:]
    flat_p, flat_q = p.reshape(b * n1, v), q.reshape(b * n1, v)
    child = tree.children[:, 0]  # (N+1,) -1 at the leaf
    x = tokens[:, child.clamp(min=0)].reshape(b * n1, 1)
    a_par, bound_par = rule.judge(flat_p, flat_q, x)
    a_par = torch.where(child >= 0, a_par.view(b, n1), 0.0)
    bound_par = bound_par.view(b, n1) * (child >= 0)
    a = a_par[:, tree.parent]  # node i judged at its parent
    rows = torch.arange(b, device=p.device)
    w = first_wins_walk((u < a).to(p.dtype), tree, rows, tree.walk_weights())  # a chain: no siblings
    best, count, path = w.best, w.count, w.path
    p_best = p[rows, best]
    res = (p_best - q[rows, best]).clamp(min=0.0) * (child[best] >= 0)[:, None]
    r = torch.where(res.sum(-1, keepdim=True) > 0, res, p_best)
    bonus = race(r, bonus_u)
    mass = path_sum(bound_par[:, tree.parent], w) + bound_par[rows, best]
    return Accepted(path, count, bonus, mass, w.commit)
