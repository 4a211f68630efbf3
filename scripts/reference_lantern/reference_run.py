"""Greedy generation with the reference LANTERN code (jadohu/LANTERN @ 3a56e45), on CPU, one
thread, for AR, EAGLE-2, LANTERN and LANTERN++; per-image seconds (warm-up excluded) and tokens.

    OMP_NUM_THREADS=1 venv/bin/python reference_run.py --images 2 --repeats 5 --out results/ref

How each method is called (as entrypoints/generate_images.py calls it, greedy = temperature 0):
  ar        model_type 'base': LlamaForCausalLM.generate (modeling_llamagen_kv.py), its own
            instance as the entrypoint loads it; temperature 0 there means logits / 1e-5 then
            top-k + multinomial (effectively argmax; we check against argmax below)
  eagle2    EaModel.generate(static_tree=False, lantern=False)  (dynamic tree: total_token 59,
            depth 4, top_k 10 = EaModel.from_pretrained's defaults)
  lantern   EaModel.generate(static_tree=False, lantern=True, lantern_k=1000, lantern_delta=0.1)
  lantern++ EaModel.generate(static_tree=True, lantern=True, lantern_k=1000, lantern_delta=2.0)
            (lantern_delta > 1 selects the multiplicative bound, lambda = 2; tree_choices =
            naive_extend_57, generate()'s default)
All with max_length 256, cfg --cfg (3.0: generate_images.py's default), top_k 2000, top_p 1.0.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

import refenv

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = refenv.WORK
METHODS = ("ar", "eagle2", "lantern", "lantern++")


def method_kwargs(method: str, args) -> dict:
    common = {"max_length": 256, "temperature": 0.0, "top_k": 2000, "top_p": 1.0, "cfg": args.cfg}
    if method == "ar":
        return common
    if method == "eagle2":
        return {**common, "static_tree": False, "lantern": False, "lantern_k": args.lantern_k,
                "lantern_delta": args.lantern_delta}
    if method == "lantern":
        return {**common, "static_tree": False, "lantern": True, "lantern_k": args.lantern_k,
                "lantern_delta": args.lantern_delta}
    if method == "lantern++":
        from models.drafters import choices
        return {**common, "static_tree": True, "lantern": True, "lantern_k": args.lantern_k,
                "lantern_delta": args.lantern_lambda, "tree_choices": getattr(choices, args.tree)}
    raise ValueError(method)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.path.join(WORK, "models"))
    ap.add_argument("--methods", default=",".join(METHODS))
    refenv.add_settings(ap)
    ap.add_argument("--table", default=None, help="neighbour table .npy (default: refcwd's, built as "
                    "generate_codebook.py builds it)")
    ap.add_argument("--out", default=os.path.join(WORK, "results", "ref"))
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    args.out, args.models = os.path.abspath(args.out), os.path.abspath(args.models)
    if args.table is not None:
        args.table = os.path.abspath(args.table)

    torch.set_num_threads(args.threads)
    refenv.install()
    keys = refenv.load_captions(os.path.join(args.models, "captions.npz"))[: args.images]
    target_dir, drafter_dir = os.path.join(args.models, "target"), os.path.join(args.models, "drafter")
    os.makedirs(args.out, exist_ok=True)
    os.chdir(os.path.join(WORK, "refcwd"))  # EaModel reads ckpts/llamagen/vq_distances/top_16383_indices.npy

    from models.ea_model_llamagen import EaModel
    from models.kv_variants.modeling_llamagen_kv import LlamaForCausalLM

    methods = [m for m in args.methods.split(",") if m]
    torch.manual_seed(args.seed)
    models = {}
    if "ar" in methods:  # model_type 'base' (generate_images.py load_model)
        models["ar"] = LlamaForCausalLM.from_pretrained(target_dir).to(dtype=torch.float32, device="cpu").eval()
    if any(m != "ar" for m in methods):  # model_type 'eagle'
        ea = EaModel.from_pretrained(base_model_path=target_dir, ea_model_path=drafter_dir)
        ea = ea.to(dtype=torch.float32, device="cpu").eval()
        # the models folder's own table (same file EaModel just loaded from refcwd, unless
        # --models points elsewhere or --table names another ordering)
        ea.nearest_latents = np.load(args.table or os.path.join(args.models, "top_16383_indices.npy"))
        for m in methods:
            if m != "ar":
                models[m] = ea

    cpu_s = {m: [] for m in methods}  # this process's CPU seconds per call (warm-up calls included)

    def run(method: str, key: str):
        kw = method_kwargs(method, args)
        c0, t0 = time.process_time(), time.perf_counter()
        tokens, compression, latency = models[method].generate(prompt=[key], **kw)
        wall = time.perf_counter() - t0
        cpu_s[method].append(time.process_time() - c0)
        return wall, tokens, float(compression), float(latency)

    for m in methods:  # warm-up (first-call allocations, the tree buffers)
        for _ in range(args.warmup):
            run(m, keys[0])

    seconds = {m: [[None] * len(keys) for _ in range(args.repeats)] for m in methods}
    internal = {m: [[None] * len(keys) for _ in range(args.repeats)] for m in methods}
    tokens, compression = {}, {}
    for r in range(args.repeats):  # interleaved: round r runs every method once, rotating the start
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for m in order:
            for i, key in enumerate(keys):
                s, tok, comp, lat = run(m, key)
                seconds[m][r][i], internal[m][r][i] = s, lat
                t = tok.reshape(-1).cpu().numpy().astype(np.int64)
                if m in tokens and i < len(tokens[m]):
                    if not np.array_equal(tokens[m][i], t):
                        print(f"warning: {m} image {i} tokens changed between repeats", file=sys.stderr)
                else:
                    tokens.setdefault(m, []).append(t)
                    compression.setdefault(m, []).append(comp)
            per_image = sum(seconds[m][r]) / len(keys)
            print(f"repeat {r} {m:10s} {per_image:.3f} s/image", flush=True)

    result = {"side": "reference", "commit": "3a56e45", "threads": args.threads, "images": len(keys),
              "repeats": args.repeats, "warmup": args.warmup, "settings": vars(args),
              "torch": torch.__version__, "platform": platform.platform(), "command": " ".join(sys.argv),
              "methods": {}}
    for m in methods:
        per_repeat = [sum(x) / len(x) for x in seconds[m]]
        toks = np.stack(tokens[m])
        np.save(os.path.join(args.out, f"tokens_{m.replace('+', 'p')}.npy"), toks)
        # reference step compression: mean of accept_length + 1 per iteration (ea_model_llamagen.py)
        result["methods"][m] = {
            "per_image_s_repeats": per_repeat, "per_image_s_median": statistics.median(per_repeat),
            "image_s": seconds[m], "internal_latency_s": internal[m],
            "process_cpu_s_timed": cpu_s[m][args.warmup:],
            "step_compression": compression[m] if m != "ar" else [1.0] * len(keys),
            "tokens_file": f"tokens_{m.replace('+', 'p')}.npy", "tokens_shape": list(toks.shape),
        }
        print(f"{m:10s} median {statistics.median(per_repeat):.3f} s/image  repeats "
              + " ".join(f"{x:.3f}" for x in per_repeat)
              + (f"  tau {np.mean(compression[m]):.2f}" if m != "ar" else ""))
    if "ar" in methods:  # the AR path samples from logits / 1e-5: check it equals argmax decoding
        result["methods"]["ar"]["argmax_check"] = ar_argmax_check(models["ar"], keys[0], args.cfg,
                                                                  tokens["ar"][0])
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=2)


@torch.no_grad()
def ar_argmax_check(model, key: str, cfg: float, tokens: np.ndarray) -> dict:
    """Teacher-force the AR tokens through the reference model once; count positions whose token
    is not the argmax of the CFG-mixed logits, and the smallest top-1/top-2 logit gap."""
    from models.kv_variants.modeling_llamagen_kv import cfg_logit_process

    emb, mask = refenv.CAPTIONS[key]
    n = int(mask.sum())
    c = (torch.cat([emb[n:], emb[:n]]) * torch.flip(mask, [0])[:, None])[None]
    cond = torch.cat([c, torch.zeros_like(c) + model.model.cls_embedding.uncond_embedding])
    am = torch.cat([torch.flip(mask, [0])[None]] * 2)
    ids = torch.from_numpy(tokens[:-1])[None].repeat(2, 1)
    am = torch.cat([am, torch.ones(2, ids.shape[1], dtype=am.dtype)], 1)
    saved = getattr(model.model, "tree_mask", None)
    model.model.tree_mask = None
    out = model(input_ids=ids, cond_idx=cond, attention_mask=am)
    model.model.tree_mask = saved
    logits = cfg_logit_process(out.logits, cfg)[0, 119:]  # predicts tokens 0..255
    top2 = torch.topk(logits, 2, dim=-1).values
    arg = logits.argmax(-1).numpy()
    return {"non_argmax_positions": int((arg != tokens).sum()),
            "first_non_argmax": int(np.argmax(arg != tokens)) if (arg != tokens).any() else None,
            "min_top2_gap": float((top2[:, 0] - top2[:, 1]).min())}


if __name__ == "__main__":
    main()
