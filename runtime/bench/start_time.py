"""How long `runtime run` takes to start decoding, the first time a configuration runs in graph
mode (its steps compile) and the times after (they load from the compile cache):

    python -m runtime.bench.start_time --runs 3 --out results/cpu_speed/start_time.json -- --device cpu --graph

Each run is a fresh process, `runtime run --num-images 1 <args>`, all against one fresh
`LANTERN_RUNTIME_CACHE`. A run's start is its process wall time less the decoding after the
first step (`timing.total_s - timing.phases.capture.seconds` of its result.json): imports, model
load, capture and prefill, plus the image's write-out (so an upper bound by a few ms).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence


def measure(args: Sequence[str], runs: int, cache: Path) -> list[dict[str, Any]]:
    """`runs` fresh processes of `runtime run --num-images 1 *args` sharing the compile cache
    `cache`; per run its wall, capture and start seconds."""
    rows = []
    env = {**os.environ, "LANTERN_RUNTIME_CACHE": str(cache)}
    with tempfile.TemporaryDirectory(prefix="start-time-") as work:
        for i in range(runs):
            out = Path(work) / f"run{i}"
            command = [sys.executable, "-m", "runtime", "run", "--num-images", "1", "--out", str(out), *args]
            began = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - began
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
                raise SystemExit(f"error: run {i + 1} exited {done.returncode}: {tail[0]}")
            timing = json.loads((out / "result.json").read_text())["timing"]
            capture = timing["phases"].get("capture", {}).get("seconds", 0.0)
            decoding = timing["total_s"] - capture
            rows.append({"run": i + 1, "wall_s": wall, "capture_s": capture, "decoding_s": decoding,
                         "start_s": wall - decoding, "graph": timing.get("graph")})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.utils.atomic import atomic_write_text

    argv = list(sys.argv[1:] if argv is None else argv)
    own, run_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m runtime.bench.start_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="processes, the first with an empty compile cache")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    opts = parser.parse_args(own)
    if opts.runs < 2:
        print("error: --runs must be >= 2 (a first run and at least one that reads its cache)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
        rows = measure(run_args, opts.runs, Path(cache))
    body = {"kind": "start_time", "command": ["runtime", "run", "--num-images", "1", *run_args],
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "runs": rows,
            "first_start_s": rows[0]["start_s"], "later_start_s": [r["start_s"] for r in rows[1:]]}
    atomic_write_text(Path(opts.out), json.dumps(body, indent=2))
    for r in rows:
        print(f"run {r['run']}: start {r['start_s']:.1f} s (capture {r['capture_s']:.1f} s), wall {r['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
