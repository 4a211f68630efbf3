"""Relaxed acceptance's math (LANTERN / LANTERN++): the relaxation settings, the relaxed target
of a draft, the relaxed mixture of a sampled draft, and the stage functions that judge every
parent's children at once under the paper's or the bounded rule (acceptance.py applies them).

Relaxation. For draft x and the current target r, the proximity set
is x plus the longest prefix n_1..n_j of x's nearest codebook neighbours whose cumulative
target mass c_j = r(n_1)+...+r(n_j) stays within the bound:
    LANTERN   (additive):        c_j <= delta_remaining      (delta for the first sibling)
    LANTERN++ (multiplicative):  c_j <= (lambda - 1) * r(x), i.e. r~(x) <= lambda * r(x)
The relaxed target r~ moves that mass onto x: r~(x) = r(x) + c_j, r~(n_i) = 0 for i <= j.
TVD(r, r~) = c_j exactly. A draft the target gives probability 0 is not relaxed (its additive
budget is 0 too; the multiplicative bound already is), so no rule ever moves mass onto, or
returns, a token of target probability 0.

COOL-SD (arXiv 2601.09212, "annealed relaxation"; no code released): a draft x at depth d
(the root's children are depth 1) is accepted with probability min(1, w_d t(x) / q(x)), t the
stage's target, and a rejection samples from G* = norm([t - min(q, w_d t)]_+), the residual that
minimises the paper's TV bound (the exact residual norm([t - q]_+) wherever w_d >= 1). The
schedule w_d = delta exp(-nu d - mu) relaxes early positions more than late ones. Read from the
paper (through secondary notes: its body was not reachable here): the acceptance, G*, the
schedule's form, nu = 0.7, delta 1.1 and 2. Chosen here, where it is silent: mu (unset: mu =
log(mean over d = 1..L of exp(-nu d)), so delta is the mean of w_d over the tree's L levels;
`anneal_weights`), the tree case (a node's depth is d; siblings are stages of recursive
rejection sampling, each toward the previous stage's G*), and greedy decoding (a draft passes
where w_d p(x) >= max p, only for w_d > 1). Any chain of such stages gives an output L <= w p
pointwise, hence TV(L, p) <= 1 - 1/w at a node (`law.nominal_bound`); w <= 1 is lossless.

Shapes as in acceptance.py: p (B, N+1, V), tokens (B, N+1), a tree's TreeBuffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

import torch.nn.functional as F

from runtime.core.tree import TreeBuffers
from runtime.config.method_options import RELAX_RULES, RESIDUALS, RelaxKind

EPS = 1e-12  # guards divisions by a probability mass


class BonusRows(Protocol):
    """bonus_rows(best (B,), rows (B,), position (B,) or None) -> (B, V): the residual after every
    child of node `best` was rejected; `position`, when given, is best's place in the stage order
    (`Walk.stage_position`), which the stage functions otherwise look up."""

    def __call__(self, best: torch.Tensor, rows: torch.Tensor, position: torch.Tensor | None = None
                 ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Relaxation:
    """kind: "none" (exact), "delta" (LANTERN, additive), "lambda" (LANTERN++) or "anneal" (COOL-SD).

    neighbours: (V, k) long nearest-codebook table (see proximity.py); None when exact.
    rule: "paper" (what the reference LANTERN code does, see `accept_sampling`) or "bounded"
    (each node's output within the stated TVD bound of the target).
    zero_neighbours: (V, k+1) the table the paper rule clears on a relaxed rejection (the
    reference clears x's k+1 nearest codes); None: `neighbours` itself.
    residual: "rule" (the rule's own) or "tv-optimal" (the paper rule clears nothing: G*).
    weights: COOL-SD's (MAX_TREE_DEPTH + 2,) w_d by depth d (`anneal_weights`; 1 at depth 0 and
    past the tree), on the decoder's device; None for the other kinds.
    """

    kind: RelaxKind = RelaxKind.NONE
    delta: float = 0.0
    lam: float = 1.0
    neighbours: torch.Tensor | None = None
    rule: str = "paper"
    zero_neighbours: torch.Tensor | None = None
    residual: str = "rule"
    weights: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        if self.kind == RelaxKind.ANNEAL:
            return self.weights_differ
        return (self.kind == RelaxKind.DELTA and self.delta > 0) or (self.kind == RelaxKind.LAMBDA and self.lam > 1)

    @property
    def paper(self) -> bool:
        """The reference LANTERN code's rule is in effect (LANTERN's relaxation on, rule "paper")."""
        return self.active and self.rule == "paper" and self.kind != RelaxKind.ANNEAL

    @property
    def anneal(self) -> bool:
        """COOL-SD's annealed acceptance is in effect."""
        return self.active and self.kind == RelaxKind.ANNEAL

    @property
    def clears(self) -> bool:
        """The paper rule clears a relaxed rejection's nearest codes (not with the TV-optimal residual)."""
        return self.residual == "rule"

    # (V+1, k): `neighbours` plus a row for the padding token V whose neighbours are all V
    # (a missing child); built with the Relaxation, so a captured step reads a fixed buffer.
    # clear_padded (V+1, k+2): row x = x itself, then `zero_neighbours`' row (what the paper
    # rule clears when x is rejected), padded the same way.
    padded: torch.Tensor | None = field(init=False, default=None, repr=False)
    clear_padded: torch.Tensor | None = field(init=False, default=None, repr=False)
    # 0-d constants on the table's device: the padding token V, 0.0 and +inf, for `torch.where` in
    # the paper rule's stage loops (a Python scalar there costs a scalar_tensor kernel per call)
    no_code: torch.Tensor | None = field(init=False, default=None, repr=False)
    # COOL-SD: some w_d is not 1 (read once here: a captured step may not read a tensor's value)
    weights_differ: bool = field(init=False, default=False, repr=False)
    zero: torch.Tensor | None = field(init=False, default=None, repr=False)
    inf: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.rule not in RELAX_RULES:
            raise ValueError(f"relaxation rule must be one of {', '.join(RELAX_RULES)}, got {self.rule!r}")
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {', '.join(RESIDUALS)}, got {self.residual!r}")
        if self.weights is not None:
            object.__setattr__(self, "weights_differ", bool((self.weights != 1.0).any()))
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



def anneal_weights(delta: float, nu: float, mu: float | None, levels: int, size: int) -> list[float]:
    """COOL-SD's w_d = delta exp(-nu d - mu) for d = 0 .. size - 1, 1 outside 1..`levels` (the
    tree's depth L: no node is judged there). mu None: log(mean over d = 1..L of exp(-nu d)), so
    the mean of w_1..w_L is delta (our reading of the paper's undefined mu)."""
    levels = max(1, min(levels, size - 1))
    if mu is None:
        mu = math.log(sum(math.exp(-nu * d) for d in range(1, levels + 1)) / levels)
    return [delta * math.exp(-nu * d - mu) if 1 <= d <= levels else 1.0 for d in range(size)]


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
    if relax.kind == RelaxKind.DELTA:
        bound = relax.delta * (rx > 0)
    else:
        bound = (relax.lam - 1.0) * rx
    return mass.cumsum(-1) <= bound[..., None]  # a prefix, since masses are >= 0


def proximity_mass(mass: torch.Tensor, rx: torch.Tensor, relax: Relaxation) -> torch.Tensor:
    """(...): the mass c that `relaxed_target` moves onto x (the proximity set's, `_proximity_set`)."""
    return (mass * _proximity_set(mass, rx, relax)).sum(-1)



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
    if relax.kind == RelaxKind.DELTA:
        bound = relax.delta * (r_cand > 0)
    else:
        bound = (relax.lam - 1.0) * r_cand
    # (..., m, k): q(x) times the mass moved from neighbour j onto x
    moved = mass * (mass.cumsum(-1) <= bound[..., None]) * q_cand[..., None]
    gained = moved.sum(-1)  # (..., m): q(x) c_x
    mix = r.scatter_add(-1, cand, gained).scatter_add(-1, nb_flat, moved.neg().flatten(-2))
    return mix, gained.sum(-1)


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
    if relax.kind == RelaxKind.DELTA:
        nbm = nbm * (px > 0)[..., None]  # a draft of probability 0 gets no budget
        inside = (nbm.flatten(-2).cumsum(-1) <= relax.delta).view(nbm.shape)
    else:
        inside = nbm.cumsum(-1) <= (relax.lam - 1.0) * px[..., None]
    moved = nbm * inside  # (B, P, K, kn) moved from each neighbour onto its sibling
    c = moved.sum(-1)
    taken = px + c  # (B, P, K): what stage s removes from the parent's mass, unnormalised
    z = (1.0 - (taken.cumsum(-1) - taken)).clamp(min=EPS)  # mass before each stage
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
    left = (1.0 - (q_x.cumsum(-1) - q_x)).clamp(min=EPS)  # W_s: q's mass before stage s
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
        z_all = torch.cat([z_s[:, :n, 0] for z_s, n in zip(z, stages.rows[1:])], 1).clamp(min=EPS)
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
    if relax.kind == RelaxKind.DELTA:
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
        # cleared: x_s alone, or x_s and its k+1 nearest codes (a clear row starts with x_s); the
        # TV-optimal residual clears x_s alone
        gone = torch.where(used[..., None], clear[..., s, :], clear[..., s, :1]) if relax.clears else clear[..., s, :1]
        res = res.scatter(-1, gone, 0.0)
        z = res.sum(-1)
    rx, c, z_all = torch.stack(masses, -1), torch.stack(gains, -1), torch.stack(totals, -1).clamp(min=EPS)
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
    left = (1.0 - (q_x.cumsum(-1) - q_x)).clamp(min=EPS)  # W_s: q's mass before stage s
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
        q_s = q_stage[:, :n, s]
        if relax.clears:
            q_s = q_s.scatter(2, torch.where(used[..., None], clear[:, :n, s, 1:], relax.no_code), 0.0)
        res = torch.addcmul(res, q_s, z[..., None], value=-1.0).clamp(min=0.0)
        z = res.sum(-1)
        last.append(res[:, stages.rows[s + 1] if s + 1 < len(stages.rows) else 0:, :v])
    # every stage's R(x_s), c_s, z_s and q_s(x_s) side by side in one tensor (one kernel, not four)
    m_all = sum(stages.rows)
    stacked = torch.cat(masses + gains + totals + [qs_x[:, :n, s] for s, n in enumerate(stages.rows)], 1)
    z_all = stacked[:, 2 * m_all: 3 * m_all].clamp(min=EPS)
    q_all = stacked[:, 3 * m_all:]
    # (B, 2, M): R(x_s) / z_s and the shift c_s / z_s, one division
    frac = stacked[:, : 2 * m_all].view(-1, 2, m_all) / z_all[:, None]
    # min(1, t/q) with t = (R(x) + c) / z; a sample outside the proposal's support (q exhausted) is never accepted
    a = (frac[:, 0] + frac[:, 1]).minimum(q_all) / q_all.clamp(min=torch.finfo(q_all.dtype).tiny)
    bonus_table = torch.cat(last[::-1] + [p_sorted[:, rows0:]], 1)
    return a[:, stages.node_slot], frac[:, 1, stages.node_slot], _stage_bonus_rows(bonus_table, stages.position)


def _annealed_deterministic_stages(xs: torch.Tensor, p: torch.Tensor, relax: Relaxation,
                                   depth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, BonusRows]:
    """COOL-SD for deterministic drafts, every parent at once (closed form, no loop over ranks).

    xs: (B, P, K) child tokens per parent in rank order (V = no child); p: (B, P, V); depth:
    (B, P) each parent's depth (None: 0), its children judged with w = w_{depth + 1}. Siblings
    are distinct, so stage s sees R(x_s) = p(x_s) on the residual's mass z_s: it accepts with
    min(1, w p(x_s) / z_s), and G* leaves (1 - min(w, 1)) p(x_s) at x_s on a rejection (none
    where w >= 1), so z_{s+1} = z_s - min(w, 1) p(x_s). The shift of a stage is its excess
    [min(1, w t) - t]_+, t = p(x_s) / z_s. Returns (a, shift) (B, P, K) and the bonus rows.
    """
    assert relax.weights is not None, "COOL-SD's stages need its weights"
    v = p.size(-1)
    at = depth + 1 if depth is not None else torch.ones(p.shape[:2], dtype=torch.long, device=p.device)
    w = relax.weights[at.clamp(max=relax.weights.numel() - 1)][..., None]  # (B, P, 1)
    p_pad = F.pad(p, (0, 1))
    px = p_pad.gather(-1, xs)
    removed = px * w.clamp(max=1.0)
    z = (1.0 - (removed.cumsum(-1) - removed)).clamp(min=EPS)
    t = px / z
    accept = (w * t).clamp(max=1.0)
    rest = p_pad.scatter(-1, xs, px - removed)
    return accept, (accept - t).clamp(min=0.0), _parent_bonus_rows(rest, v)


def _annealed_sampled_stages(tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, tree: TreeBuffers,
                             relax: Relaxation) -> tuple[torch.Tensor, torch.Tensor, BonusRows]:
    """COOL-SD for sampled drafts on a static tree, parents in `tree.stages` order as in
    `_sampled_stages`. R (unnormalised residual, mass Z) starts at p; stage s proposes from
    q_s = q without the earlier siblings, divided by W_s, and accepts x_s with probability
    min(1, w t_s(x_s) / q_s(x_s)), t_s = R_s / Z_s, w = w_d of the parent's children; a rejection
    leaves G*: R_{s+1} = [R_s - min(Z_s q_s, w R_s)]_+. Unlike the exact rule, q is masked at the
    earlier siblings: with w < 1 a rejected draft keeps mass in R. Returns per-node acceptance
    probabilities and shifts (the stage's excess sum [min(q_s, w t_s) - t_s]_+) (B, N+1) and the
    bonus-row function.
    """
    stages = tree.stages
    assert stages is not None and relax.weights is not None, "COOL-SD's sampled stages need a static tree"
    rows0 = stages.rows[0]
    p_sorted = p[:, stages.order]
    r, qm = p_sorted[:, :rows0], q[:, stages.order[:rows0]]
    xs = tokens[:, stages.child[:rows0]]  # (B, rows0, K)
    q_x = qm.gather(2, xs)
    left = (1.0 - (q_x.cumsum(-1) - q_x)).clamp(min=EPS)  # W_s
    qs_x = q_x / left
    w = relax.weights[(tree.depth[stages.order[:rows0]] + 1).clamp(max=relax.weights.numel() - 1)][None, :, None]
    z = r.sum(-1, keepdim=True)
    target_x, totals, excess, last = [], [], [], []
    for s, n in enumerate(stages.rows):
        r, qm, z, x = r[:, :n], qm[:, :n], z[:, :n], xs[:, :n, s, None]
        target_x.append(r.gather(2, x).squeeze(2))
        totals.append(z[..., 0])
        taken = torch.minimum(qm * (z / left[:, :n, s, None]), w[:, :n] * r)  # Z_s min(q_s, w t_s)
        excess.append((taken - r).clamp(min=0.0).sum(-1))
        r = (r - taken).clamp(min=0.0)
        qm = qm.scatter(2, x, 0.0)
        z = r.sum(-1, keepdim=True)
        last.append(r[:, stages.rows[s + 1] if s + 1 < len(stages.rows) else 0:])
    z_all = torch.cat(totals, 1).clamp(min=EPS)
    t_all = torch.cat(target_x, 1) / z_all
    w_all = torch.cat([w[0, :n, 0].expand(p.size(0), n) for n in stages.rows], 1)
    q_all = torch.cat([qs_x[:, :n, s] for s, n in enumerate(stages.rows)], 1)
    # min(1, w t / q); a sample outside the proposal's support (q exhausted) is never accepted
    a = (w_all * t_all).minimum(q_all) / q_all.clamp(min=torch.finfo(q_all.dtype).tiny)
    shift = torch.cat(excess, 1) / z_all
    bonus_table = torch.cat(last[::-1] + [p_sorted[:, rows0:]], 1)
    return a[:, stages.node_slot], shift[:, stages.node_slot], _stage_bonus_rows(bonus_table, stages.position)


def deterministic_stages(relax: Relaxation) -> Callable[..., tuple[torch.Tensor, torch.Tensor, BonusRows]]:
    """The relaxed stage rule of deterministic drafts (top-k / EAGLE-2) under `relax`'s rule:
    `_annealed_deterministic_stages` (COOL-SD), `_paper_deterministic_stages` or
    `_deterministic_stages` (xs, p, relax, depth=None) -> (a, shift, bonus rows); `depth` (B, P),
    each parent's, is read by COOL-SD's only."""
    if relax.anneal:
        return _annealed_deterministic_stages
    rule = _paper_deterministic_stages if relax.paper else _deterministic_stages

    def stages(xs: torch.Tensor, p: torch.Tensor, relax: Relaxation, depth: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, BonusRows]:
        return rule(xs, p, relax)

    return stages


def sampled_stages(relax: Relaxation) -> Callable[..., tuple[torch.Tensor, torch.Tensor, BonusRows]]:
    """The stage rule of sampled drafts on a static tree under `relax`'s rule:
    `_annealed_sampled_stages` (COOL-SD), `_paper_sampled_stages` or `_sampled_stages`
    (tokens, p, q, tree, relax) -> (a, shift, bonus rows)."""
    if relax.anneal:
        return _annealed_sampled_stages
    return _paper_sampled_stages if relax.paper else _sampled_stages
