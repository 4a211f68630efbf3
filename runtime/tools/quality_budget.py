"""Quality against AR on the same seeds, and when a setting is indistinguishable from AR.

A setting's images are made from the same per-image seeds and classes (or prompts) as an AR run,
so its quality is read as a *paired* difference: every figure of the setting minus AR's, on the
same bootstrap resamples of image indices (`runtime.metrics.intervals`). How large a difference
means anything depends on the sample size; AR against AR on *disjoint* seeds (same classes)
measures it: the **band** of a figure is the larger end, in absolute value, of the 95% interval
of that AR-vs-AR difference. A setting is **indistinguishable from AR** when, for every figure,
its paired difference from AR lies within the band (|difference| <= band); a budget may widen the
band (`budget` times it).

Figures (`DemoScores.metrics`): class accuracy (with a classifier), the Frechet distance of the
features to real images, and improved precision / recall (k = 3) against the same real images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.demo.quality import DemoScores
from runtime.metrics.intervals import Estimate, bootstrap

RESAMPLES = 200
# which way is better, for the docs' "measurably worse" (a worse figure is a positive loss)
HIGHER_IS_BETTER = {"class_accuracy": True, "fd": False, "precision": True, "recall": True}


def paired(scores: DemoScores, base: DemoScores, reps: int = RESAMPLES, seed: int = 0) -> dict[str, Estimate]:
    """Each figure of `scores` minus the same figure of `base` (the same images' indices, N each),
    with its 95% interval over `reps` paired resamples."""
    n = len(scores.features)
    if len(base.features) != n:
        raise ValueError(f"a paired difference needs equal sets: {n} images against {len(base.features)}")

    def diff(idx: np.ndarray) -> dict[str, float]:
        a, b = scores.figures(idx), base.figures(idx)
        return {m: a[m] - b[m] for m in a}

    return _estimates(diff, n, reps, seed)


def own(scores: DemoScores, reps: int = RESAMPLES, seed: int = 0) -> dict[str, Estimate]:
    """Each figure of one set with its 95% interval over `reps` resamples."""
    return _estimates(scores.figures, len(scores.features), reps, seed)


def _estimates(figures: Any, n: int, reps: int, seed: int) -> dict[str, Estimate]:
    point = figures(np.arange(n))
    draws = [figures(i) for i in bootstrap(n, reps, seed)]
    return {m: Estimate.of(v, [d[m] for d in draws]) for m, v in point.items()}


def band(ar_vs_ar: dict[str, Estimate]) -> dict[str, float]:
    """The AR-vs-AR band of each figure: max(|lo|, |hi|) of its paired difference's interval."""
    out = {}
    for m, e in ar_vs_ar.items():
        if e.lo is None or e.hi is None:
            raise ValueError("the AR-vs-AR band needs intervals: resample (reps > 0)")
        out[m] = max(abs(e.lo), abs(e.hi))
    return out


def within(vs_ar: dict[str, Estimate], bands: dict[str, float], budget: float = 1.0) -> bool:
    """Indistinguishable from AR: every figure's paired difference within `budget` times its band."""
    return all(abs(vs_ar[m].value) <= budget * bands[m] for m in bands if m in vs_ar)


def worse_by(vs_ar: dict[str, Estimate], bands: dict[str, float]) -> dict[str, float]:
    """The figures on which a setting is measurably worse than AR (difference past the band, in the
    bad direction): figure -> the difference."""
    out = {}
    for m, e in vs_ar.items():
        if m in bands and abs(e.value) > bands[m]:
            loss = -e.value if HIGHER_IS_BETTER[m] else e.value
            if loss > 0:
                out[m] = e.value
    return out


@dataclass(frozen=True)
class Verdict:
    """One setting's quality against AR: its own figures, the paired differences, and whether it
    is indistinguishable from AR at `n` images (the band it was judged with is the caller's)."""

    n: int
    figures: dict[str, Estimate]
    vs_ar: dict[str, Estimate]
    indistinguishable: bool
    worse: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "figures": {m: e.to_dict() for m, e in self.figures.items()},
                "vs_ar": {m: e.to_dict() for m, e in self.vs_ar.items()},
                "indistinguishable": self.indistinguishable, "worse": self.worse}


def judge(scores: DemoScores, ar: DemoScores, bands: dict[str, float], *, budget: float = 1.0,
          reps: int = RESAMPLES, seed: int = 0) -> Verdict:
    """`scores` against AR's on the same seeds, judged with the AR-vs-AR `bands`."""
    vs = paired(scores, ar, reps, seed)
    return Verdict(len(scores.features), own(scores, reps, seed), vs, within(vs, bands, budget), worse_by(vs, bands))
