"""Drafting policies: what fills the tree the shared decoding loop (decoder.py) verifies.

A policy owns the tree shape and whatever state its drafts come from; the loop owns the rest
(target cache, p, acceptance, output). The policy is built from the loop's `DecodeConfig`
(it builds its tree), then bound to a `DraftView` of the loop's buffers once they exist
(`bind`: the policy allocates its own state). Per iteration the loop calls

    draft()                 fill `view.tokens[:, 1:]` (node 0 is the root the last accept
                            set), `view.q` (B, N+1, V) where the drafts were sampled (q[:, i] =
                            the distribution node i's children were drawn from) and, for
                            dynamic trees, the tree buffers in place (one tree per image)
    committed(path, n, block)
                            inside the accept step, after the target cache was compacted:
                            path (B, D+1) accepted nodes, n (B,) how many (root included; 0
                            for an image that is done), block (B, D+1) the new tokens after
                            the root (bonus at n-1)

and verify and accept read what the draft wrote through `proposal(depth)`, a `DraftProposal`
per tree prefix the policy may verify (built once: its tensors are the buffers the draft fills).

Every tensor of the loop has the batch of B images first; model rows are `config.rows`
(`config.expand_rows` maps per-image tensors onto them).

Both run on the device with fixed shapes and no host reads, so the loop captures them with
its other steps. Policies:

    none       AR: the root alone
    static     a drafter head over a static tree (sd chains, LANTERN++ trees)
    dynamic    a drafter head over an EAGLE-2 dynamic tree (eagle2, lantern)
    jacobi     no drafter: the target's own predictions over a window of future positions
               (sjd; see jacobi.py)

`sampled_q` says whether acceptance must see `q` (drafts sampled from it) or treats the
drafts as deterministic (top-k / EAGLE-2, `q` None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from runtime.core.rng import neg_exponential_from_uniform
from runtime.core.state import DraftProposal, LookaheadRows
from runtime.core.tree import (StaticTree, TreeBuffers, buffers_from_parents, load_tree, static_buffers,
                               tree_constants)

if TYPE_CHECKING:
    from runtime.core.state import DecodeConfig, DraftView
    from runtime.models.target import DrafterModel

_SMALLEST_NORMAL = 1.1754944e-38
# Floor for log q in EAGLE-2 scores: keeps filtered-out tokens finite and parent > child.
_LOG_FLOOR = -80.0


# ddd: the score of a stopped image's candidates, below any real one and finite (so a score's
# next float below, `_below_negative`, stays a number)
_STOPPED = -1e38


def _below_negative(score: torch.Tensor) -> torch.Tensor:
    """The next float below each score, for scores that are negative normal floats (EAGLE-2's
    scores below the root: `child_scores` of the root is one): one integer add on the bits,
    which for a negative float steps away from zero."""
    return (score.view(torch.int32) + 1).view(torch.float32)


def child_scores(parent: torch.Tensor, logq: torch.Tensor, neg_inf: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE-2 score of children: parent score + log q, strictly below the parent's score.

    parent broadcasts against logq. A child with log q == 0 (or one whose log q is lost in
    float32 rounding at large |score|) would tie its parent; it takes the next float below
    instead, so in any top-n selection a kept child implies a kept parent. neg_inf: a 0-d
    -inf on parent's device (the drafting policy keeps one, so a step makes no constant).
    """
    if neg_inf is None:
        neg_inf = torch.full((), float("-inf"), device=parent.device)
    # Next to 0 the next float is denormal, which a flush-to-zero CPU mode (set by compiled
    # kernels) turns back into 0: stepping down from parent - (smallest normal) stays normal
    # there, and equals stepping down from parent wherever |parent| > 2^-102.
    below = torch.nextafter(parent - _SMALLEST_NORMAL, neg_inf)
    return torch.minimum(parent + logq, below)


class DraftPolicy:
    """Base: the AR policy (root only, nothing drafted). Subclasses override the hooks."""

    kind = "none"
    sampled_q = False  # acceptance sees `view.q` (drafts were sampled from it)
    needs_q = False  # the loop allocates `q` (N+1, V)
    reads_p = False  # the policy reads the target's `p` (otherwise only acceptance does)
    # Nodes verified after the tree in the same forward that acceptance never judges (pjd's
    # lookahead rows): a policy with extra > 0 hands them over as its proposals' `lookahead`.
    extra = 0
    view: DraftView  # set by `bind`

    def __init__(self, config: DecodeConfig) -> None:
        self.config = config
        self.tree = self.build_tree(config.device)

    def build_tree(self, device: torch.device) -> TreeBuffers:
        z = torch.zeros(1, dtype=torch.long, device=device)
        return TreeBuffers(parent=z, depth=z.clone(), rank=z.clone(),
                           ancestor_mask=torch.ones(1, 1, dtype=torch.bool, device=device),
                           children=torch.full((1, 1), -1, dtype=torch.long, device=device),
                           path_table=torch.zeros(1, 1, dtype=torch.long, device=device),
                           earlier_sibling=torch.zeros(1, 1, dtype=torch.bool, device=device),
                           max_depth=0, max_children=1)

    @property
    def q(self) -> torch.Tensor:
        """`view.q`, which the loop allocates for a policy that `needs_q` (read by those only)."""
        q = self.view.q
        assert q is not None, f"{type(self).__name__} reads q, which the loop allocates only with needs_q"
        return q

    def bind(self, view: DraftView, committed: int) -> None:
        """Take the loop's buffers (`view`, what the policy writes and reads) and allocate the
        policy's own state; `committed` = the target cache's rows for committed tokens."""
        self.view = view

    def proposal(self, depth: int) -> DraftProposal:
        """What the draft hands to verify and accept when the tree is verified down to `depth`
        (one of `verified_depths()`): views of the buffers it fills, the same every iteration."""
        tree = self.prefix_tree(depth)
        view = self.view
        return DraftProposal(depth=depth, tree=tree, tokens=view.tokens[:, : tree.size],
                             q=self.q[:, : tree.size] if self.sampled_q else None, lookahead=self.lookahead())

    def lookahead(self) -> LookaheadRows | None:
        """The nodes verified after the tree (`extra` of them), or None."""
        return None

    @property
    def most_parents(self) -> int:
        """The most nodes with children one of its trees can have (the rows of p that judge drafts)."""
        stages = self.tree.stages
        return stages.rows[0] if stages is not None else self.tree.size

    def start(self, i: int, rows: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor,
              cond_mask: torch.Tensor | None) -> None:
        """Image slot i starts a new image (between steps; the other slots keep their state):
        rows its model rows, hidden (len(rows), cls, dim) the target's prefill hidden states,
        first (1,) its first token, cond_mask (len(rows), cls) or None."""

    def draft(self) -> None:
        """Fill the tree for this iteration (see the module docstring)."""

    def committed(self, path: torch.Tensor, n: torch.Tensor, block: torch.Tensor) -> None:
        """Update the policy's state after acceptance (inside the accept step)."""

    # -- drafts of a depth decided per iteration (ddd, --dynamic-depth) -------------------------
    # The draft runs as `segments()`, each captured on its own; after segment i in `checks`
    # the host reads `go_on` (B,) bool and stops drafting when no image wants more. Then
    # `finish()` (if any) runs, and `verified_depth(segments run)` says which prefix of the
    # tree the loop verifies (None: the whole tree).
    checks: frozenset[int] = frozenset()

    @property
    def go_on(self) -> torch.Tensor:
        raise NotImplementedError

    def segments(self) -> list[Callable[[], None]]:
        return [self.draft]

    def finish(self) -> Callable[[], None] | None:
        return None

    def verified_depths(self) -> tuple[int, ...]:
        """The tree prefixes (by depth) the loop may verify: one captured verify/accept each."""
        return (self.tree.max_depth,)

    def verified_depth(self, segments_run: int) -> int:
        return self.tree.max_depth

    def prefix_tree(self, depth: int) -> TreeBuffers:
        """The tree cut to its depths <= depth (one of `verified_depths()`)."""
        return self.tree

    def drafted_levels(self) -> torch.Tensor | None:
        """(B,) long tree levels drafted this iteration when it varies per image, else None."""
        return None

    def accept_uniforms(self) -> torch.Tensor | None:
        """(B, N+1+V) uniforms the draft drew for the sampled acceptance of this iteration
        (what `accept_sampling` would draw next), or None: acceptance draws its own."""
        return None

    def depth_cap(self) -> torch.Tensor | None:
        """(B,) long: the deepest level each image verifies when that is its own choice and may
        be shallower than the prefix its batch verifies (`accept_sampling`'s cap), else None."""
        return None


class DrafterPolicy(DraftPolicy):
    """Shared by the drafter-head policies: the drafter cache and the pending block.

    The drafter sees each accepted token paired with the target hidden state that predicted
    it. After an accept, the block of accepted tokens (root first: the view's `block`, `accepted`
    of them) and their target hidden states (`pend_hidden`) wait until the next draft runs them
    through the drafter (level 0). A new image's pending block is its first token.
    """

    needs_q = True

    def __init__(self, config: DecodeConfig) -> None:
        if config.drafter is None:
            raise ValueError(f"{type(self).__name__} drafts with a drafter model; none was given")
        self.drafter: DrafterModel = config.drafter
        super().__init__(config)

    def draft_slots(self) -> int:
        """Drafter cache slots written per iteration beyond the pending block."""
        return self.tree.size

    def bind(self, view: DraftView, committed: int) -> None:
        super().bind(view, committed)
        cfg = self.config
        dev, rows, m = cfg.device, cfg.rows, self.tree.max_depth + 1
        drafter = self.drafter
        self.dcache = drafter.new_cache(rows, committed + self.draft_slots(), dev)
        # condition positions 0..cls-2 of one image, run before its slot takes them
        self.start_dcache = drafter.new_cache(rows // cfg.batch, cfg.cls - 1, dev) if cfg.cls > 1 else None
        self.draft_hidden = torch.zeros(rows, self.tree.size, drafter.config.hidden_size, device=dev, dtype=cfg.dtype)
        self.pend_hidden = torch.zeros(rows, m, cfg.target.config.dim, device=dev, dtype=cfg.dtype)
        # the pending block's causal mask, additive once (not per draft)
        self.causal_m = self.dcache.additive(torch.ones(m, m, dtype=torch.bool, device=dev).tril())

    def start(self, i: int, rows: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor,
              cond_mask: torch.Tensor | None) -> None:
        cfg = self.config
        # the condition positions the drafter attends to are the ones it was trained with:
        # padded caption positions too ("all", LANTERN's and `runtime train drafter`'s), or not
        if getattr(self.drafter.config, "condition_context", "all") == "all":
            cond_mask = None
        if self.start_dcache is not None:  # condition positions 0..cls-2 pair token 0 with the target hidden
            c1, tmp = cfg.cls - 1, self.start_dcache
            tmp.reset()
            if cond_mask is not None:
                tmp.mark_prefix(cond_mask[:, :c1])
            zeros = torch.zeros(rows.numel(), c1, dtype=torch.long, device=cfg.device)
            self.drafter.forward_cached(zeros, hidden[:, :c1], torch.arange(c1, device=cfg.device),
                                        torch.ones(c1, c1, dtype=torch.bool, device=cfg.device).tril(), tmp)
            tmp.advance(c1)
            self.dcache.load_rows(rows, tmp)
        else:
            self.dcache.reset_rows(rows)
        if cond_mask is not None:
            self.dcache.mark_prefix(cond_mask, rows)
        self.pend_hidden[rows] = 0
        self.pend_hidden[rows, 0] = hidden[:, -1]

    def committed(self, path: torch.Tensor, n: torch.Tensor, block: torch.Tensor) -> None:
        # the pending block is the view's block / accepted already (0 for a done image: its
        # drafter cache stops advancing); the hidden states that predicted them:
        cfg, view = self.config, self.view
        rows_path = cfg.expand_rows(path)
        torch.gather(view.hidden, 1, rows_path[..., None].expand(-1, -1, view.hidden.size(-1)), out=self.pend_hidden)

    def _level0(self) -> torch.Tensor:
        """Drafter over the last accepted block; returns the root's drafter output (rows, dim)."""
        cfg, view = self.config, self.view
        positions = self.dcache.length[:, None] + view.block_ids
        out = self.drafter.forward_cached(cfg.expand_rows(view.block), self.pend_hidden, positions,
                                          self.causal_m, self.dcache)
        count = cfg.expand_rows(view.accepted)
        last = (count - 1).clamp(min=0)[:, None, None].expand(-1, 1, out.size(-1))
        root = out.gather(1, last).squeeze(1)
        self.dcache.advance(count)
        return root

    def _dist(self, out: torch.Tensor, depth: torch.Tensor | int, log: bool = False) -> torch.Tensor:
        """The drafts' distribution (its log with `log`) after drafter outputs `out` (rows, T, dim);
        with `ranks_q`, the guided logits instead (`DecodeConfig.dist(rank=True)`). Guidance mixes
        the outputs before the head (`DecodeConfig.dist(head=)`): B rows of head, not 2B."""
        target = self.config.target
        if not getattr(target, "linear_head", True):  # a nonlinear head (Janus): every row through it, then mix
            return self.view.dist(target.logits(out), depth, draft=True, log=log, rank=self.ranks_q)
        return self.view.dist(out, depth, draft=True, log=log, rank=self.ranks_q, head=target.logits)

    @property
    def ranks_q(self) -> bool:
        """q holds only an order (greedy drafts whose q nothing but the top-k reads)."""
        return False

    def _root_level(self) -> torch.Tensor:
        """Level 0: the drafter over the accepted block and the root's q (its children's
        proposal); returns the root's drafter output (rows, dim)."""
        root = self._level0()
        self.q[:, 0] = self._dist(root[:, None], 0)[:, 0]
        return root


class StaticTreePolicy(DrafterPolicy):
    """A static tree (sd chains, LANTERN++ presets): one drafter forward per level.

    Greedy: each node's children are its parent's top-k drafter tokens. Sampling: k samples
    without replacement (Gumbel-top-k) from the parent's q, so acceptance sees q.
    """

    kind = "static"

    @property
    def sampled_q(self) -> bool:  # type: ignore[override]
        return not self.config.params.greedy

    @property
    def ranks_q(self) -> bool:
        # greedy, one step: q is read by `_pick`'s top-k alone (the reference's static-tree
        # drafter ranks logits too); --dynamic-depth reads path probabilities from it
        return self.config.params.greedy and self.config.spec.dynamic_depth is None

    def build_tree(self, device: torch.device) -> TreeBuffers:
        self.static = load_tree(self.config.spec.tree_spec)
        tree = static_buffers(self.static).to(device)
        self.levels = [tree.level(d) for d in range(1, tree.max_depth + 1)]
        # Known on the host, so a level whose nodes are "every parent's ranks 0..r-1" (chains,
        # most of a preset's levels) picks its tokens with a view instead of an index op.
        par, rank = tree.parent.tolist(), tree.rank.tolist()
        starts = [0] + [start for start, _ in self.levels]
        self.level_grid: list[int | None] = []
        for d, (a, b) in enumerate(self.levels):
            n_par = (1 if d == 0 else self.levels[d - 1][1] - self.levels[d - 1][0])
            r = (b - a) // n_par
            grid = [(starts[d] + p, k) for p in range(n_par) for k in range(r)]
            self.level_grid.append(r if r * n_par == b - a and list(zip(par[a:b], rank[a:b])) == grid else None)
        # the rows each level runs through the drafter: a one-step draft's spans of nodes with
        # children (True), --dynamic-depth's segments' whole levels (False)
        self.forwarded = {one: _forwarded_nodes(self.levels, par, device, whole=not one) for one in (True, False)}
        # per level: each node's parent as a position among the previous level's forwarded rows
        self.pick_parent = {one: [tree.parent[a:b] - ([0] + [f.nodes.start for f in fwd])[d]
                                  for d, (a, b) in enumerate(self.levels)] for one, fwd in self.forwarded.items()}
        # drafted nodes over drafted slots (`tree_mask`: additive, made in `bind`)
        self.tree_seen = tree.ancestor_mask[1:, 1:].contiguous()
        self.level_offsets = torch.arange(tree.max_depth, device=device)
        return tree

    def draft(self) -> None:
        """Every level in one step; the drafter outputs of a level are its children's parent
        hidden states, kept in locals (the buffer serves the per-level segments of
        --dynamic-depth)."""
        root = self._root_level()
        noise = None if self.config.params.greedy else self._noise()
        ctx, prev = self._tree_context(), root[:, None]
        for d in range(1, self.tree.max_depth + 1):
            self._pick(d, noise, one_step=True)
            if d < self.tree.max_depth:
                prev = self._forward(d, ctx, prev)

    def _tree_context(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The drafter's RoPE rows (rows, D, ...) of every depth, and the cache slots (rows, N)
        and additive mask (rows, 1, N, capacity) of every drafted node, built once per draft:
        the drafter cache's length does not move while the tree is drafted, so each level's
        context is a slice of these (node i sits at slot length + i - 1, depth d at position
        length - 1 + d)."""
        dc = self.dcache
        return self.drafter.block_context(dc.length[:, None] + self.level_offsets, self.tree_mask, dc)

    def _noise(self) -> torch.Tensor:
        """Sampled drafts: the exponential noise E of every level in one draw, as -E
        (`neg_exponential_from_uniform`; rows = nodes with children-to-be, i.e. all nodes
        above the deepest level), one RNG call per step.

        Drafted in one step (no --dynamic-depth), the same draw also takes the acceptance's
        uniforms (`accept_uniforms`): the stream's counter runs on from the drafts' numbers
        to the acceptance's, so one draw of both lengths gives each the numbers it would
        draw alone, in one RNG call per iteration instead of two."""
        cfg, view, parents = self.config, self.view, self.levels[-1][0]
        if self.draws is None:
            return neg_exponential_from_uniform(view.rng.uniform(cfg.batch, parents, cfg.vocab))
        view.rng.uniform(*self.draws.shape, out=self.draws)
        return neg_exponential_from_uniform(self.draws[:, : parents * cfg.vocab].view(cfg.batch, parents, cfg.vocab))

    def accept_uniforms(self) -> torch.Tensor | None:
        cfg, view = self.config, self.view
        if self.draws is not None:
            return self.draws[:, self.levels[-1][0] * cfg.vocab:]
        if cfg.spec.dynamic_depth is not None and not cfg.params.greedy:
            # drawn for the whole tree whatever prefix is verified, so an image's numbers do not
            # depend on how deep its batch-mates had the tree verified
            return view.rng.uniform(cfg.batch, self.tree.size + cfg.vocab)
        return None

    def depth_cap(self) -> torch.Tensor | None:
        return self.cut if self.config.spec.dynamic_depth is not None else None

    def drafted_levels(self) -> torch.Tensor | None:
        return self.depth_cap()  # an image's drafted levels are its own cut

    def _pick(self, d: int, noise: torch.Tensor | None, one_step: bool) -> None:
        """Level d's tokens: each parent's top-k (greedy) or k samples without replacement, from
        the q of the previous level's forwarded rows (`forwarded[one_step]`)."""
        view, tree = self.view, self.tree
        start, end = self.levels[d - 1]
        parents = slice(0, 1) if d == 1 else self.forwarded[one_step][d - 2].nodes
        parent_start, parent_end = parents.start, parents.stop
        q = self.q[:, parent_start:parent_end]
        k = self.level_grid[d - 1] or tree.max_children
        if noise is None:
            cand = torch.topk(q, k, dim=-1).indices  # (B, parents, k)
        else:  # Gumbel-top-k as an exponential race: q / E orders as log q - log E; noise is -E, so the smallest
            cand = torch.topk(q / noise[:, parent_start:parent_end], k, dim=-1, largest=False).indices
        if self.level_grid[d - 1] is not None:
            view.tokens[:, start:end].view(cand.shape).copy_(cand)
        else:
            view.tokens[:, start:end] = cand[:, self.pick_parent[one_step][d - 1], tree.rank[start:end]]

    def _forward(self, d: int, ctx: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 prev: torch.Tensor | None = None) -> torch.Tensor:
        """Level d's forwarded nodes (`forwarded[one step]`) through the drafter: their q (the
        next level's proposals); returns their drafter outputs (rows, width, dim). `ctx`:
        `_tree_context()` (built here when a level runs as its own segment); `prev`: the
        forwarded outputs of level d - 1 (one step), else read from (and this level's written
        to) `draft_hidden`."""
        cfg, view, tree = self.config, self.view, self.tree
        start, end = self.levels[d - 1]
        rot, slots, mask = ctx if ctx is not None else self._tree_context()
        one_step = prev is not None
        level = self.forwarded[one_step][d - 1]
        if prev is None:  # a segment of --dynamic-depth: the previous level's outputs are kept
            a, b = (0, 1) if d == 1 else self.levels[d - 2]
            prev = self.draft_hidden[:, a:b]
        out = self.drafter.forward_block(cfg.expand_rows(view.tokens[:, level.nodes]), level.parents_of(prev),
                                         rot[:, d - 1:d].expand(-1, level.width, *rot.shape[2:]),
                                         slots[:, level.slots], mask[:, :, level.slots], self.dcache)
        if not one_step and d + 1 < tree.max_depth:  # the deepest forwarded level is nobody's parent
            self.draft_hidden[:, start:end] = out
        heads = level.heads
        if heads is None or not self.config.lean_head:
            self.q[:, level.nodes] = self._dist(out, d)
        else:  # the span's leaves propose nothing: the head runs at the nodes with children only
            self.q[:, heads[1]] = self._dist(out[:, heads[0]], d)
        return out

    def bind(self, view: DraftView, committed: int) -> None:
        super().bind(view, committed)
        self.tree_mask = self.dcache.additive(self.tree_seen)
        cfg, view = self.config, self.view
        # sampled drafts in one step: the drafts' and the acceptance's uniforms (`_noise`)
        one_step = cfg.spec.dynamic_depth is None and not view.grouped and not cfg.params.greedy
        self.draws = torch.zeros(cfg.batch, self.levels[-1][0] * cfg.vocab + self.tree.size + cfg.vocab,
                                 device=cfg.device) if one_step else None
        if cfg.spec.dynamic_depth is None:
            return
        # --dynamic-depth state
        self.path_prob = torch.ones(cfg.batch, self.tree.size, device=cfg.device)
        self.confident = torch.ones(cfg.batch, dtype=torch.bool, device=cfg.device)
        # each image's own cut: the depth after which its first failed check stopped it (the
        # whole tree when none failed); its batch-mates may have the tree verified deeper
        self.cut = torch.full((cfg.batch,), self.tree.max_depth, dtype=torch.long, device=cfg.device)
        self.noise = None if cfg.params.greedy else torch.zeros(
            cfg.batch, self.levels[-1][0], cfg.vocab, device=cfg.device)

    # -- --dynamic-depth: one segment per level, cut at the first improbable depth -------------
    @property
    def checks(self) -> frozenset[int]:  # type: ignore[override]
        if self.config.spec.dynamic_depth is None:
            return frozenset()
        return frozenset(range(self.tree.max_depth - 1))

    @property
    def go_on(self) -> torch.Tensor:
        return self.confident & self.view.live().bool()

    def segments(self) -> list[Callable[[], None]]:
        if self.config.spec.dynamic_depth is None:
            return [self.draft]
        return [self._first_level] + [lambda d=d: self._next_level(d) for d in range(1, self.tree.max_depth)]

    def verified_depths(self) -> tuple[int, ...]:
        if self.config.spec.dynamic_depth is None:
            return (self.tree.max_depth,)
        return tuple(range(1, self.tree.max_depth + 1))

    def prefix_tree(self, depth: int) -> TreeBuffers:
        if depth == self.tree.max_depth:
            return self.tree
        paths = tuple(p for p in self.static.paths if len(p) <= depth)
        return static_buffers(StaticTree(f"{self.static.name}[:{depth}]", paths)).to(self.config.device)

    def verified_depth(self, segments_run: int) -> int:
        """Segments 0..i ran and the check after i failed: levels 1..i+1 are drafted and level
        i+2 is not to be verified, so depths <= i+1 are kept."""
        if self.config.spec.dynamic_depth is None or segments_run >= self.tree.max_depth:
            return self.tree.max_depth  # one segment, or every level's: the whole tree
        return segments_run

    # The cut is decided before the level it judges is sampled (a cut that looked at the sampled
    # drafts' own probabilities would verify some drafts more often than others, which moves the
    # output away from the target's law): level d+1 is verified when the best path probability
    # it *can* reach, max over level-d nodes of path(node) * max q(. | node), is at least the
    # threshold. Greedy drafts take that maximum, so greedy cuts where the drafted path's own
    # probability falls below the threshold, as before.
    def _first_level(self) -> None:
        """Segment 0: the root's q, level 1 picked, its q, and whether level 2 is verified."""
        self.cut.fill_(self.tree.max_depth)
        self.draft_hidden[:, 0] = self._root_level()
        if self.noise is not None:
            self.noise.copy_(self._noise())
        self._pick_scored(1)
        if self.tree.max_depth > 1:
            self._forward(1)
            self._decide(1)

    def _next_level(self, d: int) -> None:
        """Segment d: level d+1 picked, then (above the deepest level) its q and whether level
        d+2 is verified."""
        self._pick_scored(d + 1)
        if d + 1 < self.tree.max_depth:
            self._forward(d + 1)
            self._decide(d + 1)

    def _pick_scored(self, d: int) -> None:
        """Pick level d and its nodes' path probabilities (the product of q along the path)."""
        view, tree = self.view, self.tree
        self._pick(d, self.noise, one_step=False)
        start, end = self.levels[d - 1]
        par = tree.parent[start:end]
        q_tok = self.q[:, par].gather(2, view.tokens[:, start:end, None]).squeeze(2)  # (B, width)
        self.path_prob[:, start:end] = self.path_prob[:, par] * q_tok

    def _decide(self, d: int) -> None:
        """`confident`: level d+1 is verified, from level d's path probabilities and q alone
        (before level d+1 is sampled)."""
        start, end = self.levels[d - 1]
        threshold = self.config.spec.dynamic_depth
        assert threshold is not None, "levels are decided only with --dynamic-depth"
        reach = self.path_prob[:, start:end] * self.q[:, start:end].amax(-1)  # (B, width)
        self.confident.copy_(reach.amax(-1) >= threshold)
        # the first failed check cuts the image at depth d (a later one cannot deepen it)
        self.cut.copy_(torch.where(self.confident | (self.cut <= d), self.cut, d))


@dataclass(frozen=True)
class ForwardedLevel:
    """The nodes of one static-tree level that a one-step draft runs through the drafter: the
    contiguous span from its first to its last node with children (a leaf's drafter output would
    only propose children it does not have; a span keeps the selections views, not gathers).

    nodes: their ids; slots: the same rows of the tree context (node i is context row i - 1);
    width: how many; parents: each one's parent as a position among the previous level's
    forwarded nodes, a (first, stop) range when the parents are that range in order with the
    same number of children each, else a (width,) index. heads: where the span holds leaves,
    the positions in it of the nodes with children and their ids, (n,) each: only they need
    the output head (a q); None when every node of the span has children.
    """

    nodes: slice
    slots: slice
    width: int
    parents: tuple[int, int] | torch.Tensor
    heads: tuple[torch.Tensor, torch.Tensor] | None = None

    def parents_of(self, prev: torch.Tensor) -> torch.Tensor:
        """The parents' drafter outputs (rows, width, dim) from the previous level's (rows, n', dim)."""
        if isinstance(self.parents, torch.Tensor):
            return prev[:, self.parents]
        a, b = self.parents
        return prev[:, a:b, None].expand(-1, -1, self.width // (b - a), -1).flatten(1, 2)


def _forwarded_nodes(levels: list[tuple[int, int]], parent: list[int], device: torch.device,
                     whole: bool = False) -> list[ForwardedLevel]:
    """`ForwardedLevel` of levels 1 .. D-1 of a static tree (levels: each level's (start, end)
    node ids; parent: every node's parent id, on the host); `whole`: every node of each level.
    A node's parent has children, so it lies in the previous level's span."""
    has_children = set(parent[1:])
    first = 0  # level 0: the root
    out = []
    for start, end in levels[:-1]:
        kept = [i for i in range(start, end) if whole or i in has_children]
        lo, hi = kept[0], kept[-1] + 1
        pos = [parent[i] - first for i in range(lo, hi)]
        a, b = pos[0], pos[-1] + 1
        each = len(pos) // (b - a)
        grid = pos == [x for x in range(a, b) for _ in range(each)]
        heads = None if len(kept) == hi - lo else (torch.tensor([i - lo for i in kept], device=device),
                                                   torch.tensor(kept, device=device))
        out.append(ForwardedLevel(nodes=slice(lo, hi), slots=slice(lo - 1, hi - 1), width=hi - lo,
                                  parents=(a, b) if grid else torch.tensor(pos, device=device), heads=heads))
        first = lo
    return out


class DynamicTreePolicy(DrafterPolicy):
    """EAGLE-2: the root's top-k, expanded `depth` times; keep the best total_tokens - 1.

    A node's score is its path's summed log q, made strictly lower than its parent's
    (`child_scores`), so the kept top set always holds a node's parent. EAGLE-2's `depth`
    counts the expansions after the root's own top-k, so the tree is depth + 1 levels deep
    (reference `topK_genrate`; depth 4 -> 5 levels). Each image of a batch builds its own
    tree of the same size: the tree buffers are batched (B, N+1, ...).

    ddd (Dynamic Depth Decoding) is the same tree with a depth decided per iteration: the
    expansions run in segments (one captured step each) between the checks of
    `MethodSpec.ddd_checks`. At a check an image whose beam heuristic H = logsumexp of the
    frontier's path scores is below `ddd_threshold` stops: its later candidates score -inf,
    so its tree is what it would be had drafting stopped there, whatever its batch-mates do.
    The host reads one flag per check (is any image still drafting?) and skips the remaining
    segments when none is; the final selection runs after the last segment that ran.
    """

    kind = "dynamic"
    needs_q = False  # drafts are deterministic; the root's log q stays a local of the draft

    def build_tree(self, device: torch.device) -> TreeBuffers:
        spec, b = self.config.spec, self.config.batch
        k, d, n1 = spec.top_k_draft, spec.expansions + 1, spec.total_tokens

        def zeros() -> torch.Tensor:
            return torch.zeros(b, n1, dtype=torch.long, device=device)

        def square() -> torch.Tensor:
            return torch.zeros(b, n1, n1, device=device)

        walk = (square(), square(), torch.ones(b, n1, dtype=torch.long, device=device))
        return TreeBuffers(parent=zeros(), depth=zeros(), rank=zeros(),
                           ancestor_mask=torch.eye(n1, dtype=torch.bool, device=device).expand(b, n1, n1).clone(),
                           children=torch.full((b, n1, k), -1, dtype=torch.long, device=device),
                           path_table=torch.zeros(b, n1, d + 1, dtype=torch.long, device=device),
                           earlier_sibling=walk[1], max_depth=d, max_children=k, walk=walk)

    def draft_slots(self) -> int:
        # every level expands all top_k frontier nodes, whatever the tree keeps
        return self.config.spec.expansions * self.config.spec.top_k_draft

    @property
    def most_parents(self) -> int:
        # only the root and the expanded frontier nodes have children
        return min(self.tree.size, 1 + self.draft_slots())

    def bind(self, view: DraftView, committed: int) -> None:
        super().bind(view, committed)
        cfg, view = self.config, self.view
        spec, dev, n1, b = cfg.spec, cfg.device, self.tree.size, cfg.batch
        k, e = spec.top_k_draft, spec.expansions
        # constants of every EAGLE-2 draft, built once (a captured step would rebuild them)
        earlier = torch.ones(n1, n1, dtype=torch.bool, device=dev).tril(-1)
        earlier[:, 0] = False  # the root shares parent id 0 with its children but is no sibling
        self.n_cand = k + e * k * k
        # Candidate c's parent is frontier c // k: the frontier ids of every expansion, after a
        # first column for the root's children (id n_cand, which `_select` maps to the root).
        # Frontier ids are kept local to their block; `fid_offset` makes them candidate ids.
        bases = [0] + [k + (level - 1) * k * k for level in range(1, e)]
        self._tree_consts = tree_constants(n1, self.tree.max_depth, dev)
        self._c = {
            "neg_inf": torch.full((), float("-inf"), device=dev),
            "stopped": torch.full((), _STOPPED, device=dev),
            "fid_offset": torch.tensor([0] + [base for base in bases for _ in range(k)], device=dev),
            "node_of": torch.zeros(b, self.n_cand + 1, dtype=torch.long, device=dev),
            # drafted node j sees itself only, as an additive block mask over the draft slots
            "eye_all": self.dcache.additive(torch.eye(e * k, dtype=torch.bool, device=dev)),
            "arange_nodes": torch.arange(1, n1, device=dev).expand(b, n1 - 1), "earlier": earlier,
        }
        zero = torch.zeros((), device=dev)
        self._c["root_below"] = child_scores(zero, zero, self._c["neg_inf"])  # the root's score is 0
        # candidates (root's top-k, then k*k per expansion) and the frontier between segments
        self.cand_tok = torch.zeros(b, self.n_cand, dtype=torch.long, device=dev)
        self.cand_score = torch.zeros(b, self.n_cand, device=dev)
        # frontier ids: column 0 the root's children (their parent, id n_cand, is the root),
        # then expansion 1's frontier (the root's top-k: 0..k-1, fixed), then each expansion's
        # best k, written by its top-k
        self.cand_fid = torch.full((b, 1 + e * k), self.n_cand, dtype=torch.long, device=dev)
        self.cand_fid[:, 1: 1 + k] = torch.arange(k, device=dev)
        self.fr_score = torch.zeros(b, max(e - 1, 1), k, device=dev)  # each frontier's scores
        # EAGLE-2 scores are log q: filters or a layout rule give -inf, floored to stay finite
        params = cfg.params
        self._floor_logq = cfg.constrain is not None or (
            not params.greedy and (params.top_k > 0 or params.top_p < 1.0))
        # the frontier between segments (ddd)
        self.frontier = {"tok": torch.zeros(b, k, dtype=torch.long, device=dev), "score": torch.zeros(b, k, device=dev),
                   "hidden": torch.zeros(cfg.rows, k, self.drafter.config.hidden_size, device=dev, dtype=cfg.dtype),
                   "mask": torch.zeros(cfg.rows, 1, k, self.dcache.capacity, device=dev,
                                       dtype=self.dcache.k_all.dtype)}
        self.alive = torch.ones(b, dtype=torch.bool, device=dev)  # ddd: still drafting
        # a tensor, so a captured step reads it at replay (runtime tune varies it in place)
        self.threshold = torch.full((), float(spec.ddd_threshold), device=dev)
        self.drafted = torch.ones(b, dtype=torch.long, device=dev)  # tree levels drafted this iteration
        self.level_offsets = torch.arange(e, device=dev)  # expansion l sits at drafter position length - 1 + l
        bounds = [0, *spec.ddd_checks, e]
        self._spans = list(zip(bounds[:-1], bounds[1:]))  # expansions of each segment

    # -- the draft as segments ---------------------------------------------------------------
    @property
    def checks(self) -> frozenset[int]:  # type: ignore[override]
        return frozenset(range(len(self._spans) - 1))

    @property
    def go_on(self) -> torch.Tensor:
        return self.alive & self.view.live().bool()

    def segments(self) -> list[Callable[[], None]]:
        if len(self._spans) == 1:
            return [self.draft]
        (first, last), rest = self._spans[0], self._spans[1:]
        return ([lambda: self._run_segment(first, last, start=True)]
                + [lambda a=a, z=z: self._run_segment(a, z) for a, z in rest])

    def finish(self) -> Callable[[], None] | None:
        return None if len(self._spans) == 1 else self._select

    def drafted_levels(self) -> torch.Tensor | None:
        return self.drafted if self.config.spec.ddd_checks else None

    def draft(self) -> None:
        if len(self._spans) == 1:  # EAGLE-2 in one step: every expansion, then the selection
            self._segment(0, self.config.spec.expansions, start=True)
        else:
            for seg in self.segments():
                seg()
        self._select()

    def _segment(self, first: int, last: int, start: bool = False) -> dict[str, torch.Tensor] | None:
        """Expansions first+1..last, their candidate blocks (tokens, scores, frontier ids)
        written into the candidate buffers by the ops that make them; returns the last frontier
        (None after the last expansion). `start` begins with the drafter's level 0 and the
        root's top-k. The frontier lives in locals within a segment and in `self.frontier` between
        segments (ddd, `_run_segment`)."""
        k, checks = self.config.spec.top_k_draft, self.config.spec.ddd_checks
        # RoPE rows, slots and "sees itself" masks of every drafted node, once (the drafter
        # cache length does not move while the tree is drafted)
        dc, e = self.dcache, self.config.spec.expansions
        root = self._level0() if start else None  # (rows, dim); advances the drafter cache
        own = dc.additive_mask_from(dc.mask_columns(e * k), e * k, self._c["eye_all"])  # (rows, 1, E*k, cap)
        ctx = (self.drafter.rope_rows(dc.length[:, None] + self.level_offsets), dc.block_slots(e * k), own)
        frontier: dict[str, torch.Tensor] | None = self._root(root, own) if root is not None else dict(self.frontier)
        for level in range(first + 1, last + 1):
            assert frontier is not None, "only the last expansion leaves no frontier"
            frontier = self._expand(level, frontier, ctx)
        if last in checks:  # DDD's heuristic: log of the beam's summed path probability
            assert frontier is not None, "a check comes before the last expansion"
            self.alive &= torch.logsumexp(frontier["score"], dim=-1) >= self.threshold
        return frontier

    def _run_segment(self, first: int, last: int, start: bool = False) -> None:
        """ddd: one segment, then its frontier kept for the next."""
        frontier = self._segment(first, last, start)
        if frontier is not None:
            for name in ("tok", "score", "hidden", "mask"):
                self.frontier[name].copy_(frontier[name])

    def _block(self, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of expansion `level`'s candidate block (B, k, k) in `cand_tok`, `cand_score`
        (level 0: the root's top-k, (B, k))."""
        k = self.config.spec.top_k_draft
        if level == 0:
            return self.cand_tok[:, :k], self.cand_score[:, :k]
        at = k + (level - 1) * k * k
        return (self.cand_tok[:, at: at + k * k].view(-1, k, k), self.cand_score[:, at: at + k * k].view(-1, k, k))

    def _log_q(self, out: torch.Tensor, depth: int) -> torch.Tensor:
        """log q (B, T, V) after drafter outputs out (rows, T, dim): one log_softmax, floored
        only where filters or a layout rule can make it -inf."""
        lq = self._dist(out, depth, log=True)
        return lq.clamp(min=_LOG_FLOOR) if self._floor_logq else lq

    def _root(self, root: torch.Tensor, own: torch.Tensor) -> dict[str, torch.Tensor]:
        """The root's top-k after the drafter's level 0 (root: its output (rows, dim)), written
        as the first candidate block; returns the first frontier. own: the drafted nodes'
        "sees itself" masks (rows, 1, E*k, cap)."""
        cfg, c, k = self.config, self._c, self.config.spec.top_k_draft
        if cfg.spec.ddd_checks:  # stale expansions of the last iteration must not be selected
            self.cand_score[:, k:] = float("-inf")
            self.alive.fill_(True)
            self.drafted.fill_(1)
        tok, score = self._block(0)
        _topk_into(self._log_q(root[:, None], 0)[:, 0], k, score, tok)  # (B, k)
        _into(score, torch.minimum, score, c["root_below"])  # = child_scores(0, top.values): one op
        return {"tok": tok, "score": score,
                "hidden": root[:, None].expand(-1, k, -1), "mask": own[:, :, :k]}

    def _expand(self, level: int, frontier: dict[str, torch.Tensor], ctx: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                ) -> dict[str, torch.Tensor] | None:
        """One EAGLE-2 expansion: the frontier (its attention mask frontier["mask"] (rows, 1, k, cap):
        the committed slots, its ancestors' slots and its own) through the drafter, its k*k
        children scored into the candidate block of `level`; returns the best k of them as the
        next frontier (None after the last expansion, whose frontier nothing reads; its ids go
        straight into `cand_fid`). ctx: the RoPE rows (rows, E, ...) of every expansion, the
        slots (rows, E*k) of every drafted node and their "sees itself" masks (rows, 1, E*k, cap)."""
        cfg, b, checks = self.config, self.config.batch, self.config.spec.ddd_checks
        k = cfg.spec.top_k_draft
        rot_all, slots_all, own = ctx
        out = self.drafter.forward_block(cfg.expand_rows(frontier["tok"]), frontier["hidden"],
                                         rot_all[:, level - 1:level].expand(-1, k, *rot_all.shape[2:]),
                                         slots_all[:, (level - 1) * k: level * k], frontier["mask"], self.dcache)
        tok, score = self._block(level)  # (B, k, k) views
        _topk_into(self._log_q(out, level), k, score, tok)
        parent = frontier["score"][..., None]
        _into(score, torch.minimum, parent + score, _below_negative(parent))
        scores, ch_tok = score.view(b, -1), tok.view(b, -1)
        if checks and level > checks[0]:  # an image that stopped adds nothing
            self.drafted += self.alive.long()
            _into(scores, torch.where, self.alive[:, None], scores, self._c["stopped"])
        elif checks:
            self.drafted += 1
        if level == cfg.spec.expansions:
            return None
        # the next frontier: local ids in this block, which are also the next block's frontier ids
        best_score = self.fr_score[:, level - 1]
        ids = self.cand_fid[:, 1 + level * k: 1 + (level + 1) * k]
        _topk_into(scores, k, best_score, ids)  # (B, k)
        parent_rows = cfg.expand_rows(ids // k)  # (rows, k): each one's parent in the frontier
        mask = frontier["mask"]
        # a child sees what its parent saw, and itself
        seen = mask.gather(2, parent_rows[:, None, :, None].expand(-1, 1, -1, mask.size(-1)))
        return {"tok": ch_tok.gather(1, ids), "score": best_score,
                "hidden": out.gather(1, parent_rows[..., None].expand(-1, -1, out.size(-1))),
                "mask": torch.maximum(seen, own[:, :, level * k: (level + 1) * k])}

    def _select(self) -> None:
        """Keep the best total_tokens - 1 candidates (parents before children) as the tree."""
        view, c, k = self.view, self._c, self.config.spec.top_k_draft
        tok, score, fid = self.cand_tok, self.cand_score, self.cand_fid
        n1 = self.tree.size
        sel = torch.topk(score, n1 - 1).indices.sort().values  # parents before children
        # node of each candidate id (n_cand: the root, node 0); a kept node's parent is kept
        node_of = c["node_of"].scatter(1, sel, c["arange_nodes"])
        par_id = (fid + c["fid_offset"]).gather(1, sel // k)  # candidate c's parent: frontier c // k
        # the tree's buffers are filled in place: each op writes its result there (no copies)
        t = self.tree
        _into(t.parent[:, 1:], torch.gather, node_of, 1, par_id)  # t.parent[:, 0] stays 0 (the root)
        parent = t.parent
        # selected in candidate order, so a parent's children come in rank order
        sib = torch.logical_and(parent[:, :, None] == parent[:, None, :], c["earlier"], out=t.earlier_sibling)
        buffers_from_parents(parent, torch.sum(sib, -1, out=t.rank), t.max_depth, t.max_children,
                             earlier_sibling=sib, consts=self._tree_consts, out=t)
        _into(view.tokens[:, 1:], torch.gather, tok, 1, sel)


def _into(out: torch.Tensor, op: Callable[..., torch.Tensor], *args: Any) -> None:
    """op(*args) written into `out`: through `out=` where `out` is contiguous (no extra op), else
    computed and copied in (torch.compile refuses a non-contiguous `out=`; the candidate blocks
    and token rows written here are column slices, contiguous only at batch 1)."""
    if out.is_contiguous():
        op(*args, out=out)
    else:
        out.copy_(op(*args))


def _topk_into(x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor) -> None:
    """topk of x along its last dim into preallocated `values`, `indices`: through `out=` where both
    are contiguous (no extra op), else computed and copied in. The candidate blocks are column
    slices of (B, N) buffers, contiguous only at batch 1, and torch.compile refuses a
    non-contiguous `out=` pair (a batch > 1 EAGLE-2 draft failed to capture)."""
    if values.is_contiguous() and indices.is_contiguous():
        torch.topk(x, k, out=(values, indices))
    else:
        top = torch.topk(x, k)
        values.copy_(top.values)
        indices.copy_(top.indices)
