"""Draft trees: static presets (TOML), user tree files, and the fixed-shape tree buffers.

A tree is a list of node paths; each path lists the drafter's top-k rank chosen at each
depth (`[0, 1]` = rank-1 child of the rank-0 child of the root). Node 0 is the root (the
token the target sampled last); nodes 1..N are the paths sorted by (depth, lexicographic),
so parents always precede children and each depth is a contiguous range.

`TreeBuffers` holds everything the decoding core needs, built once per tree:

    parent          (N+1,)      long  parent node (root points at itself)
    depth           (N+1,)      long  0 for the root
    rank            (N+1,)      long  rank among siblings = which top-k/sample it takes
    ancestor_mask   (N+1, N+1)  bool  [i, j] = j is i or an ancestor of i (tree attention)
    children        (N+1, K)    long  child node with rank r at [i, r], -1 if none
    path_table      (N+1, D+1)  long  [i, d] = ancestor of i at depth d (i itself past depth(i))

The same tensors, built on the device from parent pointers, describe EAGLE-2's dynamic
trees (`buffers_from_parents`), so acceptance and KV commit never care which kind it is. A
batch of images drafting dynamic trees holds one tree per image: every buffer above gains a
leading batch dim B (`TreeBuffers.batched`); a static tree is shared by the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from runtime.config import method_options
from runtime.utils.errors import UserError
from runtime.config.toml_compat import tomllib


@dataclass(frozen=True)
class StaticTree:
    name: str
    paths: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        """Draft nodes, excluding the root."""
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def widths(self) -> list[int]:
        return [sum(1 for p in self.paths if len(p) == d) for d in range(1, self.max_depth + 1)]


def preset_names() -> list[str]:
    root = resources.files("runtime.assets") / "trees"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


# A verified tree is one target forward over all its nodes: beyond these sizes a tree costs more
# than the tokens it can gain, and a mistyped size would only exhaust memory.
MAX_TREE_NODES, MAX_TREE_DEPTH = method_options.MAX_TREE_NODES, method_options.MAX_TREE_DEPTH


def chain_tree(depth: int) -> StaticTree:
    if not 1 <= depth <= MAX_TREE_DEPTH:
        raise UserError(f"chain depth must be in [1, {MAX_TREE_DEPTH}], got {depth}")
    return StaticTree(f"chain{depth}", tuple((0,) * d for d in range(1, depth + 1)))


def load_tree(spec: str) -> StaticTree:
    """A preset name (see `preset_names()`), `chainN`, or a path to a TOML file with `paths`."""
    if spec.startswith("chain") and spec[5:].isdigit():
        return chain_tree(int(spec[5:]))
    if spec in preset_names():
        text = (resources.files("runtime.assets") / "trees" / f"{spec}.toml").read_text()
        return _parse_tree(spec, text, source=f"preset {spec}")
    path = Path(spec)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise UserError(f"tree file {spec} does not exist; give a preset "
                            f"({', '.join(preset_names())}) or a TOML file with `paths = [[0], [1], [0, 0]]`")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"tree file {spec} is not UTF-8 text; a tree file is TOML like "
                            "`paths = [[0], [1], [0, 0]]`") from None
        return _parse_tree(path.stem, text, source=str(path))
    raise UserError(f"unknown tree {spec!r}; choose a preset ({', '.join(preset_names())}), "
                    "chainN, or a TOML file with `paths = [[0], [1], [0, 0]]`")


def _parse_tree(name: str, text: str, source: str) -> StaticTree:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{source}: not valid TOML ({err}); expected `paths = [[0], [1], [0, 0]]`") from None
    unknown = set(data) - {"paths", "description"}
    if unknown:
        raise UserError(f"{source}: unknown key {sorted(unknown)[0]!r} (known: paths, description)")
    raw = data.get("paths")
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{source}: `paths` must be a non-empty list of node paths like [[0], [1], [0, 0]]")
    paths = []
    for i, p in enumerate(raw):
        if (not isinstance(p, list) or not p
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)):
            raise UserError(f"{source}: paths[{i}] = {p!r} must be a non-empty list of ranks >= 0")
        paths.append(tuple(p))
    return validate_paths(name, paths, source)


def validate_paths(name: str, paths: list[tuple[int, ...]], source: str = "tree") -> StaticTree:
    if len(paths) > MAX_TREE_NODES:
        raise UserError(f"{source}: {len(paths)} nodes; a tree has at most {MAX_TREE_NODES} (one target forward "
                        "verifies them all)")
    deepest = max(len(p) for p in paths)
    if deepest > MAX_TREE_DEPTH:
        raise UserError(f"{source}: depth {deepest}; a tree is at most {MAX_TREE_DEPTH} deep")
    seen = set()
    for p in paths:
        if p in seen:
            raise UserError(f"{source}: path {list(p)} appears twice")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise UserError(f"{source}: path {list(p)} has no parent {list(p[:-1])}; every prefix must be listed")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise UserError(f"{source}: path {list(p)} has no sibling {list(p[:-1] + (p[-1] - 1,))}; the ranks "
                            "under a node must run 0, 1, 2, ... (a draft's k-th choice is verified after the earlier ones)")
    ordered = tuple(sorted(paths, key=lambda p: (len(p), p)))
    return StaticTree(name, ordered)


@dataclass
class TreeBuffers:
    parent: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    ancestor_mask: torch.Tensor
    children: torch.Tensor
    path_table: torch.Tensor
    # earlier_sibling (N+1, N+1) bool: [i, j] = j shares i's parent and has a lower rank (the
    # root has no siblings); `earlier_siblings(parent, rank)`
    earlier_sibling: torch.Tensor
    max_depth: int
    max_children: int
    # children_at[d]: most children any node at depth d has (bounds the sibling loop); dynamic
    # trees, whose shape is only known on the device, use max_children everywhere.
    children_at: tuple[int, ...] = ()
    # Static trees only (None for dynamic ones): the layout of sibling stages over parents
    # sorted by child count, see `StageLayout`.
    stages: "StageLayout | None" = None
    # Batched trees refilled in place every iteration (EAGLE-2): the acceptance walk's float
    # buffers (ancestor mask, earlier_sibling, depth + 1), which `buffers_from_parents(out=)`
    # fills as it builds the rest, so acceptance converts nothing. earlier_sibling is then
    # this tuple's float buffer itself.
    walk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not self.children_at:
            self.children_at = (self.max_children,) * self.max_depth
        self._walk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._fold: SharedWalk | None = None
        if not self.batched:
            self.walk_weights()
            self.shared_walk()

    def walk_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ancestor_mask, earlier_sibling) as float32 and depth + 1, for the acceptance walk.

        A shared tree's are built with it and kept (its buffers never change); a batched
        tree's buffers are refilled in place every iteration, so they are built on each call.
        """
        if self.walk is not None:
            return self.walk
        if self.batched:
            return self.ancestor_mask.float(), self.earlier_sibling.float(), self.depth + 1
        walk = getattr(self, "_walk", None)
        if walk is None:
            walk = self._walk = (self.ancestor_mask.float(), self.earlier_sibling.float(), self.depth + 1)
        return walk

    def shared_walk(self) -> "SharedWalk | None":
        """The acceptance walk's tables of a shared tree (`SharedWalk`), None for a batched one."""
        if self.batched:
            return None
        if getattr(self, "_fold", None) is None:
            self._fold = shared_walk(self)
        return self._fold

    @property
    def size(self) -> int:
        """Nodes including the root."""
        return self.parent.size(-1)

    @property
    def batched(self) -> bool:
        """One tree per image (buffers (B, N+1, ...)) rather than one shared tree."""
        return self.parent.dim() == 2

    def per_image(self, b: int) -> "TreeBuffers":
        """Views with a leading batch dim b (a batched tree as it is; a shared one expanded)."""
        if self.batched:
            return self
        def ex(t: torch.Tensor) -> torch.Tensor:
            return t[None].expand(b, *t.shape)

        return TreeBuffers(parent=ex(self.parent), depth=ex(self.depth), rank=ex(self.rank),
                           ancestor_mask=ex(self.ancestor_mask), children=ex(self.children),
                           path_table=ex(self.path_table), earlier_sibling=ex(self.earlier_sibling),
                           max_depth=self.max_depth, max_children=self.max_children,
                           children_at=self.children_at, stages=self.stages)

    def level(self, d: int) -> tuple[int, int]:
        """[start, end) node range of depth d (static trees only: depths are contiguous)."""
        depth = self.depth.tolist()
        idx = [i for i, x in enumerate(depth) if x == d]
        return idx[0], idx[-1] + 1

    def to(self, device: torch.device | str) -> "TreeBuffers":
        return TreeBuffers(parent=self.parent.to(device), depth=self.depth.to(device), rank=self.rank.to(device),
                           ancestor_mask=self.ancestor_mask.to(device), children=self.children.to(device),
                           path_table=self.path_table.to(device), earlier_sibling=self.earlier_sibling.to(device),
                           max_depth=self.max_depth, max_children=self.max_children,
                           children_at=self.children_at,
                           stages=self.stages.to(device) if self.stages is not None else None)


@dataclass(frozen=True)
class SharedWalk:
    """Tables that let the acceptance walk of a shared (static) tree read, per image, one row
    and one matmul (see `runtime.core.acceptance`). D = max depth.

    first_win      (N+1, N+1)      float32  [i, j] = 1 when j (not the root) is i or an
                                            ancestor of i, -1 when j is an earlier sibling of
                                            one of those, else 0: for test outcomes acc in
                                            {0, 1}, (acc @ first_win.T)[i] equals depth[i]
                                            exactly when every node of i's path passed and
                                            none of their earlier siblings did (it is at most
                                            depth[i], and an earlier sibling's pass lowers it)
    depth          (N+1,)          long     the nodes' depths
    drafts_on_path (N+1, N+1)      float32  [i, j] = 1 when j is i or an ancestor of i, the
                                            root excepted: the accepted drafts of a path
    rows           (N+1, 2D + 4)   long     node i's row: its path_table row (D+1), its commit
                                            row (D+1: the path's drafts in order, then the root,
                                            0, repeated; once the root holds the bonus token,
                                            the tokens at these nodes are the committed block),
                                            depth + 1 (the accepted count), and its place in the
                                            stage order (`StageLayout.position`; 0 without stages)
    """

    first_win: torch.Tensor
    depth: torch.Tensor
    drafts_on_path: torch.Tensor
    rows: torch.Tensor

    def path(self, row: torch.Tensor) -> torch.Tensor:
        """The path_table part of rows gathered per image, (B, D+1)."""
        return row[:, : self.width]

    def commit(self, row: torch.Tensor) -> torch.Tensor:
        return row[:, self.width: 2 * self.width]

    def count(self, row: torch.Tensor) -> torch.Tensor:
        return row[:, 2 * self.width]

    def stage_position(self, row: torch.Tensor) -> torch.Tensor:
        return row[:, 2 * self.width + 1]

    @property
    def width(self) -> int:
        return (self.rows.size(1) - 2) // 2


def shared_walk(tree: TreeBuffers) -> SharedWalk:
    """The `SharedWalk` of a shared tree, built from its buffers (once, with the tree)."""
    anc, sib, depth1 = tree.walk_weights()
    first_win = anc - anc @ sib  # ancestors (and i) +1; their earlier siblings -1 (disjoint sets)
    first_win[:, 0] = 0.0  # the root's own test is never read
    drafts = anc.clone()
    drafts[:, 0] = 0.0
    depth = depth1 - 1
    path = tree.path_table
    width = path.size(1)
    steps = torch.arange(width, device=path.device)
    # commit[i, j] = path[i, j + 1] for j < depth(i), else the root
    nxt = torch.cat([path[:, 1:], torch.zeros_like(path[:, :1])], 1)
    commit = torch.where(steps[None] < depth[:, None], nxt, 0)
    position = tree.stages.position if tree.stages is not None else torch.zeros_like(depth)
    rows = torch.cat([path, commit, depth1[:, None], position[:, None].to(path.device)], 1)
    return SharedWalk(first_win, depth, drafts, rows)


@dataclass
class StageLayout:
    """Where each sibling stage of a static tree's acceptance reads and writes.

    Parents are sorted by child count, most first, so the parents that have a child of rank s
    are the first `rows[s]` of that order, for every s: stage s works on a prefix (a view).

    order      (N+1,)      long  node ids sorted by child count (descending, then id)
    position   (N+1,)      long  inverse of `order`: where node i sits in it
    child      (N+1, K)    long  child of rank s of parent order[j] at [j, s]; 0 (the root, a
                                 placeholder never judged) where none
    node_slot  (N+1,)      long  where node i's stage result sits when the stages' results
                                 (rows[0] of stage 0, then rows[1] of stage 1, ...) are
                                 concatenated; 0 for the root
    parent_row (N+1,)      long  position of node i's parent in `order` (0 for the root)
    rows       tuple[int]        parents with more than s children, s = 0..K-1
    """

    order: torch.Tensor
    position: torch.Tensor
    child: torch.Tensor
    node_slot: torch.Tensor
    parent_row: torch.Tensor
    rows: tuple[int, ...]

    def to(self, device: torch.device | str) -> "StageLayout":
        return StageLayout(self.order.to(device), self.position.to(device), self.child.to(device),
                           self.node_slot.to(device), self.parent_row.to(device), self.rows)


def stage_layout(parent: list[int], rank: list[int], k: int) -> StageLayout:
    """The `StageLayout` of a tree given as host lists (node 0 = root, ranks contiguous)."""
    n = len(parent)
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parent[i]].append(i)
    for c in kids:
        c.sort(key=lambda i: rank[i])
    order = sorted(range(n), key=lambda i: (-len(kids[i]), i))
    position = [0] * n
    for j, i in enumerate(order):
        position[i] = j
    rows = tuple(sum(1 for c in kids if len(c) > s) for s in range(k))
    child = [[kids[i][s] if s < len(kids[i]) else 0 for s in range(k)] for i in order]
    start = [sum(rows[:s]) for s in range(k)]
    node_slot = [0] + [start[rank[i]] + position[parent[i]] for i in range(1, n)]
    parent_row = [0] + [position[parent[i]] for i in range(1, n)]
    return StageLayout(torch.tensor(order), torch.tensor(position), torch.tensor(child).view(n, k),
                       torch.tensor(node_slot), torch.tensor(parent_row), rows)


def static_buffers(tree: StaticTree) -> TreeBuffers:
    """Tree buffers of a static tree (CPU; move them with `.to(device)` once)."""
    index: dict[tuple[int, ...], int] = {(): 0}
    for i, p in enumerate(tree.paths, start=1):
        index[p] = i
    parent = torch.tensor([0] + [index[p[:-1]] for p in tree.paths])
    rank = torch.tensor([0] + [p[-1] for p in tree.paths])
    k = max(p[-1] for p in tree.paths) + 1
    buffers = buffers_from_parents(parent, rank, tree.max_depth, k)
    buffers.children_at = tuple(
        max((p[-1] + 1 for p in tree.paths if len(p) == d + 1), default=0) for d in range(tree.max_depth))
    buffers.stages = stage_layout(parent.tolist(), rank.tolist(), k)
    buffers._fold = shared_walk(buffers)  # again: its rows carry the stage positions
    return buffers


def earlier_siblings(parent: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """(..., N+1, N+1) bool: [i, j] = j is a sibling of i with a lower rank; row and column 0
    False. parent, rank: (N+1,) or batched (B, N+1)."""
    not_root = torch.arange(parent.size(-1), device=parent.device) != 0
    same = (parent[..., :, None] == parent[..., None, :]) & not_root[:, None] & not_root[None, :]
    return same & (rank[..., None, :] < rank[..., :, None])


@dataclass(frozen=True)
class TreeConstants:
    """The index constants `buffers_from_parents` needs for trees of N+1 nodes and depth D:
    built once by a caller that rebuilds its tree every iteration (EAGLE-2), so a captured
    step does not make them again.

    ar (N+1,) long 0..N, ar_float the same as float32; eye (N+1, N+1) float32; levels (D+1,)
    long 0..D.
    """

    ar: torch.Tensor
    ar_float: torch.Tensor
    eye: torch.Tensor
    levels: torch.Tensor


def tree_constants(n: int, max_depth: int, device: torch.device | str) -> TreeConstants:
    """`TreeConstants` for trees of n nodes (root included) and depth max_depth."""
    ar = torch.arange(n, device=device)
    return TreeConstants(ar, ar.float(), torch.eye(n, device=device),
                         torch.arange(max_depth + 1, device=device))


def buffers_from_parents(parent: torch.Tensor, rank: torch.Tensor, max_depth: int, max_children: int,
                         earlier_sibling: torch.Tensor | None = None,
                         consts: TreeConstants | None = None, out: TreeBuffers | None = None) -> TreeBuffers:
    """Build every buffer from parent pointers with fixed-shape device ops (no host sync).

    parent: (N+1,) long with parent[0] == 0 and parent[i] < i; rank: (N+1,) rank among
    siblings (< max_children, distinct per parent). Both may carry a leading batch dim B
    (one tree per image; every buffer then has it too). Works on any device and under capture.
    earlier_sibling: the (..., N+1, N+1) buffer if the caller has it (built here otherwise);
    consts: `tree_constants(N+1, max_depth)` if the caller keeps them. out: batched buffers of
    the same shapes to write depth, ancestor mask, children and path table into (each op writes
    its result there, no copies; EAGLE-2 refills its tree in place every iteration); parent,
    rank and earlier_sibling are then taken to be out's own.

    The ancestor mask is the reachability of "self or parent" within max_depth steps, by
    repeated squaring (ceil(log2 max_depth) matrix products instead of max_depth walks up):
    a handful of kernels whatever the depth (EAGLE-2 rebuilds its tree every iteration).
    """
    single = parent.dim() == 1
    if single:
        parent, rank = parent[None], rank[None]
        if earlier_sibling is not None:
            earlier_sibling = earlier_sibling[None]
    b, n = parent.shape
    c = consts if consts is not None else tree_constants(n, max_depth, parent.device)
    ar, levels = c.ar, c.levels
    # reach[i, j] = 1 if j is i or i's parent; squared until it spans max_depth steps
    reach = c.eye.expand(b, n, n).scatter(-1, parent[..., None], 1.0)
    walk = out.walk if out is not None else None
    # where each op writes its result (`out=`): out's buffers, or a new tensor (None)
    anc_out, depth_out, path_out = (out.ancestor_mask, out.depth, out.path_table) if out is not None else (None,) * 3

    span = 1
    while span < max_depth:
        span *= 2
        last = walk is not None and span >= max_depth  # the float ancestor mask the walk reads
        reach = torch.clamp(torch.bmm(reach, reach), max=1.0, out=walk[0] if walk is not None and last else None)
    if walk is not None and max_depth <= 1:
        walk[0].copy_(reach)
    anc = torch.gt(reach, 0, out=anc_out)
    depth1 = torch.sum(anc, -1, out=walk[2] if walk is not None else None)
    depth = torch.sub(depth1, 1, out=depth_out)
    # path_table[i, d] = the ancestor of i at depth d (each depth has one), i itself past depth(i)
    at_depth = (depth[..., None] == levels) * c.ar_float[:, None]  # (B, N+1, D+1): j at column depth(j)
    found = torch.bmm(reach, at_depth).long()  # reach is 0/1, as anc
    path_table = torch.where(levels > depth[..., None], ar[:, None], found, out=path_out)
    # children[parent, rank] = node, for every node but the root
    if out is None:
        flat = torch.full((b, n * max_children), -1, dtype=torch.long, device=parent.device)
    else:
        flat = out.children.view(b, n * max_children).fill_(-1)
    flat.scatter_(1, torch.add(rank[:, 1:], parent[:, 1:], alpha=max_children), ar[1:].expand(b, n - 1))
    children = flat.view(b, n, max_children)
    if out is not None:
        return out
    if single:
        parent, depth, rank, anc, children, path_table = (t[0] for t in (parent, depth, rank, anc, children, path_table))
        earlier_sibling = earlier_sibling[0] if earlier_sibling is not None else None
    if earlier_sibling is None:
        earlier_sibling = earlier_siblings(parent, rank)
    return TreeBuffers(parent=parent, depth=depth, rank=rank, ancestor_mask=anc, children=children,
                       path_table=path_table, earlier_sibling=earlier_sibling, max_depth=max_depth,
                       max_children=max_children)
