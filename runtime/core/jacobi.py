"""Jacobi-window drafting (speculative Jacobi decoding, SJD): no drafter, any target.

The drafts are the target's own predictions. A window of L draft tokens follows the root (the
last committed token); one verify forward over [root, x_1..x_L] gives p_1..p_{L+1}, and the
shared acceptance rule judges x_i against p with q_i = the distribution x_i was drawn from.
After n nodes were accepted (root included) the bonus becomes the next root, and the window
moves on by n:

    stale tail   old node j = n + i (j <= L) becomes new node i. Its position's p from this
                 forward saw a stale context, so it is a proposal, not a target: the token is
                 redrafted from it and q_i := that p (the "coupling" decides how):
                   none     a fresh sample of p                                 (SJD)
                   maximal  keep the old draft with probability min(1, p/q_old),
                            else sample norm(max(p - q_old, 0))                (MC-SJD)
                   gumbel   argmax(log p + g_pos), g keyed by the image position, so
                            the draft changes only where p does                 (SCD-GS)
                 Greedy decoding redrafts the argmax.
    fresh        positions past the old window get the prior (`init`): a uniform token, the
                 token to the left (repeat-h) or the one above (repeat-v; its row in the
                 token grid), with a one-hot q (a deterministic draft).

Every variant is lossless: a draft's noise never depends on the target it is judged against
(drafts only see earlier positions, and acceptance draws fresh uniforms), and q is the exact
distribution it was drawn from. Everything is fixed-shape on the device.

Proactive drafting (`proactive` = (K, D), SJD-PAC style): the verified tree is a K-ary tree of
depth D under the root (the residual sample committed at the last rejection), followed by a
chain along its rank-0 path ("spine") out to L drafts. The spine carries the window as above;
every node above depth D gets K children drawn without replacement from the proposal of their
position (a spine node's first child is the window's draft, the others exclude it; sampling
only). Multi-candidate acceptance (`accept_sampling`) judges the siblings in turn against the
residual, so a rejected first draft leaves K - 1 more chances at each of the first D positions.
"""

from __future__ import annotations


import torch

from runtime.core.drafting import DraftPolicy
from runtime.core.rng import gumbel_from_uniform, token_from_uniform
from runtime.core.state import DraftView
from runtime.core.tree import StaticTree, TreeBuffers, chain_tree, static_buffers, validate_paths


def proactive_tree(k: int, d: int, window: int) -> StaticTree:
    """K-ary tree of depth d, then a chain along the rank-0 path to `window` levels."""
    paths: list[tuple[int, ...]] = []
    level: list[tuple[int, ...]] = [()]
    for _ in range(d):
        level = [p + (r,) for p in level for r in range(k)]
        paths.extend(level)
    spine = (0,) * d
    paths.extend(spine + (0,) * e for e in range(1, window - d + 1))
    return validate_paths(f"proactive{k}x{d}_w{window}", paths)


class JacobiPolicy(DraftPolicy):
    """The `jacobi` drafting policy (method sjd); see the module docstring."""

    @property
    def needs_q(self) -> bool:
        return True

    @property
    def reads_p(self) -> bool:
        return True  # stale proposals come from the target's last distributions

    @property
    def sampled_q(self) -> bool:
        return not self.config.params.greedy

    def build_tree(self, device: torch.device) -> TreeBuffers:
        spec = self.config.spec
        self.window = spec.window
        if spec.proactive is None:
            tree = static_buffers(chain_tree(spec.window))
        else:
            tree = static_buffers(proactive_tree(*spec.proactive, spec.window))
        # the window's L nodes: the rank-0 path from the root (the whole chain without PAC)
        spine = [0]
        for _ in range(spec.window):
            spine.append(int(tree.children[spine[-1], 0]))
        self.spine_nodes = spine
        return tree.to(device)

    def bind(self, view: DraftView, committed: int) -> None:
        super().bind(view, committed)
        cfg, dev, w = self.config, self.config.device, self.window
        grid = cfg.target.row_width
        # how far back a fresh position copies its token from (0: uniform prior)
        self.offset = {"uniform": 0, "repeat-h": 1, "repeat-v": grid}[cfg.spec.init]
        self.last_n = torch.full((cfg.batch,), w + 1, dtype=torch.long, device=dev)  # everything fresh
        self.spine = torch.tensor(self.spine_nodes, device=dev)  # (L+1,) node ids, root first
        self.node_ids = torch.arange(1, w + 1, device=dev)  # window index i = 1..L
        self.vocab_ids = torch.arange(cfg.vocab, device=dev)
        self.image_ids = torch.arange(cfg.batch, device=dev)[:, None]
        if self.offset:
            self.history_ids = torch.arange(-self.offset, 0, device=dev)
        if cfg.spec.proactive is not None:
            k, d = cfg.spec.proactive
            tree = self.tree
            # parents of the K-ary part: every node above depth D, with its children by rank
            parents = [i for i in range(tree.size) if int(tree.depth[i]) < d]
            self.k = k
            self.tree_parents = torch.tensor(parents, device=dev)
            self.tree_parent_depth = tree.depth[self.tree_parents]
            self.tree_parent_on_spine = torch.tensor([i in self.spine_nodes for i in parents], device=dev)
            self.tree_children = tree.children[self.tree_parents]  # (M, K), all present

    def start(self, i: int, rows: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor,
              cond_mask: torch.Tensor | None) -> None:
        self.last_n[i] = self.window + 1
        self.q[i] = 0.0

    def committed(self, path: torch.Tensor, n: torch.Tensor, block: torch.Tensor) -> None:
        self.last_n.copy_(n)

    # ---------------------------------------------------------------------------------------
    def draft(self) -> None:
        """Per image of the batch (leading dim B): redraft the stale tail, fill the fresh
        positions, write tokens and q."""
        cfg, view, w, v, b = self.config, self.view, self.window, self.config.vocab, self.config.batch
        greedy = cfg.params.greedy
        spine, img = self.spine, self.image_ids
        j = self.last_n[:, None] + self.node_ids  # (B, L) old window index feeding new index i
        stale = j <= w
        src = spine[(j - 1).clamp(max=w - 1)]  # old node whose p predicts old node j
        p_src = view.p[img, src]  # (B, L, V) stale proposal of each new position
        old_tok = view.tokens.gather(1, spine[j.clamp(max=w)])
        coupling = cfg.spec.coupling
        # columns: keep test (maximal), prior, then Gumbel rows unless the coupling keys its own
        noise = None if greedy else view.rng.uniform(b, w, 2 if coupling == "gumbel" else v + 2)

        if noise is None:  # greedy
            redraft = p_src.argmax(-1)
        elif coupling == "gumbel":
            pos = view.count[:, None] - 1 + self.node_ids  # image index of each new position
            g = gumbel_from_uniform(view.rng.keyed_uniform(pos[..., None] * v + self.vocab_ids))
            redraft = torch.argmax(torch.log(p_src) + g, dim=-1)
        else:
            g = gumbel_from_uniform(noise[..., 2:])
            if coupling == "maximal":
                q_old = self.q[img, src]  # the distribution old node j was drawn from
                px = p_src.gather(2, old_tok[..., None]).squeeze(2)
                qx = q_old.gather(2, old_tok[..., None]).squeeze(2)
                keep = noise[..., 0] * qx < px  # u < min(1, p/q)
                res = (p_src - q_old).clamp(min=0.0)
                res = torch.where(res.sum(-1, keepdim=True) > 0, res, p_src)
                redraft = torch.where(keep, old_tok, torch.argmax(torch.log(res) + g, dim=-1))
            else:
                redraft = torch.argmax(torch.log(p_src) + g, dim=-1)

        fresh = self._prior(redraft, stale, noise)
        new = torch.where(stale, redraft, fresh)  # (B, L)
        one_hot = torch.zeros_like(p_src).scatter_(2, new[..., None], 1.0)  # (F.one_hot checks on the host)
        q_new = torch.where(stale[..., None], p_src, one_hot)
        if cfg.spec.proactive is None:
            view.tokens[:, 1:] = new
            self.q[:, :w] = q_new
        else:
            self._write_tree(new, q_new)

    def _prior(self, redraft: torch.Tensor, stale: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Tokens for fresh window positions (B, L): the `init` prior (see the module docstring)."""
        view, w, v, o = self.view, self.window, self.config.vocab, self.offset
        start = view.count[:, None] - 1  # (B, 1) image index of the root
        if noise is None:  # greedy: a fixed pseudo-random stream per position
            u = view.rng.keyed_uniform(start + self.node_ids, stream=2)
        else:
            u = noise[..., 1]
        uniform = token_from_uniform(u, v)
        if o == 0:
            return uniform
        # new window with the root at index 0 and the o committed tokens before it
        hist = view.out.gather(1, (start + self.history_ids).clamp(min=0))
        full = torch.cat([hist, view.tokens[:, :1], torch.where(stale, redraft, 0)], 1)
        last = (w - self.last_n[:, None]).clamp(min=0)  # last non-fresh window index (0 = root)
        i = self.node_ids
        s = i - o * torch.div(i - last + o - 1, o, rounding_mode="floor")  # copy source, in (last - o, last]
        value = full.gather(1, o + s)
        return torch.where(start + s >= 0, value, uniform)

    def _write_tree(self, new: torch.Tensor, q_new: torch.Tensor) -> None:
        """Proactive tree: the window runs along the rank-0 spine; every node above depth D has
        K children drawn without replacement from the proposal of their position (a spine
        node's rank-0 child is the window's draft, the others exclude it)."""
        view, k, b = self.view, self.k, self.config.batch
        view.tokens[:, self.spine[1:]] = new
        self.q[:, self.spine[:-1]] = q_new  # q[parent] = the proposal its children were drawn from
        q_par = q_new[:, self.tree_parent_depth]  # (B, M, V) proposal of each parent's children
        self.q[:, self.tree_parents] = q_par
        first = new[:, self.tree_parent_depth]  # the spine child's token, for spine parents
        score = torch.log(q_par) + view.rng.gumbel(*q_par.shape)
        on_spine = self.tree_parent_on_spine[None, :, None]
        taken = on_spine & (self.vocab_ids == first[..., None])
        top = torch.topk(score.masked_fill(taken, float("-inf")), k, dim=-1).indices  # (B, M, K)
        spine_kids = torch.cat([first[..., None], top[..., : k - 1]], 2)
        kids = torch.where(on_spine, spine_kids, top)
        view.tokens[:, self.tree_children.reshape(-1)] = kids.reshape(b, -1)
