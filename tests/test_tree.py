"""Tree presets, user tree files, and the fixed-shape tree buffers."""

import pytest
import torch

from runtime.core.tree import buffers_from_parents, load_tree, preset_names, static_buffers
from runtime.utils.errors import UserError

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast


def test_presets_have_the_documented_shapes():
    expected = {"naive_extend_57": (57, 5, [5, 13, 16, 14, 9]),
                "mc_sim_7b_63": (25, 5, [4, 8, 8, 3, 2]),
                "chain": (5, 5, [1, 1, 1, 1, 1])}
    assert set(expected) <= set(preset_names())
    for name, (nodes, depth, widths) in expected.items():
        tree = load_tree(name)
        assert (tree.num_nodes, tree.max_depth, tree.widths) == (nodes, depth, widths)
    assert load_tree("chain3").paths == ((0,), (0, 0), (0, 0, 0))


def test_buffers_of_a_small_tree_equal_hand_computed_masks(tmp_path):
    # root -> a [0], b [1]; a -> c [0,0], d [0,1]; c -> e [0,0,0]
    f = tmp_path / "t.toml"
    f.write_text("paths = [[0,0,0], [0], [1], [0,1], [0,0]]\n")  # order does not matter
    b = static_buffers(load_tree(str(f)))
    #          root a  b  c  d  e
    mask = [[1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 1]]
    assert b.ancestor_mask.int().tolist() == mask
    assert b.parent.tolist() == [0, 0, 0, 1, 1, 3]
    assert b.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert b.rank.tolist() == [0, 0, 1, 0, 1, 0]
    assert b.children.tolist() == [[1, 2], [3, 4], [-1, -1], [5, -1], [-1, -1], [-1, -1]]
    assert b.path_table.tolist() == [[0, 0, 0, 0], [0, 1, 1, 1], [0, 2, 2, 2],
                                     [0, 1, 3, 3], [0, 1, 4, 4], [0, 1, 3, 5]]


@pytest.mark.parametrize("name", ["naive_extend_57", "mc_sim_7b_63", "chain", "small_12"])
def test_every_preset_mask_is_ancestry_closed(name):
    b = static_buffers(load_tree(name))
    for i in range(b.size):
        row = b.ancestor_mask[i]
        assert row[0] and row[i]
        assert torch.equal(row | b.ancestor_mask[b.parent[i]], row)  # sees what its parent sees
        assert int(row.sum()) == int(b.depth[i]) + 1


def test_device_builder_matches_static_builder():
    tree = load_tree("naive_extend_57")
    b = static_buffers(tree)
    again = buffers_from_parents(b.parent, b.rank, b.max_depth, b.max_children)
    for field in ("ancestor_mask", "depth", "children", "path_table"):
        assert torch.equal(getattr(b, field), getattr(again, field))


def _walked_buffers(parent: list[int], max_depth: int) -> tuple[list, list, list]:
    """Ancestor mask, depth and path table of one tree by walking up in Python."""
    n = len(parent)
    chains = []
    for i in range(n):
        chain = [i]
        while chain[-1] != 0:
            chain.append(parent[chain[-1]])
        chains.append(chain[::-1])  # root first
    mask = [[int(j in chains[i]) for j in range(n)] for i in range(n)]
    depth = [len(c) - 1 for c in chains]
    table = [[c[d] if d < len(c) else i for d in range(max_depth + 1)] for i, c in enumerate(chains)]
    return mask, depth, table


@pytest.mark.parametrize("max_depth", [1, 2, 3, 5, 8])
def test_batched_device_builder_matches_walking_up_each_tree(max_depth):
    g = torch.Generator().manual_seed(max_depth)
    n, b = 24, 6
    parents = torch.zeros(b, n, dtype=torch.long)
    for t in range(b):  # random trees no deeper than max_depth
        depth = [0]
        for i in range(1, n):
            choices = [j for j in range(i) if depth[j] < max_depth]
            parents[t, i] = choices[int(torch.randint(len(choices), (1,), generator=g))]
            depth.append(depth[int(parents[t, i])] + 1)
    rank = torch.zeros_like(parents)
    for t in range(b):
        seen: dict[int, int] = {}
        for i in range(1, n):
            p = int(parents[t, i])
            rank[t, i] = seen.get(p, 0)
            seen[p] = int(rank[t, i]) + 1
    built = buffers_from_parents(parents, rank, max_depth, int(rank.max()) + 1)
    for t in range(b):
        mask, depth, table = _walked_buffers(parents[t].tolist(), max_depth)
        assert built.ancestor_mask[t].int().tolist() == mask
        assert built.depth[t].tolist() == depth
        assert built.path_table[t].tolist() == table


@pytest.mark.parametrize("text, message", [
    ("paths = [[0], [0, 1, 1]]", "has no parent [0, 1]"),
    ("paths = [[0], [0]]", "appears twice"),
    ("paths = [[0], [-1]]", "ranks >= 0"),
    ("paths = []", "non-empty list"),
    ("nodes = [[0]]", "unknown key 'nodes'"),
    ("paths = [[0]", "not valid TOML"),
])
def test_malformed_tree_files_are_rejected_with_one_line(tmp_path, text, message):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(UserError) as err:
        load_tree(str(f))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_tree_names_the_presets():
    with pytest.raises(UserError, match="unknown tree 'nope'.*naive_extend_57"):
        load_tree("nope")
