"""`runtime tune --quality-budget`: the fastest relaxation whose quality stays within a budget.

Beside the tree search, tune decodes one workload (N images, classes cycled) with AR and with
every candidate relaxation of the tuned tree, all from the same per-image seeds, and judges each
candidate's images against AR's (`runtime.tools.quality_budget`: paired differences of every figure,
judged against the AR-vs-AR band at the same N). The candidates: the exact tree (lambda 1, the
image law is AR's), and every rule x lambda asked for. The choice is the fastest candidate within
`budget` times the band on every figure; the exact tree always competes, so a budget no relaxed
setting meets leaves the exact one.

Features: on the demo, its classifier (class accuracy, FD, precision / recall against real demo
images); on any other class-conditional model, InceptionV3 from local weights (as `runtime eval`
reads them), against a third AR set on its own seeds standing in for the real images (FD,
precision / recall; no classifier, so no accuracy).

Speed: each set is decoded once after an untimed batch that captures the steps, wall time
synchronised; images per second over AR's in the same process. One pass per candidate, so a
speedup here carries the noise of one run: `runtime bench` measures the chosen setting properly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runtime.core import MethodSpec
from runtime.core.rng import derive_seed
from runtime.demo.quality import DemoScores
from runtime.utils.errors import UserError
from runtime.generation.pipeline import decode_tokens, make_decoder, timed_many
from runtime.tools.quality_budget import RESAMPLES, band, judge, paired

if TYPE_CHECKING:
    from backends import Backend


# run seeds of the AR sets beside the candidates' `seed` (disjoint per-image seeds)
BAND_SEED_OFFSET = 100
REFERENCE_SEED_OFFSET = 200


@dataclass(frozen=True)
class Candidate:
    """One setting tried: its rule and lambda (1: exact), images per second and verdict."""

    rule: str
    lantern_lambda: float
    images_per_s: float
    verdict: Any

    def to_dict(self, ar_rate: float) -> dict[str, Any]:
        return {"relax_rule": self.rule, "lantern_lambda": self.lantern_lambda, "images_per_s": self.images_per_s,
                "speedup": self.images_per_s / ar_rate, **self.verdict.to_dict()}


@dataclass(frozen=True)
class QualityChoice:
    """What `quality_search` measured and chose."""

    budget: float
    images: int
    features: str
    ar_images_per_s: float
    band: dict[str, float]
    ar_vs_ar: dict[str, Any]
    candidates: list[Candidate]
    chosen: Candidate
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "images": self.images, "features": self.features,
                "ar_images_per_s": self.ar_images_per_s, "band": self.band,
                "ar_vs_ar": {m: e.to_dict() for m, e in self.ar_vs_ar.items()},
                "candidates": [c.to_dict(self.ar_images_per_s) for c in self.candidates],
                "chosen": self.chosen.to_dict(self.ar_images_per_s), "seconds": self.seconds}


def candidate_specs(spec: MethodSpec, lambdas: Sequence[float], rules: Sequence[str]) -> list[MethodSpec]:
    """The exact tree first, then every rule x lambda (> 1) over the same tree."""
    out = [replace(spec, lantern_lambda=1.0, relax_rule="paper")]
    for rule in rules:
        for lam in lambdas:
            if lam > 1:
                out.append(replace(spec, lantern_lambda=float(lam), relax_rule=rule))
    return out


class Features:
    """Per-image scores of decoded images: the demo classifier's, or Inception's against a reference."""

    def __init__(self, loaded: Any, inception: torch.nn.Module | None) -> None:
        if loaded.bundle is None and inception is None:
            raise UserError("runtime tune --quality-budget on a model other than the demo judges images with "
                            "InceptionV3: give --inception-weights FILE (torch-fidelity's weights, as runtime eval "
                            "takes them)")
        self.loaded, self.inception = loaded, inception
        self.name = "demo classifier" if loaded.bundle is not None else "inception (pool_3)"
        self.reference: np.ndarray | None = None

    @property
    def needs_reference(self) -> bool:
        """Inception scores compare with a reference set of AR images (there are no real ones here)."""
        return self.loaded.bundle is None

    def scores(self, images: np.ndarray, labels: np.ndarray) -> DemoScores:
        if self.loaded.bundle is not None:
            from runtime.demo.quality import demo_scores

            return demo_scores(self.loaded.bundle, images, labels)
        feats = self.pool(images)
        assert self.reference is not None, "set the reference first"
        return DemoScores(None, feats, self.reference)

    def pool(self, images: np.ndarray) -> np.ndarray:
        from runtime.metrics.fidelity import extract

        class _Set:  # the ImageSet protocol over an array
            def __init__(self, arr: np.ndarray) -> None:
                self.arr = arr

            def __len__(self) -> int:
                return len(self.arr)

            def batches(self, size: int):
                for i in range(0, len(self.arr), size):
                    yield self.arr[i:i + size]

        return extract(self.inception, _Set(images)).pool


def quality_search(loaded: Any, spec: MethodSpec, backend: Backend, classes: Sequence[int], *, images: int,
                   budget: float, lambdas: Sequence[float], rules: Sequence[str], batch_size: int, seed: int = 0,
                   inception: torch.nn.Module | None = None, reps: int = RESAMPLES,
                   progress: Callable[[str, int, int], None] | None = None) -> QualityChoice:
    """Decode `images` images (classes cycled) with AR and each candidate of `spec` (lantern++ over
    its tuned tree), judge each against AR, and choose (see the module docstring)."""
    started = time.perf_counter()
    features = Features(loaded, inception)
    labels = np.array([int(classes[i % len(classes)]) for i in range(images)])
    specs = candidate_specs(spec, lambdas, rules)
    ar_spec = MethodSpec(method="ar", sampling=spec.sampling)
    total = len(specs) + 2 + int(features.needs_reference)
    done = [0]

    def decode(s: MethodSpec, run_seed: int) -> tuple[np.ndarray, float]:
        decoder = make_decoder(loaded, s, backend, batch_size=min(batch_size, images), watch_law=False)
        work = [(torch.tensor([int(c)], device=backend.device), None, derive_seed(run_seed, i))
                for i, c in enumerate(labels)]
        tokens, seconds = timed_many(decoder, work, backend)
        rate = len(work) / seconds
        done[0] += 1
        if progress is not None:
            progress(f"quality: {s.method} {s.relax_rule if s.lantern_lambda > 1 else ''} "
                     f"lambda {s.lantern_lambda:g}".replace("  ", " "), done[0], total)
        return decode_tokens(loaded.vq, torch.stack([t.cpu() for t in tokens])), rate

    if features.needs_reference:
        reference, _ = decode(ar_spec, seed + REFERENCE_SEED_OFFSET)
        features.reference = features.pool(reference)
    ar_images, ar_rate = decode(ar_spec, seed)
    band_images, _ = decode(ar_spec, seed + BAND_SEED_OFFSET)
    ar_scores = features.scores(ar_images, labels)
    ar_vs_ar = paired(features.scores(band_images, labels), ar_scores, reps)
    bands = band(ar_vs_ar)
    tried = []
    for s in specs:
        imgs, rate = decode(s, seed)
        tried.append(Candidate(s.relax_rule, s.lantern_lambda, rate,
                               judge(features.scores(imgs, labels), ar_scores, bands, budget=budget, reps=reps)))
    within = [c for c in tried if c.verdict.indistinguishable] or tried[:1]
    chosen = max(within, key=lambda c: c.images_per_s)
    return QualityChoice(budget, images, features.name, ar_rate, bands, ar_vs_ar, tried, chosen,
                         time.perf_counter() - started)
