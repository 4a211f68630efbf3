"""The EAGLE-2 dynamic-tree drafting policy (eagle2, lantern, ddd): a drafter head expands the
top_k best frontier nodes each level, keeps the total_tokens - 1 best drafted nodes by path
score, and (ddd) decides per image how many levels to expand (drafting.py has the policy
contract)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from runtime.core.drafting import LOG_FLOOR, STOPPED, DepthControl, DrafterPolicy, below_negative, child_scores
from runtime.core.tree import TreeBuffers, buffers_from_parents, tree_constants

if TYPE_CHECKING:
    from runtime.core.state import DraftView



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

    @property
    def needs_q(self) -> bool:
        return False  # drafts are deterministic; the root's log q stays a local of the draft

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
            "stopped": torch.full((), STOPPED, device=dev),
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
        self.level_offsets = torch.arange(e, device=dev)  # expansion l sits at drafter position length - 1 + l
        self._bind_segments()

    def _bind_segments(self) -> None:
        """ddd's state between segments: the frontier, which images still draft, the threshold,
        the levels drafted, each segment's expansions and the depth control over them (one
        segment without checks: EAGLE-2's whole tree)."""
        cfg, dev, b = self.config, self.config.device, self.config.batch
        k, e = cfg.spec.top_k_draft, cfg.spec.expansions
        self.frontier = {"tok": torch.zeros(b, k, dtype=torch.long, device=dev), "score": torch.zeros(b, k, device=dev),
                   "hidden": torch.zeros(cfg.rows, k, self.drafter.config.hidden_size, device=dev, dtype=cfg.dtype),
                   "mask": torch.zeros(cfg.rows, 1, k, self.dcache.capacity, device=dev,
                                       dtype=self.dcache.k_all.dtype)}
        self.alive = torch.ones(b, dtype=torch.bool, device=dev)  # ddd: still drafting
        # a tensor, so a captured step reads it at replay (runtime tune varies it in place)
        self.threshold = torch.full((), float(cfg.spec.ddd_threshold), device=dev)
        self.drafted = torch.ones(b, dtype=torch.long, device=dev)  # tree levels drafted this iteration
        bounds = [0, *cfg.spec.ddd_checks, e]
        self._spans = list(zip(bounds[:-1], bounds[1:]))  # expansions of each segment
        if len(self._spans) > 1:
            self.depth = DDDChecks(self)

    def draft(self) -> None:
        if len(self._spans) == 1:  # EAGLE-2 in one step: every expansion, then the selection
            self._segment(0, self.config.spec.expansions, start=True)
        else:
            for seg in self.depth.segments():
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
        return lq.clamp(min=LOG_FLOOR) if self._floor_logq else lq

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
        _into(score, torch.minimum, parent + score, below_negative(parent))
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


class DDDChecks(DepthControl):
    """ddd: the expansions in segments between the checks of `MethodSpec.ddd_checks`; after each
    check the host reads whether any image is still drafting (`alive`), then the selection
    (`_select`) runs over what was expanded. The whole tree is verified; an image's drafted
    levels are its own."""

    policy: DynamicTreePolicy

    @property
    def checks(self) -> frozenset[int]:
        return frozenset(range(len(self.policy._spans) - 1))

    @property
    def go_on(self) -> torch.Tensor:
        return self.policy.alive & self.policy.view.live().bool()

    def segments(self) -> list[Callable[[], None]]:
        policy = self.policy
        (first, last), rest = policy._spans[0], policy._spans[1:]
        return ([lambda: policy._run_segment(first, last, start=True)]
                + [lambda a=a, z=z: policy._run_segment(a, z) for a, z in rest])

    def finish(self) -> Callable[[], None]:
        return self.policy._select

    def drafted_levels(self) -> torch.Tensor:
        return self.policy.drafted


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
