"""Uncertainty of bench figures: bootstrap intervals and noise-aware comparisons.

A bench times every image of a workload in every repeat, so each method has a latency matrix
(repeats, images). Its throughput figure is the workload's total time; a speedup is AR's total
over the method's, both from the same run. Two sources of noise enter: the repeats (the
machine: other processes, clocks, caches) and the images (which images the workload drew:
some take more iterations than others). The bootstrap resamples both: repeats with
replacement, and images with replacement, the same image indices for the two methods (an
image's AR and method latencies are paired). An image's latency is its share of the run (the
time since the image completed before it), so at a batch size above 1, where images share every
step, one image of a batch carries the batch's time and the others almost none: those shares are
not independent draws, and the bootstrap resamples the repeats only (`images_independent=False`).

    speedup_interval(ar, method)       -> Interval(point, low, high)
    tau_interval(tokens, forwards)     -> Interval over images
    compare(a, b)                      -> "within noise", or the interval of the ratio a / b

The coverage of these 95 % intervals is tested on synthetic timings with known noise
(tests/test_bench_stats.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

LEVEL = 0.95
DRAWS = 2000


@dataclass(frozen=True)
class Interval:
    """A point estimate and its 95 % bootstrap interval."""

    point: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def text(self, fmt: str = "{:.2f}", unit: str = "") -> str:
        return f"{fmt.format(self.point)}{unit} [{fmt.format(self.low)}, {fmt.format(self.high)}]"

    def to_dict(self) -> dict[str, float]:
        return {"point": self.point, "low": self.low, "high": self.high}


def _matrix(samples: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    m = np.asarray(samples, dtype=float)
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"expected latencies as (repeats, images), got shape {m.shape}")
    return m


def _quantiles(values: np.ndarray) -> tuple[float, float]:
    low, high = np.quantile(values, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(low), float(high)


def _speedup(ar: np.ndarray, method: np.ndarray) -> float:
    return float(ar.sum(1).mean() / method.sum(1).mean())


def _resampled_totals(m: np.ndarray, reps: np.ndarray, imgs: np.ndarray | None) -> np.ndarray:
    """(draws,) mean-over-repeats total time of each bootstrap draw.

    reps (draws, R) and imgs (draws, I) are indices drawn with replacement; imgs None keeps every
    image (the repeats alone are resampled). A plain bootstrap's
    spread is that of the sample, sqrt((n - 1) / n) of the population's, which matters with the
    3-5 repeats a bench runs; each level's deviation is widened by sqrt(n / (n - 1)) (the
    usual small-sample correction of the bootstrap variance) before the next level is drawn."""
    n_rep, n_img = m.shape
    widen_img = np.sqrt(n_img / (n_img - 1)) if n_img > 1 else 1.0
    widen_rep = np.sqrt(n_rep / (n_rep - 1)) if n_rep > 1 else 1.0
    full = m.sum(1)  # (R,) each repeat's total over every image
    if imgs is None:
        per_rep = np.broadcast_to(full, (reps.shape[0], n_rep))
    else:
        per_rep = full + widen_img * (m[:, imgs].sum(-1).T - full)  # (draws, R) totals over the drawn images
    mean_all = per_rep.mean(1)
    drawn = np.take_along_axis(per_rep, reps, 1).mean(1)
    return mean_all + widen_rep * (drawn - mean_all)


def speedup_interval(ar: Sequence[Sequence[float]] | np.ndarray, method: Sequence[Sequence[float]] | np.ndarray,
                     *, images_independent: bool = True, draws: int = DRAWS, seed: int = 0) -> Interval:
    """AR's mean total time over the method's, latencies (repeats, images) each, same images.

    The repeats of the two methods are resampled independently (they ran at different times);
    the images are resampled once for both (an image is the same image in both), unless
    `images_independent` is False (a batch above 1: see the module docstring)."""
    a, b = _matrix(ar), _matrix(method)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"AR timed {a.shape[1]} images and the method {b.shape[1]}; they must be the same images")
    point = _speedup(a, b)
    rng = np.random.default_rng(seed)
    ratios = _draws(a, b, rng, draws, images_independent)
    return Interval(float(point), *_quantiles(ratios))


def _draws(a: np.ndarray, b: np.ndarray, rng: np.random.Generator, draws: int, images_independent: bool) -> np.ndarray:
    """(draws,) bootstrap ratios of `a`'s mean total time over `b`'s: repeats drawn per method,
    images (where independent) drawn once for both."""
    imgs = rng.integers(0, a.shape[1], size=(draws, a.shape[1])) if images_independent else None
    ra = rng.integers(0, a.shape[0], size=(draws, a.shape[0]))
    rb = rng.integers(0, b.shape[0], size=(draws, b.shape[0]))
    return _resampled_totals(a, ra, imgs) / _resampled_totals(b, rb, imgs)


def tau_interval(tokens: Sequence[float], forwards: Sequence[float], *, draws: int = DRAWS,
                 seed: int = 0) -> Interval:
    """Tokens per target forward over all images, with images resampled: tokens[i] and
    forwards[i] are image i's."""
    t, f = np.asarray(tokens, dtype=float), np.asarray(forwards, dtype=float)
    if t.shape != f.shape or t.ndim != 1 or t.size == 0:
        raise ValueError("tokens and forwards must be equal-length, non-empty, one value per image")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, t.size, size=(draws, t.size))
    return Interval(float(t.sum() / f.sum()), *_quantiles(t[idx].sum(1) / f[idx].sum(1)))


@dataclass(frozen=True)
class Comparison:
    """Run a over run b: the ratio of their speedups with its interval, and whether it is noise."""

    ratio: Interval
    within_noise: bool

    def text(self) -> str:
        if self.within_noise:
            return f"within noise (ratio {self.ratio.text('{:.3f}')} includes 1)"
        return f"{self.ratio.point:.3f}x [{self.ratio.low:.3f}, {self.ratio.high:.3f}]"


def compare(ar_a: np.ndarray, method_a: np.ndarray, ar_b: np.ndarray, method_b: np.ndarray, *,
            images_independent: tuple[bool, bool] = (True, True), draws: int = DRAWS, seed: int = 0) -> Comparison:
    """Speedup of run a over speedup of run b, each from its own (repeats, images) latencies.

    The two runs are independent (other repeats, maybe other machines), so each is
    bootstrapped on its own and the ratio's interval combines both noises. Only a ratio whose
    interval excludes 1 is a difference to explain. `images_independent`: per run, as in
    :func:`speedup_interval`."""
    rng = np.random.default_rng(seed)
    a_draws = _draws(_matrix(ar_a), _matrix(method_a), rng, draws, images_independent[0])
    b_draws = _draws(_matrix(ar_b), _matrix(method_b), rng, draws, images_independent[1])
    point = _speedup(_matrix(ar_a), _matrix(method_a)) / _speedup(_matrix(ar_b), _matrix(method_b))
    ratios = a_draws / b_draws
    interval = Interval(float(point), *_quantiles(ratios))
    return Comparison(interval, interval.contains(1.0))
