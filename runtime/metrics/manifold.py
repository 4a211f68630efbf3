"""Improved precision and recall (Kynkaenniemi et al. 2019) of feature sets, without torch-fidelity.

Each set's manifold is the union of balls around its points, a point's radius being the distance
to its k-th nearest neighbour in its own set (k = 3, as torch-fidelity and ADM's evaluator use).
Precision is the fraction of generated points inside the real manifold (how many images look
real); recall the fraction of real points inside the generated one (how much of the real variety
is covered). `runtime eval` computes them on Inception features through torch-fidelity; this
module serves feature sets torch-fidelity is not needed for (the demo classifier's).
"""

from __future__ import annotations

import numpy as np
import torch

K = 3


def radii(feats: torch.Tensor, k: int = K) -> torch.Tensor:
    """(N,) distance of each of feats (N, F) to its k-th nearest other point of feats."""
    d = torch.cdist(feats, feats)
    return d.kthvalue(k + 1, dim=1).values  # the 0 to itself is the first


def coverage(points: torch.Tensor, centres: torch.Tensor, centre_radii: torch.Tensor) -> float:
    """Fraction of points (N, F) within some centre's ball (centres (M, F), radii (M,))."""
    inside = (torch.cdist(points, centres) <= centre_radii[None, :]).any(1)
    return float(inside.double().mean())


def precision_recall(gen: np.ndarray, real: np.ndarray, k: int = K,
                     real_radii: torch.Tensor | None = None) -> tuple[float, float]:
    """(precision, recall) of generated features gen (N, F) against real features real (M, F);
    `real_radii`: `radii(real, k)` when the caller computes it once for many generated sets."""
    if min(len(gen), len(real)) <= k:
        raise ValueError(f"precision / recall with k = {k} need more than {k} points per set, got "
                         f"{len(gen)} generated and {len(real)} real")
    g = torch.from_numpy(np.asarray(gen, dtype=np.float64))
    r = torch.from_numpy(np.asarray(real, dtype=np.float64))
    rr = radii(r, k) if real_radii is None else real_radii
    return coverage(g, r, rr), coverage(r, g, radii(g, k))
