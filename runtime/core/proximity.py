"""Latent proximity: each code's nearest codebook neighbours, built once and cached on disk.

LANTERN's proximity set for a draft x is a prefix of x's k nearest codebook entries (L2 over
the codebook vectors, x itself excluded). The table depends only on the codebook, so it is
computed once, stored under the cache directory keyed by a SHA-256 of the codebook bytes and
k, and reused; a changed codebook hashes differently and is rebuilt.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch

from runtime.utils.cache_dirs import cache_root, root_is_chosen
from runtime.utils.errors import FILE_FAULTS, UserError

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """`$LANTERN_RUNTIME_CACHE` or `~/.cache/lantern-runtime`, subfolder `proximity`."""
    return cache_root() / "proximity"


def codebook_hash(codebook: torch.Tensor) -> str:
    data = codebook.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    shape = "x".join(map(str, codebook.shape)).encode()
    return hashlib.sha256(shape + b"|" + data).hexdigest()[:24]


def compute_neighbours(codebook: torch.Tensor, k: int, chunk: int = 2048) -> torch.Tensor:
    """(V, k) long: for each code, the k nearest other codes by L2 distance, nearest first.

    Ties are broken by code index (stable), so the table is deterministic.
    """
    cb = codebook.detach().to("cpu", torch.float32)
    v = cb.size(0)
    if not 1 <= k < v:
        raise ValueError(f"k must be in [1, {v - 1}], got {k}")
    rows = []
    for start in range(0, v, chunk):
        block = cb[start:start + chunk]
        dist = torch.cdist(block, cb)  # (c, V)
        dist[torch.arange(block.size(0)), torch.arange(start, start + block.size(0))] = float("inf")
        order = torch.sort(dist, dim=1, stable=True).indices[:, :k]
        rows.append(order)
    return torch.cat(rows, 0)


def _cache_writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return True
    except OSError as err:
        _cache_fault(directory, err)
        return False


def _cache_fault(directory: Path, err: OSError) -> None:
    """A cache the user chose (LANTERN_RUNTIME_CACHE) must work; the default one is only an
    optimisation, so its fault is a warning and the table is rebuilt next run."""
    if root_is_chosen():
        raise UserError(f"LANTERN_RUNTIME_CACHE={os.environ['LANTERN_RUNTIME_CACHE']}: cannot write the neighbour "
                        f"cache there ({err.strerror or err}); point it at a writable folder") from None
    logger.warning("neighbour cache not written to %s (%s); it is rebuilt next run", directory, err.strerror or err)


def neighbour_table(codebook: torch.Tensor, k: int, directory: Path | None = None) -> tuple[torch.Tensor, bool]:
    """Cached `compute_neighbours`. Returns (table (V, k) long on CPU, built_now)."""
    directory = directory or cache_dir()
    path = directory / f"{codebook_hash(codebook)}_k{k}.npy"
    if path.is_file():
        try:
            return torch.from_numpy(np.load(path).astype(np.int64)), False
        except FILE_FAULTS:
            pass  # a damaged cache file is rebuilt below
    writable = _cache_writable(directory)  # before the work: a bad LANTERN_RUNTIME_CACHE is refused first
    table = compute_neighbours(codebook, k)
    if writable:
        tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
        dtype = np.uint16 if codebook.size(0) <= 65536 else np.int32
        try:
            np.save(tmp, table.numpy().astype(dtype))
            os.replace(tmp, path)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            _cache_fault(directory, err)
    return table, True
