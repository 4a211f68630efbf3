"""Quality against AR on the same seeds: precision / recall by hand, paired differences, the
AR-vs-AR band and the indistinguishable verdict."""

import numpy as np
import pytest

from runtime.demo.quality import DemoScores
from runtime.metrics.intervals import Estimate
from runtime.metrics.manifold import precision_recall, radii
from runtime.tools.quality_budget import band, judge, paired, within, worse_by

import torch


def test_radii_and_precision_recall_by_hand():
    real = np.array([[0.0], [1.0], [2.0], [3.0], [10.0]])
    # k = 1: each real point's radius is the distance to its nearest other point
    assert radii(torch.tensor(real), k=1).tolist() == [1.0, 1.0, 1.0, 1.0, 7.0]
    gen = np.array([[0.5], [2.5], [20.0], [3.2]])
    precision, recall = precision_recall(gen, real, k=1)
    assert precision == pytest.approx(3 / 4)  # 20 lies outside every real ball (10's reaches 17)
    # generated radii (k = 1): 2.0, 0.7, 16.8, 0.7 -> real 0, 1, 2 (by 0.5's ball of 2), 3 (2.5 / 3.2), 10 (20's)
    assert recall == pytest.approx(1.0)
    with pytest.raises(ValueError, match="more than 3 points"):
        precision_recall(gen[:3], real)


def scores(hits, seed=0, shift=0.0, n_real=200):
    rng = np.random.default_rng(seed)
    n = len(hits)
    return DemoScores(np.asarray(hits, dtype=bool), rng.normal(shift, 1.0, (n, 4)),
                      np.random.default_rng(99).normal(0.0, 1.0, (n_real, 4)))


def test_paired_difference_of_a_set_with_itself_is_zero():
    s = scores([True, False] * 40)
    vs = paired(s, s, reps=30)
    assert set(vs) == {"class_accuracy", "fd", "precision", "recall"}
    for e in vs.values():
        assert e.value == 0 and e.lo == 0 and e.hi == 0


def test_paired_difference_sees_a_worse_set():
    ar = scores([True] * 60 + [False] * 20, seed=1)
    worse = scores([True] * 30 + [False] * 50, seed=1, shift=1.5)  # fewer hits, features moved off the real ones
    vs = paired(worse, ar, reps=50)
    assert vs["class_accuracy"].value == pytest.approx(-30 / 80) and vs["class_accuracy"].hi < 0
    assert vs["fd"].value > 0 and vs["fd"].lo > 0
    with pytest.raises(ValueError, match="equal sets"):
        paired(scores([True] * 10), ar)


def test_band_within_and_worse():
    ar_vs_ar = {"class_accuracy": Estimate(0.01, -0.03, 0.05), "fd": Estimate(0.5, -1.0, 2.0)}
    bands = band(ar_vs_ar)
    assert bands == {"class_accuracy": 0.05, "fd": 2.0}
    close = {"class_accuracy": Estimate(-0.04, -0.08, 0.0), "fd": Estimate(1.9, 0.1, 3.0)}
    far = {"class_accuracy": Estimate(-0.06, -0.1, -0.02), "fd": Estimate(-2.5, -4.0, -1.0)}
    assert within(close, bands) and not within(far, bands)
    assert within(far, bands, budget=1.5)
    # lower accuracy past the band is worse; a lower FD past the band is better, not worse
    assert worse_by(far, bands) == {"class_accuracy": -0.06}
    with pytest.raises(ValueError, match="intervals"):
        band({"fd": Estimate(1.0)})


def test_judge_on_the_same_seeds():
    ar = scores([True, False, True, True] * 25, seed=2)
    same = judge(ar, ar, {m: 0.01 for m in ar.metrics}, reps=20)
    assert same.indistinguishable and same.n == 100 and not same.worse
    assert set(same.to_dict()) == {"n", "figures", "vs_ar", "indistinguishable", "worse"}
