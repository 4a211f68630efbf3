"""Combine reference_run.py and runtime_run.py results into one JSON (and a printed table):
per method the reference's median per-image seconds over its repeats, the runtime's graph and eager
medians, speed ratios (reference seconds / runtime seconds: > 1 = runtime faster), greedy token
equality with the first differing position, tau on both sides, and the commands.

    python3 compare.py --ref results/ref --graph results/rt_graph --eager results/rt_eager --out results/compare.json
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

METHODS = ("ar", "eagle2", "lantern", "lantern++")


def load(folder: str | None):
    if not folder or not os.path.isfile(os.path.join(folder, "result.json")):
        return None
    with open(os.path.join(folder, "result.json")) as f:
        return json.load(f)


def tokens_of(folder: str, result: dict, method: str):
    return np.load(os.path.join(folder, result["methods"][method]["tokens_file"]))


def token_check(ref_tokens: np.ndarray, other: np.ndarray) -> dict:
    n = min(len(ref_tokens), len(other))
    per_image = []
    for i in range(n):
        diff = np.nonzero(ref_tokens[i] != other[i])[0]
        per_image.append(None if diff.size == 0 else {"first_diff": int(diff[0]), "n_diff": int(diff.size),
                                                      "ref": int(ref_tokens[i][diff[0]]),
                                                      "runtime": int(other[i][diff[0]])})
    return {"equal": all(p is None for p in per_image), "images_compared": n, "per_image": per_image}


def main() -> None:
    ap = argparse.ArgumentParser()
    here = os.environ.get("REFHARNESS_WORK", os.path.join(os.getcwd(), "refharness-work"))
    ap.add_argument("--ref", default=os.path.join(here, "results", "ref"))
    ap.add_argument("--graph", default=os.path.join(here, "results", "rt_graph"))
    ap.add_argument("--eager", default=os.path.join(here, "results", "rt_eager"))
    ap.add_argument("--out", default=os.path.join(here, "results", "compare.json"))
    args = ap.parse_args()
    ref = load(args.ref)
    if ref is None:
        raise SystemExit(f"no reference result in {args.ref}")
    sides = {"graph": (args.graph, load(args.graph)), "eager": (args.eager, load(args.eager))}
    out = {"reference": {"folder": args.ref, "command": ref["command"], "commit": ref["commit"],
                         "threads": ref["threads"], "images": ref["images"], "repeats": ref["repeats"]},
           "runtime": {k: None if r is None else {"folder": f, "command": r["command"], "commit": r["commit"],
                                                   "dirty": r.get("dirty"), "threads": r["threads"],
                                                   "images": r["images"], "repeats": r["repeats"],
                                                   "capture_count": r.get("capture_count")}
                       for k, (f, r) in sides.items()},
           "methods": {}}
    rows = []
    for m in METHODS:
        if m not in ref["methods"]:
            continue
        rm = ref["methods"][m]
        ref_tok = tokens_of(args.ref, ref, m)
        entry = {"reference": {"median_s": rm["per_image_s_median"], "repeats_s": rm["per_image_s_repeats"],
                               "tau_step_compression": float(np.mean(rm["step_compression"]))}}
        if m == "ar" and "argmax_check" in rm:
            entry["reference"]["ar_argmax_check"] = rm["argmax_check"]
        for side, (folder, res) in sides.items():
            if res is None or m not in res["methods"]:
                entry[side] = None
                continue
            sm = res["methods"][m]
            taus = [s["tau"] for s in sm["stats"] if s["tau"] is not None]
            entry[side] = {"median_s": sm["per_image_s_median"], "repeats_s": sm["per_image_s_repeats"],
                           "speed_ratio_vs_reference": rm["per_image_s_median"] / sm["per_image_s_median"],
                           "tau": float(np.mean(taus)) if taus else 1.0,
                           "compiles_during_timed_images": sm.get("compiles_during_image"),
                           "tokens": token_check(ref_tok, tokens_of(folder, res, m))}
        out["methods"][m] = entry
        g, e = entry.get("graph"), entry.get("eager")
        rows.append((m, rm["per_image_s_median"], g and g["median_s"], g and g["speed_ratio_vs_reference"],
                     e and e["median_s"], e and e["speed_ratio_vs_reference"],
                     g and g["tokens"]["equal"], e and e["tokens"]["equal"],
                     entry["reference"]["tau_step_compression"], g and g["tau"]))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)

    def fmt(x, spec=".3f"):
        return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)

    print("| method | ref s/img | graph s/img | graph x | eager s/img | eager x | tokens graph | tokens eager "
          "| tau ref | tau rt |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join([r[0], fmt(r[1]), fmt(r[2]), fmt(r[3], ".2f"), fmt(r[4]), fmt(r[5], ".2f"),
                                 fmt(r[6]), fmt(r[7]), fmt(r[8], ".2f"), fmt(r[9], ".2f")]) + " |")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
