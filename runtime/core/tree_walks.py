"""Walks over a verified tree, vectorised on the device: which nodes won, the deepest accepted
path they give, its nodes, and sums along it. acceptance.py's rules call them; every loop has a
bound fixed by the tree's shape, so a step using them can be captured as a graph.

Shapes: x (B, N+1) per node; weights (N+1, N+1) or batched (B, N+1, N+1) row masks of the tree
(ancestor / sibling relations); a `Walk` holds the accepted path (B, D+1), its count (B,), the
node that ends it, the nodes on it and the commit gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.core.tree import TreeBuffers


def per_node(weights: torch.Tensor, x: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
    """(B, N+1): row i of `weights` ((N+1, N+1) or batched (B, N+1, N+1)) applied to x (B, N+1)."""
    if not tree.batched:
        return x @ weights.T
    return torch.bmm(weights, x[..., None]).squeeze(-1)


def sibling_sum(x: torch.Tensor, tree: TreeBuffers, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """(B, N+1) float -> (B, N+1): the sum of x over each node's earlier siblings."""
    return per_node(weights[1], x, tree)


@dataclass
class Walk:
    """The accepted path found from per-node outcomes (see `walk`)."""
    best: torch.Tensor  # (B,) the deepest node whose path was accepted
    count: torch.Tensor  # (B,) accepted nodes including the root: depth(best) + 1
    path: torch.Tensor  # (B, D+1) path_table row of best
    on_path: torch.Tensor  # (B, N+1) float 1 for best and its ancestors, the root excepted
    commit: torch.Tensor | None = None  # (B, D+1) `SharedWalk` commit row of best (shared trees)
    stage_position: torch.Tensor | None = None  # (B,) best's place in the stage order (shared trees)


def walk(won: torch.Tensor, tree: TreeBuffers, rows: torch.Tensor, weights: tuple[torch.Tensor, ...],
          tie: torch.Tensor | None = None) -> Walk:
    """won (B, N+1) float 1/0: node i's own test passed (the root's entry must be 1);
    weights: `tree.walk_weights()`.

    The accepted path ends at the deepest node whose every ancestor, itself included, won
    (the lowest index among equals): a node's count of winning ancestors equals its depth + 1.
    tie: (B, N+1) float in [0, 1), the preference among equally deep nodes instead (higher
    wins; `reference_row_order`).
    """
    anc, _, depth1 = weights
    return deepest_walk(per_node(anc, won, tree) == depth1, tree, rows, weights, tie)


def first_wins_walk(passed: torch.Tensor, tree: TreeBuffers, rows: torch.Tensor,
                     weights: tuple[torch.Tensor, ...]) -> Walk:
    """The walk of sibling stages: passed (B, N+1) float 1/0, node i's own test passed (the
    root's entry is not read). A node wins when it passed and no earlier sibling did (stage s
    is only reached after stages 0..s-1 rejected); the path ends at the deepest node whose
    every ancestor won, as `walk`. A shared tree folds the sibling condition into the walk's
    matmul (`SharedWalk.first_win`)."""
    shared = tree.shared_walk()
    if shared is None:
        won = passed * (sibling_sum(passed, tree, weights) == 0)
        won[:, 0] = 1.0
        return walk(won, tree, rows, weights)
    return deepest_walk(passed @ shared.first_win.T == shared.depth, tree, rows, weights)


def deepest_walk(full: torch.Tensor, tree: TreeBuffers, rows: torch.Tensor, weights: tuple[torch.Tensor, ...],
             tie: torch.Tensor | None = None) -> Walk:
    """The walk's end among the nodes whose whole path was accepted (full (B, N+1) bool): the
    deepest, the lowest index among equals (or the highest `tie`)."""
    anc, _, depth1 = weights
    if tie is None:
        best = (full * depth1).argmax(-1)  # first of the deepest
    else:
        best = (full * (depth1 + tie)).argmax(-1)
    return walk_ending_at(best, tree, rows, weights)


def walk_ending_at(best: torch.Tensor, tree: TreeBuffers, rows: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> Walk:
    """The walk whose path ends at node best (B,) long."""
    anc, _, depth1 = weights
    shared = tree.shared_walk()
    if shared is not None:  # one row per image holds the path, the commit row, the count and more
        row = shared.rows[best]
        return Walk(best, shared.count(row), shared.path(row), shared.drafts_on_path[best],
                     shared.commit(row), shared.stage_position(row))
    on_path = anc[rows, best]
    on_path[:, 0] = 0.0
    return Walk(best, depth1[rows, best], tree.path_table[rows, best], on_path)


def reference_row_order(tree: TreeBuffers, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """(B, N+1) float in [0, 1): how early each node's first verification row comes in the
    reference code's greedy walk over a dynamic tree, higher = earlier.

    The reference verifies one row per leaf, leaves in node order, and among rows whose
    accepted prefix is equally long commits the first (`argmax` over row lengths). The node
    committed at depth d is therefore the accepted depth-d node whose subtree holds the
    lowest-numbered leaf. Static trees are verified in lexicographic row order, where that
    node is the lowest-numbered one, which `walk` picks without this key.
    """
    anc = weights[0]  # (B, N+1, N+1): [i, j] = j is i or an ancestor of i
    n1 = anc.size(-1)
    leaf = (tree.children[..., 0] < 0).to(anc.dtype)  # (B, N+1)
    index = torch.arange(n1, device=anc.device, dtype=anc.dtype)
    # first leaf below each node j: the lowest i with anc[i, j] among leaves (n1 where none)
    first_leaf = torch.where(anc * leaf[..., None] > 0, index[:, None], float(n1)).amin(-2)
    return (n1 - first_leaf) / (n1 + 1)


def path_sum(x: torch.Tensor, w: Walk) -> torch.Tensor:
    """(B,): x (B, N+1) float summed over the accepted drafts (best and its ancestors but the
    root), one bmm."""
    return torch.bmm(x[:, None, :], w.on_path[:, :, None].to(x.dtype)).view(-1)
