"""The demo's speed-quality frontier at sample sizes that separate settings.

    python scripts/frontier.py sample --root SAMPLES [--per-class 50] [--seed-sets 0,1] [--device cpu]
    python scripts/frontier.py score --root SAMPLES --bench results/frontier_*.json --out results/frontier_quality_cpu.json

`sample` runs `runtime sample` for every setting of `scripts/frontier_settings.toml`, one folder per
setting and seed set (SAMPLES/<name>/s<seed>), in the file's order, seed set by seed set, so that an
interrupted run resumes where it stopped (`runtime sample` resumes a folder chunk by chunk) and
the first seed set of every setting is done before the second starts. Speed does not come from
these runs (their batch is as large as helps): it comes from `runtime bench`.

`score` reads every finished folder and writes the quality of each setting against AR on the same
seeds and classes (`runtime.quality_budget`), beside the bench's speedup, tau and step TVD.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = HERE / "frontier_settings.toml"


def settings(path: Path = SETTINGS) -> list[dict]:
    """The `[[setting]]` tables of the settings file, in order."""
    import tomllib

    with path.open("rb") as f:
        return tomllib.load(f)["setting"]


def sample(args: argparse.Namespace) -> int:
    root = Path(args.root)
    seed_sets = [int(s) for s in args.seed_sets.split(",")]
    only = set(args.only.split(",")) if args.only else None
    for seed in seed_sets:
        for s in settings():
            if only and s["name"] not in only:
                continue
            run_seed = seed + int(s.get("seed_offset", 0))
            out = root / s["name"] / f"s{run_seed}"
            if (out / "samples.npz").exists():
                continue
            cmd = ["runtime", "sample", "--device", args.device, "--per-class", str(args.per_class),
                   "--chunk", str(args.chunk), "--batch-size", str(args.batch_size), "--seed", str(run_seed),
                   "--out", str(out), *s["args"]]
            print(time.strftime("%H:%M:%S"), " ".join(cmd), flush=True)
            started = time.time()
            rc = subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            print(f"{time.strftime('%H:%M:%S')} {s['name']} s{run_seed}: rc {rc}, {time.time() - started:.0f} s",
                  flush=True)
            if rc != 0:
                return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample", help="generate every setting's images (resumable)")
    p.add_argument("--root", required=True, help="folder of the sample folders (outside the repository)")
    p.add_argument("--per-class", type=int, default=50)
    p.add_argument("--seed-sets", default="0,1", help="run seeds; each is per-class x 12 more images per setting")
    p.add_argument("--chunk", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=60)
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", default="", help="comma-separated setting names (default: all)")
    p.set_defaults(run=sample)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
