"""Image-quality measures for the demo model: class accuracy and a Frechet distance.

Both use the demo bundle's classifier (`runtime.demo.classifier.DemoClassifier`): accuracy is
the fraction of generated images the classifier assigns to the class they were generated
for; the Frechet distance (FD) compares Gaussian fits of the classifier's penultimate features
of the generated images and of real dataset images (seed `EVAL_SEED`, never used in training),
as FID does with Inception features. FD is biased upward for small sample counts, so compare
values only at equal `n` and `n_real`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runtime.demo.classifier import DemoClassifier
from runtime.demo.dataset import EVAL_SEED, NUM_CLASSES, make_images
from runtime.metrics.frechet import frechet_distance
from runtime.metrics.intervals import Estimate, estimate

if TYPE_CHECKING:
    from runtime.demo.bundle import DemoBundle

DEFAULT_N_REAL = 1200
_BATCH = 256


@torch.no_grad()
def classify(classifier: DemoClassifier, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Predictions (N,) int64 and features (N, F) float64 of uint8 images (N, H, W, 3)."""
    classifier.eval()
    param = next(classifier.parameters())
    preds, feats = [], []
    for start in range(0, len(images), _BATCH):
        x = DemoClassifier.from_uint8(images[start:start + _BATCH]).to(param.device, param.dtype)
        f = classifier.features(x)
        preds.append(classifier.head(f).argmax(-1).cpu().numpy())
        feats.append(f.double().cpu().numpy())
    if not preds:
        return np.zeros(0, dtype=np.int64), np.zeros((0, classifier.config.feature_dim))
    return np.concatenate(preds).astype(np.int64), np.concatenate(feats)


def class_accuracy(classifier: DemoClassifier, images: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of uint8 images (N, H, W, 3) that `classifier` assigns to `labels` (N,)."""
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(images) != len(labels):
        raise ValueError(f"class_accuracy: {len(images)} images but {len(labels)} labels")
    if len(labels) == 0:
        raise ValueError("class_accuracy: no images")
    preds, _ = classify(classifier, images)
    return float((preds == labels).mean())


_REAL_CACHE: dict[tuple[int, int], np.ndarray] = {}


def real_features(classifier: DemoClassifier, n_real: int = DEFAULT_N_REAL) -> np.ndarray:
    """Classifier features (n_real, F) of real images: samples 0..n_real-1 of seed EVAL_SEED
    (class-balanced by construction). Cached per classifier object."""
    key = (id(classifier), n_real)
    if key not in _REAL_CACHE:
        images, _ = make_images(EVAL_SEED, np.arange(n_real))
        _REAL_CACHE.clear()  # one entry: a bundle's classifier per process is the common case
        _REAL_CACHE[key] = classify(classifier, images)[1]
    return _REAL_CACHE[key]


def evaluate_images(bundle: "DemoBundle", images_uint8: np.ndarray, labels: np.ndarray,
                    n_real: int = DEFAULT_N_REAL) -> dict[str, Any]:
    """Class accuracy and FD of generated images against real dataset images.

    images_uint8: (N, 64, 64, 3); labels: (N,) the class each image was generated for.
    Returns {"class_accuracy", "fd", "n", "n_real"}.
    """
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(images_uint8) != len(labels):
        raise ValueError(f"evaluate_images: {len(images_uint8)} images but {len(labels)} labels")
    if len(labels) < 2:
        raise ValueError("evaluate_images: need at least 2 images for a Frechet distance")
    if labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise ValueError(f"evaluate_images: labels must be class ids in [0, {NUM_CLASSES})")
    preds, feats = classify(bundle.classifier, images_uint8)
    fd = frechet_distance(feats, real_features(bundle.classifier, n_real))
    return {"class_accuracy": float((preds == labels).mean()), "fd": fd,
            "n": int(len(labels)), "n_real": int(n_real)}


@dataclass
class DemoScores:
    """What a feature extractor says of each generated image: features (N, F) float64 and, with a
    classifier, hits (N,) bool (predicted class == the class it was generated for; None without
    one); `real` the real images' features (n_real, F) the FD and precision / recall compare
    against. The demo classifier's, or Inception's for a user's model (`runtime.tools.quality_budget`)."""

    hits: np.ndarray | None
    features: np.ndarray
    real: np.ndarray
    # torch copies of real and features, and the real images' k-NN radii: made on first use
    _real: Any = field(default=None, repr=False)
    _gen: Any = field(default=None, repr=False)
    _real_radii: Any = field(default=None, repr=False)

    @property
    def metrics(self) -> tuple[str, ...]:
        """The figures these scores give, in report order."""
        return (("class_accuracy",) if self.hits is not None else ()) + ("fd", "precision", "recall")

    def accuracy(self, idx: np.ndarray) -> float:
        if self.hits is None:
            raise ValueError("class accuracy needs a classifier's verdicts")
        return float(self.hits[idx].mean())

    def fd(self, idx: np.ndarray) -> float:
        return frechet_distance(self.features[idx], self.real)

    def precision_recall(self, idx: np.ndarray) -> tuple[float, float]:
        """Precision of the images at `idx` (repeats counted) against the real manifold; recall of
        the real images against the manifold of the distinct images at `idx` (a repeated image
        adds no cover, and counted twice it would shrink its own radius to 0)."""
        from runtime.metrics.manifold import coverage, radii

        if self._real_radii is None:
            self._real = torch.from_numpy(np.asarray(self.real, dtype=np.float64))
            self._gen = torch.from_numpy(np.asarray(self.features, dtype=np.float64))
            self._real_radii = radii(self._real)
        distinct = self._gen[np.unique(idx)]
        return (coverage(self._gen[idx], self._real, self._real_radii),
                coverage(self._real, distinct, radii(distinct)))

    def figures(self, idx: np.ndarray) -> dict[str, float]:
        """Every figure (`metrics`) of the images at `idx`."""
        out = {"class_accuracy": self.accuracy(idx)} if self.hits is not None else {}
        out["fd"] = self.fd(idx)
        out["precision"], out["recall"] = self.precision_recall(idx)
        return out


def demo_scores(bundle: "DemoBundle", images_uint8: np.ndarray, labels: np.ndarray,
                n_real: int = DEFAULT_N_REAL) -> DemoScores:
    """Per-image classifier verdicts and features of uint8 images (N, 64, 64, 3) generated for `labels` (N,)."""
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    preds, feats = classify(bundle.classifier, images_uint8)
    return DemoScores(preds == labels, feats, real_features(bundle.classifier, n_real))


def demo_quality(scores: DemoScores, reps: int = 20, seed: int = 0) -> dict[str, Estimate]:
    """Class accuracy and FD with 95% bootstrap intervals over the generated images."""
    n = len(scores.hits)
    return {"class_accuracy": estimate(scores.accuracy, n, reps, seed), "fd": estimate(scores.fd, n, reps, seed)}


def demo_quality_vs(scores: DemoScores, base: DemoScores, reps: int = 20, seed: int = 0) -> dict[str, Estimate]:
    """Paired differences to `base` (AR on the same seeds and classes): class accuracy and FD of
    this run minus the base's, resampling the same images of both."""
    n = len(scores.hits)
    if len(base.hits) != n:
        raise ValueError(f"demo_quality_vs: {n} images against {len(base.hits)} base images")
    return {"class_accuracy_vs_ar": estimate(lambda i: scores.accuracy(i) - base.accuracy(i), n, reps, seed),
            "fd_vs_ar": estimate(lambda i: scores.fd(i) - base.fd(i), n, reps, seed)}
