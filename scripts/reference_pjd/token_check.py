"""Token for token: `--method pjd --accept published` and AR against the released PJD code, greedy.

Project venv, from the repository root, one thread, after released_run.py ran with a greedy target
and guidance that leaves the two contexts alike:

    PJDHARNESS_WORK=... $PJDHARNESS_WORK/venv/bin/python scripts/reference_pjd/released_run.py \
        --work $PJDHARNESS_WORK/tiny --size 256 --image-top-k 1 --cfg 1.0001 \
        --out $PJDHARNESS_WORK/results/released_s256_topk1_cfg1.0001.json
    OMP_NUM_THREADS=1 .venv/bin/python scripts/reference_pjd/token_check.py --work $PJDHARNESS_WORK/tiny \
        --released $PJDHARNESS_WORK/results/released_s256_topk1_cfg1.0001.json \
        --out results/pjd_released_cpu/tokens_s256.json

Why cfg 1.0001: the released code fails at cfg 1 (its attention mask keeps the guided batch's two
rows), and its unconditional branch sees another context than the runtime's (docs/methods.md); at
1.0001 that branch weighs 1e-4, so a greedy target picks what the conditional one does except at a
near-tie. With image top-k 1 the released target is greedy (p one-hot), so its tokens depend on its
random drafts only where one equals the target's choice.

Per image: the first code (raster index over rows x cols, row ends left out) where the runtime's
AR and its published pjd (init uniform, no row cap) differ from the released code's output. AR
departs from it as soon as a later row commits a code conditioned on a partly generated row above;
the published loop follows it as long as the rows' timing agrees (the released code's shifted
tests after a row end move the acceptance of carried drafts by one forward, docs/methods.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from runtime_side import provenance, write


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="make_model.py's --out")
    ap.add_argument("--released", required=True, help="a released_run.py file run with --image-top-k 1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from runtime.core import Decoder, MethodSpec, SamplingParams
    from runtime.core.slots import SlotRequest
    from runtime.core.pjd_published import PublishedPJD
    from runtime.models.chameleon_folder import load_chameleon_folder

    with open(args.released) as f:
        released = json.load(f)
    settings = released["settings"]
    if settings.get("image_top_k") != 1:
        print(f"{args.released}: image top-k {settings.get('image_top_k')}; the check needs a greedy target (1)",
              file=sys.stderr)
        return 2
    size, cfg = int(settings["target_size"]), float(settings["guidance_scale"])
    target, _, encoder, _ = load_chameleon_folder(os.path.join(args.work, "model"), None, with_vq=False,
                                                  image_size=size)
    prompts = sorted({im["prompt"] for im in released["images"]}, key=[im["prompt"] for im in released["images"]].index)
    ids, mask = encoder(prompts)
    target.for_prompts(ids.size(1))
    grid = size // 16
    sampling = SamplingParams(greedy=True, cfg=cfg)
    loops = {"ar": MethodSpec("ar", sampling=sampling),
             "pjd published": MethodSpec("pjd", sampling=sampling, accept="published", init="uniform", pjd_rows=16)}
    rows = []
    for im in released["images"]:
        j = prompts.index(im["prompt"])
        theirs = [c for row in im["codes"] for c in row]
        row: dict = {"prompt": im["prompt"], "seed": im["seed"], "codes": len(theirs),
                     "released_image_forwards": im["image_forwards"]}
        for name, spec in loops.items():
            trace = None
            if spec.loop == "out_of_order":  # the slot API by hand, to keep the image's trace
                pjd = PublishedPJD(target, spec)
                pjd.admit(0, SlotRequest(j, ids[j:j + 1], mask[j:j + 1], im["seed"]))
                while not (done := pjd.finished()):
                    pjd.step()
                tokens, stats = done[0].tokens, done[0].stats
                trace = pjd.images[0].trace if pjd.images[0] is not None else None
            else:
                tokens, stats = Decoder(target, None, spec).generate_one(ids[j:j + 1], mask[j:j + 1], im["seed"])
            ours = tokens.view(grid, -1)[:, :grid].reshape(-1).tolist()  # row ends left out
            row[name] = {"first_difference": first_difference(ours, theirs), "equal_codes": sum(
                a == b for a, b in zip(ours, theirs)), "image_forwards": stats.target_forwards}
            if trace is not None:  # the first forward whose rows or committed counts differ
                mine = [(f["rows"], f["committed"]) for f in trace]
                # the released code's first Jacobi forward (a window of one) is the runtime's prefill
                steps = [(f["rows"], f["committed"], bool(f.get("extra_input"))) for f in im["forwards"] if f["rows"]][1:]
                k = next((i for i, (a, b) in enumerate(zip(mine, steps)) if list(a) != list(b[:2])), None)
                row[name]["first_differing_forward"] = k
                row[name]["that_forward_follows_a_row_end"] = None if k is None else steps[k][2]
        rows.append(row)
        pub = row["pjd published"]
        print(f"{im['prompt'][:24]:24s} seed {im['seed']}: " + ", ".join(
            f"{name} first differs at code {row[name]['first_difference']} of {len(theirs)}" for name in loops)
            + f"; the forwards first differ at {pub['first_differing_forward']} (after a row end: "
              f"{pub['that_forward_follows_a_row_end']})", flush=True)
    out = {"released_file": os.path.basename(args.released), "size": size, "cfg": cfg, **provenance(),
           "images": rows}
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
