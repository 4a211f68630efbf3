"""Load make_model.py's tiny PJD-class model with this runtime (as a Lumina-mGPT-layout Chameleon
folder) and compare its logits with the ones the released model class computed
(reference_logits.pt). Run with the project's venv, from the repository root:

    .venv/bin/python scripts/reference_pjd/runtime_check.py --work $PJDHARNESS_WORK/tiny [--write-vq]

Checks: `load_chameleon_folder(model, None, with_vq=False, image_size=S)` accepts the folder
(Lumina layout: row_width S/16 + 1, row end = core id 8192, prompt suffix [<reserved08706>,
<racm3:break>, size, size]); the runtime's prompt for "a red cat" equals the one make_model.py
used; teacher-forced image logits (image codes + row end) equal the PJD class's full-vocabulary
logits at those ids. --write-vq also writes a random vqgan.ckpt (Meta's layout, the runtime's own
ChameleonVQ) beside the model, so `runtime run --model ... --vq-ckpt ...` can write images.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True, help="make_model.py's --out")
    ap.add_argument("--write-vq", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from runtime.models.chameleon_folder import load_chameleon_folder

    ref = torch.load(os.path.join(args.work, "reference_logits.pt"))
    size, folder = ref["size"], os.path.join(args.work, "model")
    target, _, encoder, _ = load_chameleon_folder(folder, None, with_vq=False, image_size=size)
    cfg = target.config
    ids, mask = encoder(["a red cat"])
    prompt_equal = ids[0].tolist() == ref["prompt"]
    image_ids = target.image_token_ids.tolist()  # BPE id of each core id (codes, then the row end)
    core = {b: i for i, b in enumerate(image_ids)}
    idx = torch.tensor([[core[t] for t in ref["image"]]])
    with torch.no_grad():
        ours, _ = target.forward_train(ids, idx, cond_mask=mask)
    n = ids.size(1)
    theirs = ref["logits"][n - 1:n - 1 + idx.size(1)][:, image_ids]
    diff = (ours[0] - theirs).abs().max().item()
    result = {"loaded": True, "row_width": cfg.row_width, "block_size": cfg.block_size, "vocab_size": cfg.vocab_size,
              "newline": cfg.newline, "row_end_bpe": image_ids[cfg.newline], "prompt_equal": prompt_equal,
              "prompt": ids[0].tolist(), "max_abs_logit_diff": diff,
              "argmax_equal": bool(torch.equal(ours[0].argmax(-1), theirs.argmax(-1)))}
    if args.write_vq:
        from runtime.models.chameleon_vq import ChameleonVQ, ChameleonVQConfig

        config = json.load(open(os.path.join(folder, "config.json")))
        torch.manual_seed(7)
        vq = ChameleonVQ(ChameleonVQConfig.from_hf(config["vq_config"]))
        torch.save({"state_dict": vq.state_dict()}, os.path.join(args.work, "vqgan.ckpt"))
        result["vq_ckpt"] = os.path.join(args.work, "vqgan.ckpt")
    print(json.dumps(result))
    if not (prompt_equal and diff < 1e-3):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
