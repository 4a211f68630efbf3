"""Proximity neighbour tables: correct, cached by codebook hash, rebuilt when it changes."""

import pytest
import torch

from runtime.core.proximity import compute_neighbours, neighbour_table

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast


def test_neighbours_are_nearest_first_and_exclude_self():
    cb = torch.tensor([[0.0], [1.0], [3.0], [7.0], [7.5]])
    table = compute_neighbours(cb, 3)
    assert table.tolist() == [[1, 2, 3], [0, 2, 3], [1, 0, 3], [4, 2, 1], [3, 2, 1]]


def test_table_is_cached_and_reused_then_rebuilt_for_a_new_codebook(tmp_path):
    cb = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    first, built = neighbour_table(cb, 10, tmp_path)
    assert built and len(list(tmp_path.glob("*.npy"))) == 1
    again, built = neighbour_table(cb.clone(), 10, tmp_path)
    assert not built and torch.equal(first, again)
    changed = cb.clone()
    changed[3] += 1.0
    other, built = neighbour_table(changed, 10, tmp_path)
    assert built and len(list(tmp_path.glob("*.npy"))) == 2
    assert torch.equal(other, compute_neighbours(changed, 10))


def test_damaged_cache_file_is_rebuilt(tmp_path):
    cb = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    neighbour_table(cb, 5, tmp_path)
    (path,) = tmp_path.glob("*.npy")
    path.write_bytes(b"not a numpy file")
    table, built = neighbour_table(cb, 5, tmp_path)
    assert built and torch.equal(table, compute_neighbours(cb, 5))


def test_neighbours_of_a_gpt_using_fewer_tokens_than_the_codebook_stay_in_its_vocabulary() -> None:
    from types import SimpleNamespace

    from runtime.core import MethodSpec, neighbours_for

    gen = torch.Generator().manual_seed(0)
    codebook = torch.randn(64, 4, generator=gen)
    vq = SimpleNamespace(codebook_vectors=lambda normalized=False: codebook)
    table = neighbours_for(vq, MethodSpec(method="lantern++", lantern_k=5, lantern_lambda=2.0), vocab_size=16)
    assert table.shape == (16, 6) and int(table.max()) < 16  # k + 1 codes: the paper rule clears k + 1
