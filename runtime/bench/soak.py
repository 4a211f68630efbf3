"""Soak: one `runtime run` process generating many images, its resident memory sampled as it goes.

    python -m runtime.bench.soak --num-images 200 --out results/soak_cpu.json [--plot results/soak_cpu.png]
        [-- extra `runtime run` flags]

The run is a child process (exactly what a user runs); its RSS is read from `/proc/PID/status`
every `--interval` seconds (Linux only). Images complete at a steady rate, so the second half of the
samples covers roughly the second half of the images: memory is "flat" when the RSS grows by less
than `--max-growth-mb` between the start and the end of that half (a leak of even a few kB per image
shows as a steady climb there; the first half holds the one-time growth of caches and graphs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class SoakResult:
    """RSS samples of one run: `samples[i] = (seconds since start, RSS in MB)`, 1 MB = 1e6 B."""

    num_images: int
    seconds: float
    samples: list[tuple[float, float]]
    command: list[str]
    exit_code: int

    @property
    def peak_mb(self) -> float:
        return max(mb for _, mb in self.samples)

    def second_half_growth_mb(self) -> float:
        """Median RSS of the last tenth of the samples minus that of the tenth at the run's middle."""
        n = len(self.samples)
        if n < 20:
            raise ValueError(f"{n} RSS samples are too few to judge growth; lower --interval or run more images")
        tenth = max(1, n // 10)
        middle = [mb for _, mb in self.samples[n // 2 - tenth // 2: n // 2 - tenth // 2 + tenth]]
        last = [mb for _, mb in self.samples[-tenth:]]
        return _median(last) - _median(middle)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def rss_mb(pid: int) -> float | None:
    """Resident set size of process `pid` in MB, or None once it has exited."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def soak(num_images: int, extra: list[str], interval: float = 0.25) -> SoakResult:
    """Run `runtime run --num-images N` once, sampling its RSS every `interval` seconds."""
    if not Path("/proc/self/status").is_file():
        raise SystemExit("soak: reads RSS from /proc, which this system lacks (Linux only)")
    with tempfile.TemporaryDirectory(prefix="soak.") as folder:
        command = [sys.executable, "-m", "runtime", "-q", "run", "--num-images", str(num_images),
                   "--out", str(Path(folder) / "run"), *extra]
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        samples: list[tuple[float, float]] = []
        while child.poll() is None:
            mb = rss_mb(child.pid)
            if mb is not None and child.poll() is None:
                samples.append((time.perf_counter() - start, mb))
            time.sleep(interval)
        seconds = time.perf_counter() - start
        stderr = child.stderr.read() if child.stderr else ""
    if child.returncode != 0:
        raise SystemExit(f"soak: runtime run exited {child.returncode}: {stderr.strip()[-500:]}")
    return SoakResult(num_images, seconds, samples, ["runtime", *command[3:]], child.returncode)


def plot(result: SoakResult, path: Path) -> None:
    """RSS against time, with the images' steady rate on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s for s, _ in result.samples]
    mb = [m for _, m in result.samples]
    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=150)
    ax.plot(t, mb, lw=1.2)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("RSS (MB)")
    ax.set_ylim(0, result.peak_mb * 1.15)
    fig.suptitle(f"RSS of one runtime run process generating {result.num_images} images", fontsize=10)
    ax.grid(alpha=0.3)
    top = ax.secondary_xaxis("top", functions=(lambda s: s * result.num_images / result.seconds,
                                                lambda n: n * result.seconds / result.num_images))
    top.set_xlabel("images (at the run's mean rate)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between RSS samples")
    parser.add_argument("--max-growth-mb", type=float, default=25.0,
                        help="largest RSS growth over the second half of the run that still counts as flat")
    parser.add_argument("--out", type=Path, help="write the samples and the verdict as JSON here")
    parser.add_argument("--plot", type=Path, help="write RSS against time as a PNG here")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    result = soak(args.num_images, extra, args.interval)
    growth = result.second_half_growth_mb()
    flat = growth < args.max_growth_mb
    summary = {**asdict(result), "peak_mb": result.peak_mb, "second_half_growth_mb": growth,
               "max_growth_mb": args.max_growth_mb, "flat": flat}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    print(f"{result.num_images} images in {result.seconds:.1f} s, {len(result.samples)} RSS samples, peak "
          f"{result.peak_mb:.0f} MB, second-half growth {growth:+.1f} MB: {'flat' if flat else 'GROWING'}")
    return 0 if flat else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
