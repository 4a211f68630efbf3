"""`--method pjd --accept published` beside the released PJD code, forward by forward statistics.

Project venv, from the repository root, one thread, after released_run.py wrote its files:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/reference_pjd/published_check.py --work $PJDHARNESS_WORK/tiny \
        --released $PJDHARNESS_WORK/results --size 256 --out results/pjd_released_cpu/published_s256.json

Runs the runtime's published loop (`runtime.core.pjd_published.PublishedPJD`, init uniform as the
released code, no row cap) on make_model.py's tiny model with released_run.py's two prompts and
seeds, sampling at cfg 3 / image top-k 2000 and greedy (the released run at image top-k 1), and
sets per image and per forward what released_run.py records: the ongoing rows, their windows
(leading token included) and committed codes. The random numbers differ (the runtime's counter
RNG, the released code's torch.rand / multinomial / randint), so the comparison is of statistics:
image forwards, codes per image forward, rows per forward, and committed codes per forward of the
first ongoing row and of later rows by window size. Image forwards count the runtime's prefill,
which samples the first code as the released code's first Jacobi forward (a window of one) does.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

import torch

from runtime_side import PROMPTS, provenance, write


def summarise(images: list[dict], skip_after_row_end: bool = False) -> dict:
    """The statistics both sides are compared on, from per-forward rows / windows / committed;
    `skip_after_row_end` leaves out the forwards right after a row finished (where the released
    code's tests are shifted by one position)."""
    rows, first, later = [], [], []
    first_by, later_by = collections.defaultdict(list), collections.defaultdict(list)
    for im in images:
        for f in im["forwards"]:
            if not f["rows"] or (skip_after_row_end and f["after_row_end"]):
                continue
            rows.append(len(f["rows"]))
            first.append(f["committed"][0])
            first_by[f["window"][0]].append(f["committed"][0])
            for w, c in zip(f["window"][1:], f["committed"][1:]):
                later.append(c)
                later_by[w].append(c)

    # the first row's codes in the forward right after a row end and the next one, summed: where the
    # released code's shifted tests move the acceptance of the carried drafts by one forward
    pairs = [f["committed"][0] + g["committed"][0] for im in images
             for f, g in zip(im["forwards"], im["forwards"][1:]) if f["after_row_end"] and f["rows"] and g["rows"]]

    def by(d: dict) -> dict:
        return {str(w): {"forwards": len(v), "mean_committed": round(statistics.mean(v), 3)} for w, v in sorted(d.items())}

    return {"image_forwards": [im["image_forwards"] for im in images],
            "codes_per_image_forward": [round(im["codes"] / im["image_forwards"], 3) for im in images],
            "mean_codes_per_image_forward": round(statistics.mean(im["codes"] / im["image_forwards"] for im in images), 3),
            "mean_rows_per_forward": round(statistics.mean(rows), 3), "max_rows_per_forward": max(rows),
            "first_row_committed_per_forward": round(statistics.mean(first), 3),
            "later_row_committed_per_forward": round(statistics.mean(later), 3) if later else None,
            "first_row_by_window": by(first_by), "later_rows_by_window": by(later_by),
            "first_row_committed_in_the_two_forwards_after_a_row_end": round(statistics.mean(pairs), 3) if pairs else None}


def released_images(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return [{"image_forwards": im["image_forwards"], "codes": im["committed_total"],
             "forwards": [{**f, "after_row_end": bool(f.get("extra_input"))} for f in im["forwards"] if f["rows"]]}
            for im in data["images"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="make_model.py's --out")
    ap.add_argument("--released", required=True, help="released_run.py's result folder")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from runtime.core import MethodSpec, SamplingParams
    from runtime.core.slots import SlotRequest
    from runtime.core.pjd_published import PublishedPJD
    from runtime.models.chameleon_folder import load_chameleon_folder

    target, _, encoder, _ = load_chameleon_folder(os.path.join(args.work, "model"), None, with_vq=False,
                                                  image_size=args.size)
    ids, mask = encoder(PROMPTS)
    target.for_prompts(ids.size(1))
    grid = args.size // 16
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = {"sampling": (SamplingParams(cfg=3.0, top_k=2000), "topk2000"),
                "greedy": (SamplingParams(greedy=True, cfg=3.0), "topk1")}
    out: dict = {"size": args.size, "rows": grid, "cols": grid, "seeds": seeds, "prompts": PROMPTS,
                 **provenance(), "settings": {}}
    for setting, (sampling, released_tag) in settings.items():
        spec = MethodSpec("pjd", sampling=sampling, accept="published", init="uniform", pjd_rows=16)
        decoder = PublishedPJD(target, spec)
        images = []
        for j in range(len(PROMPTS)):
            for seed in seeds:
                decoder.reset_slots()
                decoder.admit(0, SlotRequest(j, ids[j:j + 1], mask[j:j + 1], seed))
                while not decoder.finished():
                    decoder.step()
                im = decoder.images[0]
                assert im is not None
                images.append({"prompt": j, "seed": seed, "image_forwards": 1 + im.forwards, "codes": grid * grid,
                               "forwards": im.trace})
        released_path = os.path.join(args.released, f"released_s{args.size}_{released_tag}.json")
        theirs = released_images(released_path) if os.path.exists(released_path) else None
        entry: dict = {"spec": spec.describe(), "released_file": os.path.basename(released_path)}
        for part, skip in (("all_forwards", False), ("without_forwards_after_a_row_end", True)):
            runtime = summarise(images, skip)
            released = summarise(theirs, skip) if theirs else None
            entry[part] = {"runtime": runtime, "released": released}
            print(f"{args.size} px {setting}, {part.replace('_', ' ')}")
            for key in ("image_forwards", "mean_codes_per_image_forward", "mean_rows_per_forward",
                        "max_rows_per_forward", "first_row_committed_per_forward", "later_row_committed_per_forward",
                        "first_row_committed_in_the_two_forwards_after_a_row_end"):
                print(f"  {key:34s} runtime {runtime[key]!s:28s} released {released[key] if released else '-'!s}")
            for key in ("first_row_by_window", "later_rows_by_window"):
                ours = {w: v["mean_committed"] for w, v in runtime[key].items()}
                print(f"  {key:34s} runtime {ours}")
                if released:
                    print(f"  {'':34s} released {({w: v['mean_committed'] for w, v in released[key].items()})}")
        out["settings"][setting] = {**entry, "images": images}
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
