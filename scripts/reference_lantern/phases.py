"""Digest the runtime runs of one before/after measurement into phases.json: per run folder and
method, the wall seconds of the untimed image runtime_run.py --phases records, and per phase the
milliseconds per call and the call count.

    python phases.py RESULTS_DIR [--out phases.json]

RESULTS_DIR holds before_after.sh's run folders ({before,after}_{graph,eager}_<models>/result.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def digest(folder: str) -> dict:
    """{method: {"wall_s": s, phase: {"ms_per_call", "calls"}}} of one run folder's result.json."""
    with open(os.path.join(folder, "result.json")) as f:
        methods = json.load(f)["methods"]
    out = {}
    for name, entry in methods.items():
        timed = entry.get("phases_untimed_image0")
        if not timed:
            continue
        row: dict = {"wall_s": round(timed["wall_s"], 4)}
        for phase, t in timed["phases"].items():
            row[phase] = {"ms_per_call": round(1e3 * t["seconds"] / t["count"], 3), "calls": t["count"]}
        out[name] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--out", default=None, help="default RESULTS/phases.json")
    args = ap.parse_args()
    runs = {}
    for name in sorted(os.listdir(args.results)):
        path = os.path.join(args.results, name)
        if os.path.isfile(os.path.join(path, "result.json")) and not name.startswith("ref_"):
            runs[name] = digest(path)
    if not runs:
        print(f"no run folders with result.json in {args.results}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.results, "phases.json")
    with open(out, "w") as f:
        json.dump({"what": "per-iteration phase times (ms) of one extra untimed image per method "
                   "(runtime_run.py --phases); the same runs as the compare files", "runs": runs}, f, indent=1)
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
