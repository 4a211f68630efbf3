"""Bootstrap intervals over images: the spread of a quality figure under resampling its images.

A figure (accuracy, FID, ...) is computed once on all N images; `bootstrap` gives `reps` index
resamples (N draws with replacement, a fixed seed, so intervals repeat), and `Estimate.of` keeps
the point value with the 2.5 / 97.5 percentiles of the figure over the resamples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95


def bootstrap(n: int, reps: int, seed: int = 0) -> list[np.ndarray]:
    """`reps` resamples of range(n): each an (n,) int64 index array drawn with replacement."""
    rng = np.random.default_rng([seed, n, 0x1A7E])
    return [rng.integers(0, n, size=n) for _ in range(max(reps, 0))]


@dataclass(frozen=True)
class Estimate:
    """A figure and its 95% bootstrap interval (lo, hi: None when no resamples were drawn)."""

    value: float
    lo: float | None = None
    hi: float | None = None

    @classmethod
    def of(cls, value: float, replicates: Sequence[float]) -> Estimate:
        if len(replicates) == 0:
            return cls(float(value))
        tail = (1 - LEVEL) / 2 * 100
        lo, hi = np.percentile(np.asarray(replicates, dtype=np.float64), [tail, 100 - tail])
        return cls(float(value), float(lo), float(hi))

    def to_dict(self) -> dict[str, float | None]:
        return {"value": self.value, "lo": self.lo, "hi": self.hi}

    def text(self, fmt: str = ".3f") -> str:
        if self.lo is None or self.hi is None:
            return format(self.value, fmt)
        return f"{self.value:{fmt}} [{self.lo:{fmt}}, {self.hi:{fmt}}]"


def estimate(statistic: Callable[[np.ndarray], float], n: int, reps: int, seed: int = 0) -> Estimate:
    """`statistic(indices)` on all n items, with its interval over `reps` resamples."""
    return Estimate.of(statistic(np.arange(n)), [statistic(idx) for idx in bootstrap(n, reps, seed)])
