"""Drafting policies: what fills the tree the one decoding loop verifies.

A policy owns the tree shape and whatever state its drafts come from; the loop owns the rest
(target cache, tokens, p, acceptance, output). Per iteration the loop calls

    draft()                 fill `loop.tokens[:, 1:]` (node 0 is the root the last accept
                            set), `loop.q` (B, N+1, V) where the drafts were sampled (q[:, i] =
                            the distribution node i's children were drawn from) and, for
                            dynamic trees, the tree buffers in place (one tree per image)
    committed(path, n, block)
                            inside the accept step, after the target cache was compacted:
                            path (B, D+1) accepted nodes, n (B,) how many (root included; 0
                            for an image that is done), block (B, D+1) the new tokens after
                            the root (bonus at n-1)

Every tensor of the loop has the batch of B images first; model rows are `loop.rows`
(`loop.expand_rows` maps per-image tensors onto them).

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

from typing import TYPE_CHECKING

import torch

from runtime.core.tree import TreeBuffers, buffers_from_parents, load_tree, static_buffers

if TYPE_CHECKING:
    from runtime.core.decoder import Decoder

_SMALLEST_NORMAL = 1.1754944e-38
# Floor for log q in EAGLE-2 scores: keeps filtered-out tokens finite and parent > child.
_LOG_FLOOR = -80.0


def child_scores(parent: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """EAGLE-2 score of children: parent score + log q, strictly below the parent's score.

    parent broadcasts against logq. A child with log q == 0 (or one whose log q is lost in
    float32 rounding at large |score|) would tie its parent; it takes the next float below
    instead, so in any top-n selection a kept child implies a kept parent.
    """
    below = torch.nextafter(parent, torch.full_like(parent, float("-inf")))
    # next to 0 the next float is denormal, which a flush-to-zero CPU mode (set by compiled
    # kernels) turns back into 0: step down by the smallest normal float there instead
    below = torch.minimum(below, parent - _SMALLEST_NORMAL)
    return torch.minimum(parent + logq, below)


class DraftPolicy:
    """Base: the AR policy (root only, nothing drafted). Subclasses override the hooks."""

    kind = "none"
    sampled_q = False  # acceptance sees `loop.q` (drafts were sampled from it)
    needs_q = False  # the loop allocates `q` (N+1, V)

    def __init__(self, loop: "Decoder") -> None:
        self.loop = loop
        self.tree = self.build_tree(loop.device)

    def build_tree(self, device: torch.device) -> TreeBuffers:
        z = torch.zeros(1, dtype=torch.long, device=device)
        return TreeBuffers(z, z.clone(), z.clone(), torch.ones(1, 1, dtype=torch.bool, device=device),
                           torch.full((1, 1), -1, dtype=torch.long, device=device),
                           torch.zeros(1, 1, dtype=torch.long, device=device), 0, 1)

    def allocate(self, committed: int) -> None:
        """Policy state, once the loop's shared buffers exist; `committed` = its cache rows."""

    def start(self, i: int, rows: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor,
              cond_mask: torch.Tensor | None) -> None:
        """Image slot i starts a new image (between steps; the other slots keep their state):
        rows its model rows, hidden (len(rows), cls, dim) the target's prefill hidden states,
        first (1,) its first token, cond_mask (len(rows), cls) or None."""

    def draft(self) -> None:
        """Fill the tree for this iteration (see the module docstring)."""

    def committed(self, path: torch.Tensor, n: torch.Tensor, block: torch.Tensor) -> None:
        """Update the policy's state after acceptance (inside the accept step)."""


class DrafterPolicy(DraftPolicy):
    """Shared by the drafter-head policies: the drafter cache and the pending block.

    The drafter sees each accepted token paired with the target hidden state that predicted
    it. After an accept, the block of accepted tokens (root first) and their target hidden
    states wait in `pend_*` until the next draft runs them through the drafter (level 0).
    """

    needs_q = True

    def draft_slots(self) -> int:
        """Drafter cache slots written per iteration beyond the pending block."""
        return self.tree.size

    def allocate(self, committed: int) -> None:
        loop = self.loop
        dev, rows, m = loop.device, loop.rows, loop.max_depth + 1
        drafter = loop.drafter
        self.dcache = drafter.new_cache(rows, committed + self.draft_slots(), dev)
        # condition positions 0..cls-2 of one image, run before its slot takes them
        self.start_dcache = drafter.new_cache(rows // loop.batch, loop.cls - 1, dev) if loop.cls > 1 else None
        self.draft_hidden = torch.zeros(rows, loop.n1, drafter.config.hidden_size, device=dev, dtype=loop.dtype)
        self.pend_tokens = torch.zeros(loop.batch, m, dtype=torch.long, device=dev)
        self.pend_hidden = torch.zeros(rows, m, loop.target.config.dim, device=dev, dtype=loop.dtype)
        self.pend_count = torch.ones(loop.batch, dtype=torch.long, device=dev)
        self.causal_m = torch.ones(m, m, dtype=torch.bool, device=dev).tril()

    def start(self, i: int, rows: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor,
              cond_mask: torch.Tensor | None) -> None:
        loop = self.loop
        if self.start_dcache is not None:  # condition positions 0..cls-2 pair token 0 with the target hidden
            c1, tmp = loop.cls - 1, self.start_dcache
            tmp.reset()
            if cond_mask is not None:
                tmp.prefix_valid.copy_(cond_mask[:, :c1])
            zeros = torch.zeros(rows.numel(), c1, dtype=torch.long, device=loop.device)
            loop.drafter.forward_cached(zeros, hidden[:, :c1], torch.arange(c1, device=loop.device),
                                        torch.ones(c1, c1, dtype=torch.bool, device=loop.device).tril(), tmp)
            tmp.advance(c1)
            self.dcache.load_rows(rows, tmp)
        else:
            self.dcache.reset_rows(rows)
        if cond_mask is not None:
            self.dcache.prefix_valid[rows, : loop.cls] = cond_mask
        self.pend_tokens[i] = 0
        self.pend_tokens[i, :1] = first
        self.pend_hidden[rows] = 0
        self.pend_hidden[rows, 0] = hidden[:, -1]
        self.pend_count[i] = 1

    def committed(self, path: torch.Tensor, n: torch.Tensor, block: torch.Tensor) -> None:
        loop = self.loop
        self.pend_tokens.copy_(block)
        rows_path = loop.expand_rows(path)
        self.pend_hidden.copy_(loop.hidden.gather(1, rows_path[..., None].expand(-1, -1, loop.hidden.size(-1))))
        self.pend_count.copy_(n)  # 0 for a done image: its drafter cache stops advancing

    def _level0(self) -> torch.Tensor:
        """Drafter over the last accepted block; returns the root's drafter output (rows, dim)."""
        loop = self.loop
        positions = self.dcache.length[:, None] + loop.block_ids
        out = loop.drafter.forward_cached(loop.expand_rows(self.pend_tokens), self.pend_hidden, positions,
                                          self.causal_m, self.dcache)
        count = loop.expand_rows(self.pend_count)
        last = (count - 1).clamp(min=0)[:, None, None].expand(-1, 1, out.size(-1))
        root = out.gather(1, last).squeeze(1)
        self.dcache.advance(count)
        return root

    def _dist(self, out: torch.Tensor, depth: torch.Tensor | int) -> torch.Tensor:
        return self.loop.dist(self.loop.target.logits(out), depth)

    def draft(self) -> None:
        root = self._level0()
        self.draft_hidden[:, 0] = root
        self.loop.q[:, 0] = self._dist(root[:, None], 0)[:, 0]
        self._draft_tree()

    def _draft_tree(self) -> None:
        raise NotImplementedError


class StaticTreePolicy(DrafterPolicy):
    """A static tree (sd chains, LANTERN++ presets): one drafter forward per level.

    Greedy: each node's children are its parent's top-k drafter tokens. Sampling: k samples
    without replacement (Gumbel-top-k) from the parent's q, so acceptance sees q.
    """

    kind = "static"

    @property
    def sampled_q(self) -> bool:  # type: ignore[override]
        return not self.loop.params.greedy

    def build_tree(self, device: torch.device) -> TreeBuffers:
        tree = static_buffers(load_tree(self.loop.spec.tree_spec)).to(device)
        self.levels = [tree.level(d) for d in range(1, tree.max_depth + 1)]
        # per level: each node's parent as an index into the previous level's rows
        starts = [0] + [start for start, _ in self.levels]
        self.level_parent = [tree.parent[a:b] - starts[d] for d, (a, b) in enumerate(self.levels)]
        return tree

    def _draft_tree(self) -> None:
        loop, tree, k = self.loop, self.tree, self.tree.max_children
        parent_start, parent_end = 0, 1
        # Sampled drafts: the Gumbel noise of every level in one draw (rows = nodes with
        # children-to-be, i.e. all nodes above the deepest level), one RNG call per step.
        noise = None if loop.params.greedy else loop.rng.gumbel(loop.batch, self.levels[-1][0], loop.vocab)
        base = self.dcache.length[:, None] - 1  # (rows, 1)
        for d, (start, end) in enumerate(self.levels, start=1):
            q = loop.q[:, parent_start:parent_end]
            if noise is None:
                cand = torch.topk(q, k, dim=-1).indices  # (B, parents, k)
            else:  # k samples without replacement (Gumbel-top-k)
                cand = torch.topk(torch.log(q) + noise[:, parent_start:parent_end], k, dim=-1).indices
            par = tree.parent[start:end]
            loop.tokens[:, start:end] = cand[:, self.level_parent[d - 1], tree.rank[start:end]]
            if d < tree.max_depth:
                hid = self.draft_hidden[:, par]
                positions = (base + d).expand(-1, end - start)
                out = loop.drafter.forward_cached(loop.expand_rows(loop.tokens[:, start:end]), hid, positions,
                                                  tree.ancestor_mask[start:end, 1:end], self.dcache,
                                                  offset=start - 1)
                self.draft_hidden[:, start:end] = out
                loop.q[:, start:end] = self._dist(out, d)
            parent_start, parent_end = start, end


class DynamicTreePolicy(DrafterPolicy):
    """EAGLE-2: the root's top-k, expanded `depth` times; keep the best total_tokens - 1.

    A node's score is its path's summed log q, made strictly lower than its parent's
    (`child_scores`), so the kept top set always holds a node's parent. EAGLE-2's `depth`
    counts the expansions after the root's own top-k, so the tree is depth + 1 levels deep
    (reference `topK_genrate`; depth 4 -> 5 levels). Each image of a batch builds its own
    tree of the same size: the tree buffers are batched (B, N+1, ...).
    """

    kind = "dynamic"

    def build_tree(self, device: torch.device) -> TreeBuffers:
        spec, b = self.loop.spec, self.loop.batch
        k, d, n1 = spec.top_k_draft, spec.depth + 1, spec.total_tokens
        zeros = lambda: torch.zeros(b, n1, dtype=torch.long, device=device)  # noqa: E731
        return TreeBuffers(zeros(), zeros(), zeros(),
                           torch.eye(n1, dtype=torch.bool, device=device).expand(b, n1, n1).clone(),
                           torch.full((b, n1, k), -1, dtype=torch.long, device=device),
                           torch.zeros(b, n1, d + 1, dtype=torch.long, device=device), d, k,
                           earlier_sibling=torch.zeros(b, n1, n1, dtype=torch.bool, device=device))

    def draft_slots(self) -> int:
        # every level expands all top_k frontier nodes, whatever the tree keeps
        return self.loop.spec.depth * self.loop.spec.top_k_draft

    def allocate(self, committed: int) -> None:
        super().allocate(committed)
        spec, dev, n1, b = self.loop.spec, self.loop.device, self.tree.size, self.loop.batch
        k, d = spec.top_k_draft, spec.depth
        self.n_cand = k + d * k * k
        # constants of every EAGLE-2 draft, built once (a captured step would rebuild them)
        earlier = torch.ones(n1, n1, dtype=torch.bool, device=dev).tril(-1)
        earlier[:, 0] = False  # the root shares parent id 0 with its children but is no sibling
        self._c = {
            "zero": torch.zeros((), device=dev), "zero_long": torch.zeros(b, 1, dtype=torch.long, device=dev),
            "no_parent": torch.full((b, k), -1, dtype=torch.long, device=dev),
            "arange_k": torch.arange(k, device=dev).expand(b, k),
            "eye_k": torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k),
            "arange_nodes": torch.arange(n1 - 1, device=dev).expand(b, n1 - 1), "earlier": earlier,
        }

    def _draft_tree(self) -> None:
        loop = self.loop
        k, depth, dev, b = loop.spec.top_k_draft, loop.spec.depth, loop.device, loop.batch
        c = self._c
        logq = torch.log(loop.q[:, 0]).clamp(min=_LOG_FLOOR)  # log 0 = -inf -> the floor
        top = torch.topk(logq, k)  # (B, k)
        cand_tok, cand_score = [top.indices], [child_scores(c["zero"], top.values)]
        cand_parent = [c["no_parent"]]
        frontier = c["arange_k"]  # (B, k) candidate ids of the frontier
        fr_tok, fr_score = top.indices, cand_score[0]
        fr_hidden = self.draft_hidden[:, :1].expand(loop.rows, k, -1)
        fr_anc = c["eye_k"]  # (B, k, l*k) over frontier blocks
        dim = fr_hidden.size(-1)
        base = k
        for level in range(1, depth + 1):
            positions = (self.dcache.length[:, None] - 1 + level).expand(-1, k)
            out = loop.drafter.forward_cached(loop.expand_rows(fr_tok), fr_hidden, positions,
                                              loop.expand_rows(fr_anc), self.dcache, offset=(level - 1) * k)
            lq = torch.log(self._dist(out, level)).clamp(min=_LOG_FLOOR)  # (B, k, V)
            ch = torch.topk(lq, k, dim=-1)  # (B, k, k)
            scores = child_scores(fr_score[..., None], ch.values).reshape(b, -1)
            ch_tok = ch.indices.reshape(b, -1)
            cand_tok.append(ch_tok)
            cand_score.append(scores)
            cand_parent.append(frontier.repeat_interleave(k, dim=1))
            best = torch.topk(scores, k).indices  # (B, k) local ids in this block
            parent_local = best // k
            frontier = base + best
            fr_tok = ch_tok.gather(1, best)
            fr_score = scores.gather(1, best)
            fr_hidden = out.gather(1, loop.expand_rows(parent_local)[..., None].expand(-1, -1, dim))
            fr_anc = torch.cat([fr_anc.gather(1, parent_local[..., None].expand(-1, -1, fr_anc.size(-1))),
                                c["eye_k"]], dim=2)
            base += k * k
        tok = torch.cat(cand_tok, 1)  # (B, n_cand)
        score = torch.cat(cand_score, 1)
        par = torch.cat(cand_parent, 1)
        n1 = self.tree.size
        sel = torch.topk(score, n1 - 1).indices.sort().values  # parents before children
        inv = torch.full((b, self.n_cand), -1, dtype=torch.long, device=dev)
        inv.scatter_(1, sel, c["arange_nodes"])
        sel_par = par.gather(1, sel)
        node_parent = torch.where(sel_par < 0, 0, inv.gather(1, sel_par.clamp(min=0)) + 1)
        parent = torch.cat([c["zero_long"], node_parent], 1)
        rank = ((parent[:, :, None] == parent[:, None, :]) & c["earlier"]).sum(-1)
        built = buffers_from_parents(parent, rank, depth + 1, k)
        t = self.tree
        for dst, src in ((t.parent, built.parent), (t.depth, built.depth), (t.rank, built.rank),
                         (t.ancestor_mask, built.ancestor_mask), (t.children, built.children),
                         (t.path_table, built.path_table), (t.earlier_sibling, built.earlier_sibling)):
            dst.copy_(src)
        loop.tokens[:, 1:] = tok.gather(1, sel)


def make_policy(loop: "Decoder") -> DraftPolicy:
    """The policy of the loop's method (`MethodSpec.drafting`)."""
    kind = loop.spec.drafting
    if kind == "none":
        return DraftPolicy(loop)
    if kind == "static":
        return StaticTreePolicy(loop)
    if kind == "dynamic":
        return DynamicTreePolicy(loop)
    from runtime.core.jacobi import JacobiPolicy

    return JacobiPolicy(loop)
