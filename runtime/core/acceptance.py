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

Relaxation (LANTERN / LANTERN++). For draft x and the current target r, the proximity set
is x plus the longest prefix n_1..n_j of x's nearest codebook neighbours whose cumulative
target mass c_j = r(n_1)+...+r(n_j) stays within the bound:
    LANTERN   (additive):        c_j <= delta_remaining      (delta for the first sibling)
    LANTERN++ (multiplicative):  c_j <= (lambda - 1) * r(x), i.e. r~(x) <= lambda * r(x)
The relaxed target r~ moves that mass onto x: r~(x) = r(x) + c_j, r~(n_i) = 0 for i <= j.
TVD(r, r~) = c_j exactly. A draft the target gives probability 0 is not relaxed (its additive
budget is 0 too; the multiplicative bound already is), so no rule ever moves mass onto, or
returns, a token of target probability 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol, overload

import torch

import torch.nn.functional as F

from runtime.core.rng import CounterRNG, race
from runtime.core.tree import TreeBuffers
from runtime.method_options import RELAX_RULES

if TYPE_CHECKING:
    from runtime.models.target import Target

_EPS = 1e-12


class BonusRows(Protocol):
    """bonus_rows(best (B,), rows (B,), position (B,) or None) -> (B, V): the residual after every
    child of node `best` was rejected; `position`, when given, is best's place in the stage order
    (`_Walk.stage_position`), which the stage functions otherwise look up."""

    def __call__(self, best: torch.Tensor, rows: torch.Tensor, position: torch.Tensor | None = None
                 ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Relaxation:
    """kind: "none" (exact), "delta" (LANTERN, additive) or "lambda" (LANTERN++).

    neighbours: (V, k) long nearest-codebook table (see proximity.py); None when exact.
    rule: "paper" (what the reference LANTERN code does, see `accept_sampling`) or "bounded"
    (each node's output within the stated TVD bound of the target).
    zero_neighbours: (V, k+1) the table the paper rule clears on a relaxed rejection (the
    reference clears x's k+1 nearest codes); None: `neighbours` itself.
    """

    kind: str = "none"
    delta: float = 0.0
    lam: float = 1.0
    neighbours: torch.Tensor | None = None
    rule: str = "paper"
    zero_neighbours: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return (self.kind == "delta" and self.delta > 0) or (self.kind == "lambda" and self.lam > 1)

    @property
    def paper(self) -> bool:
        """The reference code's rule is in effect (relaxation on and rule "paper")."""
        return self.active and self.rule == "paper"

    # (V+1, k): `neighbours` plus a row for the padding token V whose neighbours are all V
    # (a missing child); built with the Relaxation, so a captured step reads a fixed buffer.
    # clear_padded (V+1, k+2): row x = x itself, then `zero_neighbours`' row (what the paper
    # rule clears when x is rejected), padded the same way.
    padded: torch.Tensor | None = field(init=False, default=None, repr=False)
    clear_padded: torch.Tensor | None = field(init=False, default=None, repr=False)
    # 0-d constants on the table's device: the padding token V, 0.0 and +inf, for `torch.where` in
    # the paper rule's stage loops (a Python scalar there costs a scalar_tensor kernel per call)
    no_code: torch.Tensor | None = field(init=False, default=None, repr=False)
    zero: torch.Tensor | None = field(init=False, default=None, repr=False)
    inf: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.rule not in RELAX_RULES:
            raise ValueError(f"relaxation rule must be one of {', '.join(RELAX_RULES)}, got {self.rule!r}")
        nb = self.neighbours
        if nb is not None:

            def pad(t: torch.Tensor) -> torch.Tensor:
                return torch.cat([t, torch.full_like(t[:1], nb.size(0))])

            object.__setattr__(self, "padded", pad(nb))
            zn = self.zero_neighbours if self.zero_neighbours is not None else nb
            zn = pad(zn.to(nb.device))
            ids = torch.arange(zn.size(0), device=nb.device)[:, None]
            object.__setattr__(self, "clear_padded", torch.cat([ids, zn], 1))
            object.__setattr__(self, "no_code", torch.tensor(nb.size(0), device=nb.device))
            object.__setattr__(self, "zero", torch.zeros((), device=nb.device))
            object.__setattr__(self, "inf", torch.full((), torch.inf, device=nb.device))


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


def relaxed_target(r: torch.Tensor, x: torch.Tensor, relax: Relaxation) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the proximity-set mass of neighbours onto x.

    r: (B, V) target; x: (B,) drafts. Returns (r~ (B, V), c (B,)) with TVD(r, r~) = c <= the
    bound (delta, or (lambda - 1) r(x)).
    """
    if not relax.active:
        return r, torch.zeros(r.size(0), device=r.device, dtype=r.dtype)
    assert relax.neighbours is not None, "an active relaxation has its neighbour table"
    nb = relax.neighbours[x]  # (B, k)
    mass = r.gather(1, nb)  # (B, k)
    rx = r.gather(1, x[:, None]).squeeze(1)
    inside = _proximity_set(mass, rx, relax)
    c = (mass * inside).sum(1)
    r_t = r.scatter(1, nb, torch.where(inside, torch.zeros_like(mass), mass))
    r_t = r_t.scatter_add(1, x[:, None], c[:, None])
    return r_t, c


def _proximity_set(mass: torch.Tensor, rx: torch.Tensor, relax: Relaxation) -> torch.Tensor:
    """(..., k) bool: which of x's nearest neighbours (target masses `mass` (..., k), nearest
    first) the proximity set holds, given x's own mass rx (...): the longest prefix whose
    cumulative mass stays within the bound."""
    if relax.kind == "delta":
        bound = relax.delta * (rx > 0)
    else:
        bound = (relax.lam - 1.0) * rx
    return mass.cumsum(-1) <= bound[..., None]  # a prefix, since masses are >= 0


def _proximity_mass(mass: torch.Tensor, rx: torch.Tensor, relax: Relaxation) -> torch.Tensor:
    """(...): the mass c that `relaxed_target` moves onto x (the proximity set's, `_proximity_set`)."""
    return (mass * _proximity_set(mass, rx, relax)).sum(-1)


def _per_node(weights: torch.Tensor, x: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
    """(B, N+1): row i of `weights` ((N+1, N+1) or batched (B, N+1, N+1)) applied to x (B, N+1)."""
    if not tree.batched:
        return x @ weights.T
    return torch.bmm(weights, x[..., None]).squeeze(-1)


def _sibling_sum(x: torch.Tensor, tree: TreeBuffers, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """(B, N+1) float -> (B, N+1): the sum of x over each node's earlier siblings."""
    return _per_node(weights[1], x, tree)


@dataclass
class _Walk:
    """The accepted path found from per-node outcomes (see `_walk`)."""
    best: torch.Tensor  # (B,) the deepest node whose path was accepted
    count: torch.Tensor  # (B,) accepted nodes including the root: depth(best) + 1
    path: torch.Tensor  # (B, D+1) path_table row of best
    on_path: torch.Tensor  # (B, N+1) float 1 for best and its ancestors, the root excepted
    commit: torch.Tensor | None = None  # (B, D+1) `SharedWalk` commit row of best (shared trees)
    stage_position: torch.Tensor | None = None  # (B,) best's place in the stage order (shared trees)


def _walk(won: torch.Tensor, tree: TreeBuffers, rows: torch.Tensor, weights: tuple[torch.Tensor, ...],
          tie: torch.Tensor | None = None) -> _Walk:
    """won (B, N+1) float 1/0: node i's own test passed (the root's entry must be 1);
    weights: `tree.walk_weights()`.

    The accepted path ends at the deepest node whose every ancestor, itself included, won
    (the lowest index among equals): a node's count of winning ancestors equals its depth + 1.
    tie: (B, N+1) float in [0, 1), the preference among equally deep nodes instead (higher
    wins; `reference_row_order`).
    """
    anc, _, depth1 = weights
    return _deepest(_per_node(anc, won, tree) == depth1, tree, rows, weights, tie)


def _first_wins_walk(passed: torch.Tensor, tree: TreeBuffers, rows: torch.Tensor,
                     weights: tuple[torch.Tensor, ...]) -> _Walk:
    """The walk of sibling stages: passed (B, N+1) float 1/0, node i's own test passed (the
    root's entry is not read). A node wins when it passed and no earlier sibling did (stage s
    is only reached after stages 0..s-1 rejected); the path ends at the deepest node whose
    every ancestor won, as `_walk`. A shared tree folds the sibling condition into the walk's
    matmul (`SharedWalk.first_win`)."""
    shared = tree.shared_walk()
    if shared is None:
        won = passed * (_sibling_sum(passed, tree, weights) == 0)
        won[:, 0] = 1.0
        return _walk(won, tree, rows, weights)
    return _deepest(passed @ shared.first_win.T == shared.depth, tree, rows, weights)


def _deepest(full: torch.Tensor, tree: TreeBuffers, rows: torch.Tensor, weights: tuple[torch.Tensor, ...],
             tie: torch.Tensor | None = None) -> _Walk:
    """The walk's end among the nodes whose whole path was accepted (full (B, N+1) bool): the
    deepest, the lowest index among equals (or the highest `tie`)."""
    anc, _, depth1 = weights
    if tie is None:
        best = (full * depth1).argmax(-1)  # first of the deepest
    else:
        best = (full * (depth1 + tie)).argmax(-1)
    return _ending_at(best, tree, rows, weights)


def _ending_at(best: torch.Tensor, tree: TreeBuffers, rows: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> _Walk:
    """The walk whose path ends at node best (B,) long."""
    anc, _, depth1 = weights
    shared = tree.shared_walk()
    if shared is not None:  # one row per image holds the path, the commit row, the count and more
        row = shared.rows[best]
        return _Walk(best, shared.count(row), shared.path(row), shared.drafts_on_path[best],
                     shared.commit(row), shared.stage_position(row))
    on_path = anc[rows, best]
    on_path[:, 0] = 0.0
    return _Walk(best, depth1[rows, best], tree.path_table[rows, best], on_path)


def reference_row_order(tree: TreeBuffers, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """(B, N+1) float in [0, 1): how early each node's first verification row comes in the
    reference code's greedy walk over a dynamic tree, higher = earlier.

    The reference verifies one row per leaf, leaves in node order, and among rows whose
    accepted prefix is equally long commits the first (`argmax` over row lengths). The node
    committed at depth d is therefore the accepted depth-d node whose subtree holds the
    lowest-numbered leaf. Static trees are verified in lexicographic row order, where that
    node is the lowest-numbered one, which `_walk` picks without this key.
    """
    anc = weights[0]  # (B, N+1, N+1): [i, j] = j is i or an ancestor of i
    n1 = anc.size(-1)
    leaf = (tree.children[..., 0] < 0).to(anc.dtype)  # (B, N+1)
    index = torch.arange(n1, device=anc.device, dtype=anc.dtype)
    # first leaf below each node j: the lowest i with anc[i, j] among leaves (n1 where none)
    first_leaf = torch.where(anc * leaf[..., None] > 0, index[:, None], float(n1)).amin(-2)
    return (n1 - first_leaf) / (n1 + 1)


def _path_sum(x: torch.Tensor, w: _Walk) -> torch.Tensor:
    """(B,): x (B, N+1) float summed over the accepted drafts (best and its ancestors but the
    root), one bmm."""
    return torch.bmm(x[:, None, :], w.on_path[:, :, None].to(x.dtype)).view(-1)


def accept_greedy(tokens: torch.Tensor, p: torch.Tensor, tree: TreeBuffers,
                  relax: Relaxation = Relaxation(), cap: torch.Tensor | None = None,
                  bonus_at: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  parent_row: torch.Tensor | None = None) -> Accepted:
    """Greedy verification.

    Exact: a node is accepted if its token is the target argmax after its parent; the
    accepted path is the deepest node whose ancestors are all accepted (lowest index on
    ties), and the bonus is the argmax after it. With relaxation a node is also accepted if
    its relaxed probability r(x) + c is the maximum of the relaxed distribution, i.e.
    >= max_y r(y) (neighbours' own probabilities are not lowered, as in the reference).
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
    if relax.active:
        assert relax.neighbours is not None, "an active relaxation has its neighbour table"
        flat = p.reshape(b, -1)
        at = parent * v  # where each node's parent row starts in flat
        px = flat.gather(1, at + tokens)  # (B, N+1)
        mass = flat.gather(1, (at[..., None] + relax.neighbours[tokens]).view(b, -1)).view(b, n1, -1)
        c = _proximity_mass(mass, px, relax)  # what relaxed_target moves onto each draft
        relaxed_ok = px + c >= p.amax(-1).gather(1, parent)
        mass_used = c.masked_fill(ok, 0.0)
        ok = ok | relaxed_ok
    ok[:, 0] = True
    if cap is not None:  # nothing below an image's own cut (its bonus is the argmax there anyway)
        ok &= tree.depth[None] <= cap[:, None]
    weights = tree.walk_weights()
    tie = reference_row_order(tree, weights) if relax.paper and tree.batched else None
    w = _walk(ok.to(p.dtype), tree, rows, weights, tie)
    bonus = p[rows, w.best].argmax(-1) if bonus_at is None else bonus_at(w.best)
    relax_mass = _path_sum(mass_used, w) if relax.active else torch.zeros_like(bonus, dtype=p.dtype)
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
    w = _ending_at(node, tree, rows, tree.walk_weights())
    return Accepted(w.path, w.count, bonus, torch.zeros(b, dtype=torch.float32, device=tokens.device), w.commit)


# A sampled draft's relaxation is computed for the proposal's top-m tokens only (see below).
MIXTURE_CANDIDATES = 64


def relaxed_mixture(r: torch.Tensor, q: torch.Tensor, relax: Relaxation,
                    candidates: int = MIXTURE_CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """The relaxed target for a draft *sampled* from q: M = E_{x~q}[ r~_x ].

    r, q: (..., V). Each of q's top-`candidates` tokens x gets its proximity set and mass c_x
    (as in `relaxed_target`); every other token keeps r~_x = r (no relaxation), which keeps
    the cost at O(candidates * k) instead of O(V * k) and only makes the relaxation smaller.
    The candidate set depends on q alone, never on which sample came out, so M is a fixed
    target. A candidate of probability 0 gets no additive budget (kind "delta").
    Returns (M (..., V), shift (...,)) with shift = E_q[c_x] >= TVD(r, M); shift is <= delta
    (LANTERN) or <= (lambda - 1) * E_q[r(x)] (LANTERN++). A deterministic draft (q = one-hot
    x) gives M = r~_x and shift = c_x, i.e. `relaxed_target`.
    """
    assert relax.neighbours is not None, "a relaxed mixture needs the neighbour table"
    cand = torch.topk(q, min(candidates, q.size(-1)), dim=-1).indices
    nb = relax.neighbours[cand]
    nb_flat = nb.flatten(-2)
    r_cand, q_cand = r.gather(-1, cand), q.gather(-1, cand)
    mass = r.gather(-1, nb_flat).view(nb.shape)
    if relax.kind == "delta":
        bound = relax.delta * (r_cand > 0)
    else:
        bound = (relax.lam - 1.0) * r_cand
    # (..., m, k): q(x) times the mass moved from neighbour j onto x
    moved = mass * (mass.cumsum(-1) <= bound[..., None]) * q_cand[..., None]
    gained = moved.sum(-1)  # (..., m): q(x) c_x
    mix = r.scatter_add(-1, cand, gained).scatter_add(-1, nb_flat, moved.neg().flatten(-2))
    return mix, gained.sum(-1)


def accept_sampling(tokens: torch.Tensor, p: torch.Tensor, tree: TreeBuffers, rng: CounterRNG,
                    q: torch.Tensor | None = None, relax: Relaxation = Relaxation(),
                    uniforms: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                    cap: torch.Tensor | None = None) -> Accepted:
    """Multi-draft recursive rejection sampling over the tree, every parent at once.

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
    ancestor (itself included) was accepted with no earlier sibling accepted (`_walk`).
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
        a_pk, shift_pk, bonus_rows = stages(xs, p, relax)
        slot = torch.add(t.rank, t.parent, alpha=k)  # parent * k + rank
        a, shift = a_pk.reshape(b, -1).gather(1, slot), shift_pk.reshape(b, -1).gather(1, slot)
    else:  # exact deterministic drafts: closed form
        px = p.reshape(b, -1).gather(1, t.parent * v + tokens)  # (B, N+1) r(x) at the parent
        a = px / (1.0 - _sibling_sum(px, tree, weights)).clamp(min=_EPS)
        shift = torch.zeros_like(a)
        bonus_rows = None

    passed = u < a
    if cap is not None:
        passed &= t.depth <= cap[:, None]
    w = _first_wins_walk(passed.to(p.dtype), tree, rows, weights)
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
    relax_mass = _path_sum(shift, w) if relax.active else torch.zeros_like(bonus, dtype=p.dtype)
    return Accepted(path, count, bonus, relax_mass, w.commit)


def _deterministic_stages(xs: torch.Tensor, p: torch.Tensor, relax: Relaxation
                          ) -> tuple[torch.Tensor, torch.Tensor, BonusRows]:
    """Relaxed stages of deterministic drafts for every parent and sibling rank at once.

    xs: (B, P, K) child tokens per parent in rank order (V = no child: zero mass, a no-op
    stage); p: (B, P, V). Returns acceptance probabilities (B, P, K), shifts (B, P, K) and a
    function giving the bonus rows (B, V) of the given parents (B,) after all their children
    were rejected.

    The siblings' proximity sets are disjoint by construction: a neighbour that is a sibling
    draft, or that an earlier sibling's neighbour list already holds, counts as mass 0 for the
    later sibling (it is never moved onto it). Every stage therefore reads p itself, not what
    earlier stages left, and no loop over ranks is needed:
        lambda: sibling x takes the longest prefix of its list with mass <= (lambda - 1) p(x);
        delta:  the siblings together take the longest prefix of their concatenated lists (in
                rank order) with mass <= delta (one shared additive budget), skipping the lists
                of drafts of probability 0.
    Unnormalised, stage s removes taken_s = p(x_s) + c_s from the parent's mass; it runs on
    the mass z_s = 1 - sum of earlier taken, so a_s = taken_s / z_s and the shift is c_s / z_s.
    The output of a node is p with the moved masses relocated onto their drafts, so its TVD
    from p is at most the sum of c over the siblings: <= delta, or <= (lambda - 1) p(x) per
    sibling.
    """
    assert relax.padded is not None, "relaxed stages need the neighbour table"
    b, n_par, k = xs.shape
    v = p.size(-1)
    p_pad = F.pad(p, (0, 1))  # token V (no child) has mass 0
    near = relax.padded[xs]  # (B, P, K, kn)
    # siblings first, then each sibling's neighbour list in rank order
    flat = torch.cat([xs, near.flatten(-2)], -1)  # (B, P, K + K * kn)
    ranked, order = flat.sort(dim=-1, stable=True)  # equal tokens keep flat order: the first wins
    # masses in sorted order, a repeat's zeroed, then put back in flat order (order is a
    # permutation, so the scatter overwrites every entry)
    sorted_mass = p_pad.gather(-1, ranked)
    sorted_mass[..., 1:].masked_fill_(ranked[..., 1:] == ranked[..., :-1], 0.0)
    mass = sorted_mass.scatter(-1, order, sorted_mass)
    px, nbm = mass[..., :k], mass[..., k:].view(b, n_par, k, -1)
    if relax.kind == "delta":
        nbm = nbm * (px > 0)[..., None]  # a draft of probability 0 gets no budget
        inside = (nbm.flatten(-2).cumsum(-1) <= relax.delta).view(nbm.shape)
    else:
        inside = nbm.cumsum(-1) <= (relax.lam - 1.0) * px[..., None]
    moved = nbm * inside  # (B, P, K, kn) moved from each neighbour onto its sibling
    c = moved.sum(-1)
    taken = px + c  # (B, P, K): what stage s removes from the parent's mass, unnormalised
    z = (1.0 - (taken.cumsum(-1) - taken)).clamp(min=_EPS)  # mass before each stage
    accept = taken / z  # <= 1 but for rounding, which a test u < accept (u < 1) does not notice
    # after every stage rejected: the drafts and the moved neighbours are gone from p
    gone = torch.cat([xs, torch.where(moved > 0, near, v).flatten(-2)], -1)
    rest = p_pad.scatter(-1, gone, 0.0)
    return accept, c / z, _parent_bonus_rows(rest, v)


def _sampled_stages(tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, tree: TreeBuffers,
                    relax: Relaxation) -> tuple[torch.Tensor, torch.Tensor, BonusRows]:
    """Stages of sampled drafts on a static tree, every parent at once.

    Parents are taken in `tree.stages.order` (most children first), so stage s runs on the
    first rows[s] of them: the parents that have a child of rank s. A relaxed parent's target
    is relaxed once, for its first proposal: t = M = E_{x~q}[r~_x] (`relaxed_mixture`); its
    children are then judged by exact recursive rejection sampling toward t, so the parent's
    output is distributed exactly as M, within TVD `shift` of p. Stage s proposes from q
    without the earlier siblings, q_s = q masked / W_s with W_s = 1 - sum_{t<s} q(x_t), whose
    normalisers are computed for every stage at once; the loop over ranks only carries the
    residual r <- norm(max(r - q_s, 0)), unnormalised: R_{s+1} = max(R_s - Z_s q / W_s, 0)
    with Z_s = sum R_s (= Z_s r_{s+1} times a positive constant), so a stage is one fused
    multiply-subtract, a clamp and a sum, and t_s(x) = R_s(x) / Z_s is divided once at the
    end. q is not masked at the earlier siblings x_t: a stage s that can be reached had x_t
    rejected, so t_t(x_t) < q_t(x_t) and R_s(x_t) is already 0, which subtracting more leaves
    0 (a certain x_t ends the parent's stages, so later ones are never read). The bonus rows
    are the unnormalised R (a race `argmax(r / E)` and the zero-mass test do not depend on
    the scale). Returns per-node acceptance probabilities (B, N+1),
    per-node shifts (B, N+1: the parent's) and a function giving the bonus rows (B, V) of the
    given parents (B,) after all their children were rejected.
    """
    stages = tree.stages
    assert stages is not None, "sampled drafts are judged on a static tree (accept_sampling checks)"
    rows0 = stages.rows[0]
    p_sorted = p[:, stages.order]  # (B, P, V) in stage order
    r, qm = p_sorted[:, :rows0], q[:, stages.order[:rows0]]
    xs = tokens[:, stages.child[:rows0]]  # (B, rows0, K); a missing child (the root's token) is never read
    q_x = qm.gather(2, xs)  # q(x_s)
    left = (1.0 - (q_x.cumsum(-1) - q_x)).clamp(min=_EPS)  # W_s: q's mass before stage s
    qs_x = q_x / left  # q_s(x_s)
    shift = None
    if relax.active:
        r, shift = relaxed_mixture(r, qm, relax)
    target_x: list[torch.Tensor] = []  # R_s(x_s)
    z: list[torch.Tensor] = []  # Z_s (s >= 1)
    last: list[torch.Tensor] = []  # the bonus rows
    for s, n in enumerate(stages.rows):
        r, qm, x = r[:, :n], qm[:, :n], xs[:, :n, s, None]
        target_x.append(r.gather(2, x).squeeze(2))
        if s == 0:  # R_0 = r sums to 1
            r = torch.addcdiv(r, qm, left[:, :n, :1], value=-1.0).clamp(min=0.0)
        else:
            r = torch.addcmul(r, qm, z[-1][:, :n] / left[:, :n, s, None], value=-1.0).clamp(min=0.0)
        if s + 1 < len(stages.rows):
            z.append(r.sum(-1, keepdim=True))
        last.append(r[:, stages.rows[s + 1] if s + 1 < len(stages.rows) else 0:])  # parents whose last child this is
    t_all = torch.cat(target_x, 1)  # (B, sum(rows)) in stage-major order
    if z:  # t_s(x_s) = R_s(x_s) / Z_s
        z_all = torch.cat([z_s[:, :n, 0] for z_s, n in zip(z, stages.rows[1:])], 1).clamp(min=_EPS)
        t_all = torch.cat([t_all[:, :rows0], t_all[:, rows0:] / z_all], 1)
    q_all = torch.cat([qs_x[:, :n, s] for s, n in enumerate(stages.rows)], 1)
    # min(1, t/q); a sample outside the proposal's support (q exhausted) is never accepted
    a = (t_all.minimum(q_all) / q_all.clamp(min=torch.finfo(q_all.dtype).tiny))[:, stages.node_slot]
    node_shift = shift[:, stages.parent_row] if shift is not None else torch.zeros_like(a)
    # bonus rows, stage order: parents with K children come from the last stage, ..., leaves keep p
    bonus_table = torch.cat(last[::-1] + [p_sorted[:, rows0:]], 1)
    return a, node_shift, _stage_bonus_rows(bonus_table, stages.position)


def _parent_bonus_rows(residual: torch.Tensor, v: int) -> BonusRows:
    """The bonus rows of the deterministic stages: residual (B, P, V+1) per parent, the padding
    token V dropped; parents are node ids, so no stage position is needed."""

    def bonus_rows(best: torch.Tensor, rows: torch.Tensor, position: torch.Tensor | None = None) -> torch.Tensor:
        return residual[rows, best, :v]

    return bonus_rows


def _stage_bonus_rows(bonus_table: torch.Tensor, stage_position: torch.Tensor) -> BonusRows:
    """The bonus rows of the sampled stages: bonus_table (B, N+1, V) holds them in stage order,
    `stage_position` (N+1,) is each node's place in it (`StageLayout.position`)."""

    def bonus_rows(best: torch.Tensor, rows: torch.Tensor, position: torch.Tensor | None = None) -> torch.Tensor:
        return bonus_table[rows, stage_position[best] if position is None else position]

    return bonus_rows


def _budget(rx: torch.Tensor, z: torch.Tensor, nbm: torch.Tensor, relax: Relaxation
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper rule's relaxation of drafts x against an unnormalised residual R of mass z.

    rx (...,) R(x); z (...,); nbm (..., k) R at x's nearest codes in order. Returns
    (c (...,) the unnormalised mass x gains: the longest prefix of nbm whose sum is within
    the budget, used (...,) bool: the nearest code fits, which is when the reference clears
    x's neighbours on a rejection). The budget is delta of the normalised residual (z delta;
    none for a draft of probability 0) or (lambda - 1) R(x).
    """
    cum = nbm.cumsum(-1)
    if relax.kind == "delta":
        assert relax.zero is not None, "the paper rule's budget needs the neighbour table"
        bound = torch.where(rx > 0, z * relax.delta, relax.zero)
    else:
        bound = rx * (relax.lam - 1.0)
    inside = cum <= bound[..., None]
    return (nbm * inside).sum(-1), inside[..., 0]


def _paper_deterministic_stages(xs: torch.Tensor, p: torch.Tensor, relax: Relaxation
                                ) -> tuple[torch.Tensor, torch.Tensor, BonusRows]:
    """Rule "paper" for deterministic drafts (the reference's dynamic-tree sampler).

    xs: (B, P, K) child tokens per parent in rank order (V = no child: mass 0, a no-op
    stage); p: (B, P, V). Stage s of every parent at once, one loop step per sibling rank:
    R (B, P, V+1) is the unnormalised residual (p with the cleared tokens zeroed), z its
    mass; child x_s is accepted with probability (R(x_s) + c_s) / z (>= 1: surely), and on
    rejection x_s and, when its relaxation was used, its k+1 nearest codes are cleared.
    Returns acceptance probabilities (B, P, K), shifts c_s / z (B, P, K) and a function
    giving the bonus rows (B, V) of the given parents (B,) after all their children were
    rejected (the last residual).
    """
    assert relax.padded is not None and relax.clear_padded is not None, "relaxed stages need the neighbour table"
    k, v = xs.size(-1), p.size(-1)
    res = F.pad(p, (0, 1))  # token V (no child) has mass 0
    # per stage: x then its nearest codes (read), and x then its k+1 nearest (cleared)
    read = torch.cat([xs[..., None], relax.padded[xs]], -1)  # (B, P, K, 1 + k)
    clear = relax.clear_padded[xs]  # (B, P, K, k + 2)
    z = res.sum(-1)
    masses, gains, totals = [], [], []
    for s in range(k):
        m = res.gather(-1, read[..., s, :])  # R(x_s), then R at its nearest codes
        c, used = _budget(m[..., 0], z, m[..., 1:], relax)
        masses.append(m[..., 0])
        gains.append(c)
        totals.append(z)
        # cleared: x_s alone, or x_s and its k+1 nearest codes (a clear row starts with x_s)
        res = res.scatter(-1, torch.where(used[..., None], clear[..., s, :], clear[..., s, :1]), 0.0)
        z = res.sum(-1)
    rx, c, z_all = torch.stack(masses, -1), torch.stack(gains, -1), torch.stack(totals, -1).clamp(min=_EPS)
    return (rx + c) / z_all, c / z_all, _parent_bonus_rows(res, v)


def _paper_sampled_stages(tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, tree: TreeBuffers,
                          relax: Relaxation) -> tuple[torch.Tensor, torch.Tensor, BonusRows]:
    """Rule "paper" for sampled drafts on a static tree (the reference's static-tree sampler).

    Parents in `tree.stages` order as in `_sampled_stages`; stage s runs on the first rows[s]
    of them. R (unnormalised residual, mass z) starts at p; the child x_s, drawn from
    q_s = q without the earlier siblings (q / W_s at x_s), is accepted with probability
    min(1, (R(x_s) + c_s) / z / q_s(x_s)); on rejection R <- max(R - z q', 0) with
    q' = q / W_s zeroed at x_s's k+1 nearest codes when its relaxation was used. q need not
    be zeroed at the earlier siblings: a rejected x_t had R(x_t) < z q_t(x_t), so the
    residual is 0 there already. A child with q_s(x_s) = 0 (the proposal exhausted) is
    skipped, as in the reference. Returns per-node acceptance probabilities (B, N+1),
    per-node shifts c_s / z (B, N+1) and the bonus-row function.
    """
    stages = tree.stages
    assert stages is not None, "sampled drafts are judged on a static tree (accept_sampling checks)"
    assert (relax.padded is not None and relax.clear_padded is not None and relax.no_code is not None
            and relax.inf is not None), "the paper rule's stages need the neighbour table"
    v = p.size(-1)
    rows0 = stages.rows[0]
    p_sorted = p[:, stages.order]  # (B, P, V) in stage order
    res = F.pad(p_sorted[:, :rows0], (0, 1))  # (B, rows0, V+1); token V: mass 0
    qm = F.pad(q[:, stages.order[:rows0]], (0, 1))
    xs = tokens[:, stages.child[:rows0]]  # (B, rows0, K); a missing child (the root's token) is never read
    clear = relax.clear_padded[xs]  # (B, rows0, K, k + 2): x, then its k+1 nearest codes
    read = clear[..., : 1 + relax.padded.size(1)]  # x, then its k nearest (a prefix of the k+1)
    q_x = qm.gather(2, xs)
    left = (1.0 - (q_x.cumsum(-1) - q_x)).clamp(min=_EPS)  # W_s: q's mass before stage s
    qs_x = q_x / left  # q_s(x_s)
    # q / W_s for every stage at once (one kernel, not one per stage); an undrawn stage
    # (q_s(x_s) = 0) changes nothing: its W_s is +inf, so its q / W_s is 0
    q_stage = qm[:, :, None] / torch.where(qs_x > 0, left, relax.inf)[..., None]  # (B, rows0, K, V+1)
    z = res.sum(-1)
    masses, gains, totals, last = [], [], [], []
    for s, n in enumerate(stages.rows):
        res, z = res[:, :n], z[:, :n]
        m = res.gather(2, read[:, :n, s])
        c, used = _budget(m[..., 0], z, m[..., 1:], relax)
        masses.append(m[..., 0])
        gains.append(c)
        totals.append(z)
        # q' = q / W_s without x_s's k+1 nearest codes when relaxed (V, a zero column, if not)
        cleared = torch.where(used[..., None], clear[:, :n, s, 1:], relax.no_code)
        res = torch.addcmul(res, q_stage[:, :n, s].scatter(2, cleared, 0.0), z[..., None], value=-1.0).clamp(min=0.0)
        z = res.sum(-1)
        last.append(res[:, stages.rows[s + 1] if s + 1 < len(stages.rows) else 0:, :v])
    # every stage's R(x_s), c_s, z_s and q_s(x_s) side by side in one tensor (one kernel, not four)
    m_all = sum(stages.rows)
    stacked = torch.cat(masses + gains + totals + [qs_x[:, :n, s] for s, n in enumerate(stages.rows)], 1)
    z_all = stacked[:, 2 * m_all: 3 * m_all].clamp(min=_EPS)
    q_all = stacked[:, 3 * m_all:]
    # (B, 2, M): R(x_s) / z_s and the shift c_s / z_s, one division
    frac = stacked[:, : 2 * m_all].view(-1, 2, m_all) / z_all[:, None]
    # min(1, t/q) with t = (R(x) + c) / z; a sample outside the proposal's support (q exhausted) is never accepted
    a = (frac[:, 0] + frac[:, 1]).minimum(q_all) / q_all.clamp(min=torch.finfo(q_all.dtype).tiny)
    bonus_table = torch.cat(last[::-1] + [p_sorted[:, rows0:]], 1)
    return a[:, stages.node_slot], frac[:, 1, stages.node_slot], _stage_bonus_rows(bonus_table, stages.position)


def deterministic_stages(relax: Relaxation) -> Callable[..., tuple[torch.Tensor, torch.Tensor, BonusRows]]:
    """The relaxed stage rule of deterministic drafts (top-k / EAGLE-2) under `relax`'s rule:
    `_paper_deterministic_stages` or `_deterministic_stages` (xs, p, relax) -> (a, shift, bonus rows)."""
    return _paper_deterministic_stages if relax.paper else _deterministic_stages


def sampled_stages(relax: Relaxation) -> Callable[..., tuple[torch.Tensor, torch.Tensor, BonusRows]]:
    """The stage rule of sampled drafts on a static tree under `relax`'s rule:
    `_paper_sampled_stages` or `_sampled_stages` (tokens, p, q, tree, relax) -> (a, shift, bonus rows)."""
    return _paper_sampled_stages if relax.paper else _sampled_stages


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
        return torch.where(q.gather(-1, x) > 0, r_c / q_c.clamp(min=_EPS), 0.0).clamp(max=1.0)

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
        a0 = torch.where(qx > 0, r.gather(-1, cand) / qx.clamp(min=_EPS), 0.0).clamp(max=1.0)
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
    w = _first_wins_walk((u < a).to(p.dtype), tree, rows, tree.walk_weights())  # a chain: no siblings
    best, count, path = w.best, w.count, w.path
    p_best = p[rows, best]
    res = (p_best - q[rows, best]).clamp(min=0.0) * (child[best] >= 0)[:, None]
    r = torch.where(res.sum(-1, keepdim=True) > 0, res, p_best)
    bonus = race(r, bonus_u)
    mass = _path_sum(bound_par[:, tree.parent], w) + bound_par[rows, best]
    return Accepted(path, count, bonus, mass, w.commit)


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
