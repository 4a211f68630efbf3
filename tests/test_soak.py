"""The soak's verdict (synthetic samples) and one short real soak (a `runtime run` child process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.bench.soak import SoakResult, main, rss_mb


def _result(mb_of_t) -> SoakResult:
    samples = [(t / 10, mb_of_t(t / 10)) for t in range(400)]
    return SoakResult(num_images=200, seconds=40.0, samples=samples, command=["runtime"], exit_code=0)


def test_flat_memory_after_warm_up_shows_no_growth() -> None:
    warm = _result(lambda t: 300.0 + min(t, 5.0) * 20)  # +100 MB of caches in the first 5 s, then flat
    assert abs(warm.second_half_growth_mb()) < 1e-9
    assert warm.peak_mb == 400.0


def test_a_steady_leak_shows_as_second_half_growth() -> None:
    leak = _result(lambda t: 300.0 + t * 2.0)  # 2 MB/s, i.e. 0.4 MB per image
    assert leak.second_half_growth_mb() == pytest.approx(36.0, abs=1.0)  # from t = 20 s to t = 38 s


def test_too_few_samples_are_refused() -> None:
    short = SoakResult(1, 1.0, [(0.0, 1.0)] * 5, ["runtime"], 0)
    with pytest.raises(ValueError, match="too few"):
        short.second_half_growth_mb()


def test_rss_of_a_gone_process_is_none() -> None:
    assert rss_mb(2 ** 22 + 12345) is None


@pytest.mark.slow
def test_a_short_real_soak_stays_flat(tmp_path: Path) -> None:
    # At 4 images the run's last tenth is mostly its end (VQ decode and PNGs of every image), a one-time
    # rise the verdict would read as growth; 16 images put that end in the last few samples only.
    out = tmp_path / "soak.json"
    code = main(["--num-images", "16", "--interval", "0.05", "--out", str(out), "--plot", str(tmp_path / "soak.png"),
                 "--", "--device", "cpu", "--method", "ar"])
    summary = json.loads(out.read_text())
    assert code == 0 and summary["flat"] and len(summary["samples"]) >= 20
    assert 50 < summary["peak_mb"] < 4000
    assert (tmp_path / "soak.png").stat().st_size > 1000
