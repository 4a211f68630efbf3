"""Drafting policies: what fills the tree the shared decoding loop (steps.py) verifies.

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

A simple policy implements five hooks: `build_tree`, `bind`, `start`, `draft`, `committed`;
its read-only flags (`sampled_q`: acceptance must see `q`, the drafts were sampled from it,
else they are deterministic, top-k / EAGLE-2, `q` None; `needs_q`, `reads_p`, `extra`) say what
the loop allocates and hands over. A draft whose depth is decided per iteration (ddd,
--dynamic-depth) keeps those hooks in one object, `policy.depth` (a `DepthControl`: segments,
checks, the prefix verified, each image's depth).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from runtime.core.state import DraftProposal, LookaheadRows
from runtime.core.tree import TreeBuffers

if TYPE_CHECKING:
    from runtime.core.state import DecodeConfig, DraftView
    from runtime.models.target import DrafterModel

_SMALLEST_NORMAL = 1.1754944e-38
# Floor for log q in EAGLE-2 scores: keeps filtered-out tokens finite and parent > child.
LOG_FLOOR = -80.0


# ddd: the score of a stopped image's candidates, below any real one and finite (so a score's
# next float below, `below_negative`, stays a number)
STOPPED = -1e38


def below_negative(score: torch.Tensor) -> torch.Tensor:
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

    view: DraftView  # set by `bind`

    @property
    def sampled_q(self) -> bool:
        """Acceptance sees `view.q` (the drafts were sampled from it)."""
        return False

    @property
    def needs_q(self) -> bool:
        """The loop allocates `q` (N+1, V)."""
        return False

    @property
    def reads_p(self) -> bool:
        """The policy reads the target's `p` (otherwise only acceptance does)."""
        return False

    @property
    def extra(self) -> int:
        """Nodes verified after the tree in the same forward that acceptance never judges (pjd's
        lookahead rows): a policy with extra > 0 hands them over as its proposals' `lookahead`."""
        return 0

    def __init__(self, config: DecodeConfig) -> None:
        self.config = config
        self.tree = self.build_tree(config.device)
        # how deep each iteration drafts: the whole tree here; a policy whose depth is decided
        # per iteration (ddd, --dynamic-depth) sets its own in `bind`
        self.depth: DepthControl = DepthControl(self)

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
        tree = self.depth.prefix_tree(depth)
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

    def accept_uniforms(self) -> torch.Tensor | None:
        """(B, N+1+V) uniforms the draft drew for the sampled acceptance of this iteration
        (what `accept_sampling` would draw next), or None: acceptance draws its own."""
        return None


class DepthControl:
    """How deep a policy drafts each iteration (`DraftPolicy.depth`). This base: the whole tree,
    drafted in one step and verified whole. A draft whose depth is decided per iteration (ddd,
    --dynamic-depth) runs as `segments()`, each captured on its own; after segment i in
    `checks` the host reads `go_on` (B,) bool and stops drafting when no image wants more. Then
    `finish()` (if any) runs, and `verified_depth(segments run)` says which prefix of the tree
    the loop verifies, one of `verified_depths()` (one captured verify / accept each)."""

    def __init__(self, policy: DraftPolicy) -> None:
        self.policy = policy

    @property
    def checks(self) -> frozenset[int]:
        """The segments after which the host reads `go_on`."""
        return frozenset()

    @property
    def go_on(self) -> torch.Tensor:
        """(B,) bool: the images that want more levels (read after a segment in `checks`)."""
        raise NotImplementedError

    def segments(self) -> list[Callable[[], None]]:
        return [self.policy.draft]

    def finish(self) -> Callable[[], None] | None:
        """A step run after the segments that ran (None: nothing)."""
        return None

    def verified_depths(self) -> tuple[int, ...]:
        """The tree prefixes (by depth) the loop may verify: one captured verify/accept each."""
        return (self.policy.tree.max_depth,)

    def verified_depth(self, segments_run: int) -> int:
        return self.policy.tree.max_depth

    def prefix_tree(self, depth: int) -> TreeBuffers:
        """The tree cut to its depths <= depth (one of `verified_depths()`)."""
        return self.policy.tree

    def drafted_levels(self) -> torch.Tensor | None:
        """(B,) long tree levels drafted this iteration when it varies per image, else None."""
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

    @property
    def needs_q(self) -> bool:
        return True

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
        self.dcache = cfg.new_cache(drafter, rows, committed + self.draft_slots())
        # condition positions 0..cls-2 of one image, run before its slot takes them
        self.start_dcache = cfg.new_cache(drafter, rows // cfg.batch, cfg.cls - 1) if cfg.cls > 1 else None
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
