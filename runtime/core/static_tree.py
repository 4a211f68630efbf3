"""The static-tree drafting policy (sd chains, LANTERN++ trees): a drafter head drafts a tree
whose shape is fixed (a preset, chainN or a TOML file), level by level, each level's nodes from
their parents' drafter states; with --dynamic-depth the tree is cut at the first level whose best
drafted path probability falls below the threshold (drafting.py has the policy contract)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from runtime.core.drafting import DepthControl, DrafterPolicy
from runtime.core.rng import neg_exponential_from_uniform
from runtime.core.tree import StaticTree, TreeBuffers, load_tree, static_buffers

if TYPE_CHECKING:
    from runtime.core.state import DraftView



class StaticTreePolicy(DrafterPolicy):
    """A static tree (sd chains, LANTERN++ presets): one drafter forward per level.

    Greedy: each node's children are its parent's top-k drafter tokens. Sampling: k samples
    without replacement (Gumbel-top-k) from the parent's q, so acceptance sees q.
    """


    @property
    def sampled_q(self) -> bool:
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
        self.depth = StaticCut(self)

    # -- --dynamic-depth (`StaticCut`): one segment per level, cut at the first improbable depth
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


class StaticCut(DepthControl):
    """--dynamic-depth: one segment per level; after each (but the deepest) the host reads
    whether any image's next level can still reach the threshold (`StaticTreePolicy._decide`),
    and the loop verifies the tree cut there. Each image's own cut (`policy.cut`, at or above
    the batch's) caps its acceptance."""

    policy: StaticTreePolicy

    @property
    def checks(self) -> frozenset[int]:
        return frozenset(range(self.policy.tree.max_depth - 1))

    @property
    def go_on(self) -> torch.Tensor:
        return self.policy.confident & self.policy.view.live().bool()

    def segments(self) -> list[Callable[[], None]]:
        policy = self.policy
        return [policy._first_level] + [lambda d=d: policy._next_level(d) for d in range(1, policy.tree.max_depth)]

    def verified_depths(self) -> tuple[int, ...]:
        return tuple(range(1, self.policy.tree.max_depth + 1))

    def prefix_tree(self, depth: int) -> TreeBuffers:
        policy = self.policy
        if depth == policy.tree.max_depth:
            return policy.tree
        paths = tuple(p for p in policy.static.paths if len(p) <= depth)
        return static_buffers(StaticTree(f"{policy.static.name}[:{depth}]", paths)).to(policy.config.device)

    def verified_depth(self, segments_run: int) -> int:
        """Segments 0..i ran and the check after i failed: levels 1..i+1 are drafted and level
        i+2 is not to be verified, so depths <= i+1 are kept."""
        return min(segments_run, self.policy.tree.max_depth)  # every level's segment: the whole tree

    def depth_cap(self) -> torch.Tensor:
        return self.policy.cut

    def drafted_levels(self) -> torch.Tensor:
        return self.policy.cut  # an image's drafted levels are its own cut


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
