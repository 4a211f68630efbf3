"""Parallel Jacobi decoding (PJD, arXiv 2606.05703), lossless form: no drafter, any target.

PJD verifies several Jacobi windows ("rows": one per image row) in one target forward. Here
row 0 is the frontier: sjd's window (jacobi.py) of W - 1 drafts after the root, judged by the
exact rule, committing up to its first rejection and sampling there (or the bonus). Rows
1..R-1 are lookahead windows of W tokens each, k image rows below the frontier and W columns
to its left (what the released code's row-below holds in steady state: a row's window ends
where the committed part of the row above ends), so row k's first token has image index

    s_k = root + k * stride,   stride = max(grid - W, W)

("root" = the frontier root's image index, count - 1). A lookahead row commits nothing: its
forward's predictions p at s_k .. s_k + W - 1 redraft the image's draft canvas at
s_k + 1 .. s_k + W (argmax with --greedy, else a sample of p), and the frontier window takes
its fresh positions (those past its previous window) from the canvas where a lookahead row
has written them, from the `init` prior elsewhere, always with a one-hot q. A one-hot q is the
exact law of a draft given the draft, and the canvas noise is drawn before the acceptance
uniforms it meets, so acceptance stays exact: greedy output equals AR token for token and
sampled output has AR's law.

Attention in the one forward (T = W + (R - 1) W nodes): the frontier chain is causal over
itself; row k sees the committed context (the cache), the root, and its own earlier nodes;
no row sees another row's drafts (the released code's row-causal mask, which hides earlier
rows' windows from later ones). Positions are the image positions (raster order). Everything
is fixed-shape: the lookahead rows' tokens, positions and mask are preallocated buffers, so
the draft, verify and accept steps are captured like sjd's.

The released code's own acceptance (later rows commit their accepted prefix, ahead of the
raster frontier, into a KV cache ordered by rows) is described in docs/methods.md; it needs a
cache that holds tokens out of raster order and is not built here.
"""

from __future__ import annotations

import torch

from runtime.core.jacobi import JacobiPolicy
from runtime.core.rng import gumbel_from_uniform, token_from_uniform
from runtime.core.state import DraftView, LookaheadRows
from runtime.core.tree import TreeBuffers, chain_tree, static_buffers

# keyed-noise stream of the canvas prior (jacobi.py uses 1 and 2)
PRIOR_STREAM = 3


class PJDPolicy(JacobiPolicy):
    """The `pjd` drafting policy: sjd's frontier window plus R - 1 lookahead rows."""


    def build_tree(self, device: torch.device) -> TreeBuffers:
        spec = self.config.spec
        self.window = spec.pjd_window - 1  # drafts after the root: the row's W tokens, root included
        self.rows_ahead = spec.pjd_rows - 1
        self.spine_nodes = list(range(self.window + 1))
        return static_buffers(chain_tree(self.window)).to(device)

    @property
    def extra(self) -> int:
        """Lookahead nodes verified after the tree: (R - 1) rows of W."""
        return self.rows_ahead * (self.window + 1)

    def bind(self, view: DraftView, committed: int) -> None:
        super().bind(view, committed)
        cfg, dev, w1 = self.config, self.config.device, self.window + 1
        s, b, e = cfg.num_tokens, cfg.batch, self.extra
        grid = cfg.target.row_width
        stride = max(grid - w1, w1)
        row = torch.arange(1, self.rows_ahead + 1, device=dev).repeat_interleave(w1)  # (E,) row k of each node
        col = torch.arange(w1, device=dev).repeat(self.rows_ahead)  # (E,) index within its row
        self.extra_rel = row * stride + col  # (E,) image index - root index
        # canvas: the best guess of every image index (room past the end for rows that run off it)
        self.canvas_len = s + int(self.extra_rel.max()) + 2 if e else s + 1
        self.canvas = torch.zeros(b, self.canvas_len, dtype=torch.long, device=dev)
        self.seen = torch.zeros(b, self.canvas_len, dtype=torch.bool, device=dev)
        self.canvas_ids = torch.arange(self.canvas_len, device=dev)
        self.extra_tokens = torch.zeros(b, e, dtype=torch.long, device=dev)
        self.extra_index = torch.zeros(b, e, dtype=torch.long, device=dev)  # image index of each node
        self.extra_offset = torch.zeros(b, e, dtype=torch.long, device=dev)  # its position - the root's
        self.extra_p = torch.zeros(b, e, cfg.vocab, device=dev)
        # the verify forward's mask over [tree (N+1), lookahead rows (E)]
        n1, t = self.window + 1, self.window + 1 + e
        mask = torch.zeros(t, t, dtype=torch.bool, device=dev)
        mask[:n1, :n1] = self.tree.ancestor_mask
        same_row = row[:, None] == row[None, :]
        mask[n1:, n1:] = same_row & (col[None, :] <= col[:, None])
        mask[n1:, 0] = True  # the root: the last committed token, whose KV this forward computes
        self.verify_mask = mask

    def lookahead(self) -> LookaheadRows | None:
        if not self.extra:
            return None
        return LookaheadRows(tokens=self.extra_tokens, offset=self.extra_offset, mask=self.verify_mask, p=self.extra_p)

    def start(self, i: int, rows: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor,
              cond_mask: torch.Tensor | None) -> None:
        super().start(i, rows, hidden, first, cond_mask)
        self.seen[i] = False

    def _canvas_prior(self, index: torch.Tensor) -> torch.Tensor:
        """A token for image indices nothing has proposed yet: uniform, keyed by the index."""
        u = self.view.rng.keyed_uniform(index, stream=PRIOR_STREAM)
        return token_from_uniform(u, self.config.vocab)

    def _prior(self, redraft: torch.Tensor, stale: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Fresh frontier positions: the lookahead rows' proposal where there is one, else `init`."""
        prior = super()._prior(redraft, stale, noise)
        index = (self.view.count[:, None] - 1 + self.node_ids).clamp(max=self.canvas_len - 1)
        return torch.where(self.seen.gather(1, index), self.canvas.gather(1, index), prior)

    def draft(self) -> None:
        """sjd's frontier window, then the lookahead rows' inputs from the canvas."""
        super().draft()
        if not self.extra:
            return
        cfg, view = self.config, self.view
        root = view.count[:, None] - 1
        index = (root + self.extra_rel).clamp(max=self.canvas_len - 1)  # (B, E)
        self.extra_index.copy_(index)
        # positions stay inside the image (a row past the end proposes for nothing)
        self.extra_offset.copy_(index.clamp(max=cfg.num_tokens - 1) - root)
        known = self.seen.gather(1, index)
        self.extra_tokens.copy_(torch.where(known, self.canvas.gather(1, index), self._canvas_prior(index)))

    def committed(self, path: torch.Tensor, n: torch.Tensor, block: torch.Tensor) -> None:
        """After acceptance: the lookahead rows' predictions redraft the canvas."""
        super().committed(path, n, block)
        if not self.extra:
            return
        cfg, view, b, e = self.config, self.view, self.config.batch, self.extra
        p = self.extra_p
        if cfg.params.greedy:
            proposal = p.argmax(-1)
        else:
            proposal = torch.argmax(torch.log(p) + gumbel_from_uniform(view.rng.uniform(b, e, cfg.vocab)), -1)
        target = (self.extra_index + 1).clamp(max=self.canvas_len - 1)
        self.canvas.scatter_(1, target, proposal)
        self.seen.scatter_(1, target, torch.ones_like(target, dtype=torch.bool))
