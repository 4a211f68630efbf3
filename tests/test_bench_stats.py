"""Bench intervals (issue 20): 95 % intervals cover the truth on synthetic timings with known
noise, and comparisons call a difference only when it lies outside the combined noise."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.bench.stats import compare, speedup_interval, tau_interval

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast


def workload(rng: np.random.Generator, speed: float, repeats: int = 5, images: int = 12, machine: float = 0.08,
             jitter: float = 0.05, spread: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """(AR, method) latencies (repeats, images): images of random difficulty (lognormal
    `spread`), each repeat slowed by a machine factor (`machine`), each timing jittered
    (`jitter`); the method takes 1/speed of AR's time in expectation, so the true speedup is `speed`."""
    difficulty = rng.lognormal(0, spread, images)

    def latencies(scale: float) -> np.ndarray:
        return (scale * difficulty[None] * rng.lognormal(0, machine, (repeats, 1))
                * rng.lognormal(0, jitter, (repeats, images)))

    return latencies(1.0), latencies(1.0 / speed)


@pytest.mark.parametrize("repeats, images", [(5, 12), (10, 12), (5, 4)])
def test_speedup_interval_covers_the_truth_about_95_percent_of_the_time(repeats, images):
    rng = np.random.default_rng(7)
    hits = [speedup_interval(*workload(rng, 2.0, repeats, images), draws=800, seed=k).contains(2.0)
            for k in range(600)]
    assert 0.92 <= np.mean(hits) <= 0.985, np.mean(hits)


def test_interval_narrows_with_more_repeats_and_images():
    rng = np.random.default_rng(3)
    few = speedup_interval(*workload(rng, 1.5, 3, 4))
    many = speedup_interval(*workload(rng, 1.5, 20, 48))
    assert many.high - many.low < (few.high - few.low) / 2
    assert few.low < few.point < few.high


def test_tau_interval_over_images():
    rng = np.random.default_rng(0)
    forwards = rng.integers(60, 90, size=400).astype(float)
    tokens = np.full(400, 256.0)
    truth = 256.0 / 75.0  # forwards uniform on 60..89: mean 74.5; tau = sum tokens / sum forwards
    tau = tau_interval(tokens, forwards)
    assert tau.point == pytest.approx(tokens.sum() / forwards.sum())
    assert tau.low < tau.point < tau.high and abs(tau.point - truth) < 0.05


def test_runs_that_differ_by_less_than_their_noise_are_within_noise():
    rng = np.random.default_rng(11)
    calls = [compare(*workload(rng, 1.8), *workload(rng, 1.8), draws=800, seed=k).within_noise for k in range(300)]
    assert np.mean(calls) >= 0.92  # the same setting twice: "within noise" about 95 % of the time


def test_a_real_difference_is_attributed():
    rng = np.random.default_rng(5)
    result = compare(*workload(rng, 2.0, repeats=10, images=24), *workload(rng, 1.5, repeats=10, images=24))
    assert not result.within_noise
    assert result.ratio.low > 1.0 and result.ratio.point == pytest.approx(2.0 / 1.5, rel=0.1)
    assert "within noise" not in result.text()


def test_malformed_samples_are_refused():
    with pytest.raises(ValueError, match=r"\(repeats, images\)"):
        speedup_interval([1.0, 2.0], [[1.0]])
    with pytest.raises(ValueError, match="same images"):
        speedup_interval([[1.0, 2.0]], [[1.0]])


def test_image_shares_sum_to_the_run_and_follow_completion_order():
    from runtime.generation.pipeline import image_shares

    # images 0..2 complete at 3, 1 and 6 s after a start at 0 (batched: out of order); end at 8
    shares = image_shares({0: 3.0, 1: 1.0, 2: 6.0}, 0.0, 8.0)
    assert shares == pytest.approx([2.0 + 2 / 3, 1.0 + 2 / 3, 3.0 + 2 / 3])
    assert sum(shares) == pytest.approx(8.0)
    assert image_shares({}, 0.0, 1.0) == []


def batched_workload(rng: np.random.Generator, speed: float, repeats: int, images: int = 16, batch: int = 8,
                     machine: float = 0.08, jitter: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(AR, method) per-image shares at batch `batch`, as `image_shares` records them: in each batch
    one image (the first to complete) carries almost the batch's time, the others 1 % each."""
    def latencies(scale: float) -> np.ndarray:
        m = np.zeros((repeats, images))
        for r in range(repeats):
            factor = rng.lognormal(0, machine)
            for first in range(0, images, batch):
                t = scale * factor * rng.lognormal(0, jitter)
                shares = np.full(batch, 0.01 * t)
                shares[0] = t - shares[1:].sum()
                m[r, first:first + batch] = rng.permutation(shares)
        return m

    return latencies(1.0), latencies(1.0 / speed)


@pytest.mark.parametrize("repeats", [5, 10])
def test_in_a_batch_the_repeats_alone_are_resampled_and_the_interval_covers_the_truth(repeats):
    """Shares of a batch are not independent images: resampling them gave intervals below 0
    (a B 8 bench of 16 images: 0.74x [-0.00, 2.62]); resampling the repeats alone covers."""
    rng = np.random.default_rng(7)
    intervals = [speedup_interval(*batched_workload(rng, 2.0, repeats), images_independent=False, draws=800, seed=k)
                 for k in range(600)]
    assert 0.9 <= np.mean([i.contains(2.0) for i in intervals]) <= 0.985
    assert min(i.low for i in intervals) > 1.0
    a, b = batched_workload(np.random.default_rng(1), 2.0, 3)
    assert speedup_interval(a, b).high - speedup_interval(a, b).low > 4 * (
        speedup_interval(a, b, images_independent=False).high - speedup_interval(a, b, images_independent=False).low)


def test_the_report_resamples_images_only_where_both_runs_decoded_one_at_a_time():
    """The committed B 1 / B 8 bench: at B 8 the interval comes from the repeats alone."""
    from pathlib import Path

    from runtime.bench.report.numbers import images_independent, speedup_ci
    from runtime.bench.schema import ar_baseline, load_bench

    runs = load_bench(Path(__file__).parent.parent / "results" / "cpu_serve_auto_graph_sampling.json").runs
    for run in runs:
        ar = ar_baseline(runs, run.params.batch_size)
        assert ar is not None and images_independent(ar, run) == (run.params.batch_size == 1)
        interval = speedup_ci(run, ar)
        assert interval is not None and 0.5 < interval.low <= interval.point <= interval.high < 1.5, interval
