"""Frechet distance between Gaussian fits of two feature sets (FID's formula, any features)."""

from __future__ import annotations

import numpy as np


def _sqrtm_psd(m: np.ndarray) -> np.ndarray:
    """Square root of a symmetric positive semi-definite matrix; negative round-off eigenvalues
    are clipped to zero."""
    w, v = np.linalg.eigh((m + m.T) / 2)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """Frechet distance between Gaussian fits of two feature sets (N_a, F) and (N_b, F).

    FD = |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a^1/2 S_b S_a^1/2)^1/2).
    The cross term is computed from a symmetric PSD product (rather than sqrtm of the
    non-symmetric S_a S_b, as scipy-based FID code does), so it needs only `eigh` and stays
    real; the two forms have the same trace. Both sets need at least 2 samples.
    """
    a = np.asarray(feats_a, dtype=np.float64)
    b = np.asarray(feats_b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"frechet_distance: feature sets must be (N, F) with equal F, got {a.shape} and {b.shape}")
    if len(a) < 2 or len(b) < 2:
        raise ValueError("frechet_distance: need at least 2 samples in each set")
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root_a = _sqrtm_psd(cov_a)
    cross = _sqrtm_psd(root_a @ cov_b @ root_a)
    fd = float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(cross))
    return max(fd, 0.0)
