"""The runtime's training-free methods on make_model.py's tiny model (the folder released_run.py
decodes), for the step-compression comparison with the released PJD code. Project venv, from the
repository root, one thread:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/reference_pjd/runtime_run.py --work $PJDHARNESS_WORK/tiny \
        --size 256 --out $PJDHARNESS_WORK/results/runtime_s256.json

Per method and setting (sampling at cfg 3 with image top-k 2000, as the released script; greedy,
the runtime's counterpart of the released run at image top-k 1), the same two prompts and two
seeds as released_run.py: target forwards per image (prefill included) and the image codes
(rows x cols, row ends excluded) per image forward, the figure released_run.py reports. The
runtime's random numbers are its own: tokens are not compared, step counts are.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from runtime_side import PROMPTS, provenance, write
METHODS = {  # name: MethodSpec keywords
    "ar": dict(method="ar"),
    "sjd window 7": dict(method="sjd", window=7),
    "sjd window 16": dict(method="sjd", window=16),
    "pjd lossless, 2 rows": dict(method="pjd", pjd_rows=2),
    "pjd lossless, 4 rows": dict(method="pjd", pjd_rows=4),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="make_model.py's --out")
    ap.add_argument("--size", type=int, default=256, help="image size (rows = cols = size / 16)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--image-top-k", type=int, default=2000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from runtime.core import MethodSpec, SamplingParams, generate
    from runtime.models.chameleon_folder import load_chameleon_folder

    target, _, encoder, _ = load_chameleon_folder(os.path.join(args.work, "model"), None, with_vq=False,
                                                  image_size=args.size)
    grid = args.size // 16
    ids, mask = encoder(PROMPTS)  # padded to one length, the mask marks the padding
    target.for_prompts(ids.size(1))
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = {"sampling": SamplingParams(cfg=args.cfg, top_k=args.image_top_k),
                "greedy": SamplingParams(greedy=True, cfg=args.cfg)}
    out: dict = {"model": os.path.join(args.work, "model"), "size": args.size, "rows": grid, "cols": grid,
                 "tokens_per_image": target.config.block_size, "image_codes": grid * grid,
                 "seeds": seeds, "prompts": PROMPTS, "cfg": args.cfg, "image_top_k": args.image_top_k,
                 **provenance(), "results": {}}
    for setting, sampling in settings.items():
        for name, kw in METHODS.items():
            forwards = []
            for seed in seeds:
                res = generate(target, None, MethodSpec(sampling=sampling, **kw), ids, cond_masks=mask, seed=seed)
                forwards += [f for _, f in res.image_counts]
            per_fwd = [grid * grid / (f - 1) for f in forwards]  # image forwards: all but the prefill
            out["results"][f"{setting} / {name}"] = {
                "target_forwards": forwards, "image_codes_per_image_forward": [round(x, 3) for x in per_fwd],
                "mean_image_codes_per_image_forward": round(statistics.mean(per_fwd), 3)}
            print(f"{setting:8s} {name:22s} forwards {forwards} codes/fwd {statistics.mean(per_fwd):.2f}", flush=True)
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
