"""Greedy generation with the project's runtime (this repository, imported from its own venv, nothing
written there) on the same models and caption embeddings as reference_run.py: AR, EAGLE-2, LANTERN,
LANTERN++, one thread, graph mode (torch.compile/inductor steps) or eager.

    OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 LANTERN_RUNTIME_CACHE=$REFHARNESS_WORK/cache \
        .venv/bin/python scripts/reference_lantern/runtime_run.py --mode graph --images 2 --repeats 5 --out results/rt_graph

Settings, matched to reference_run.py: greedy, cfg --cfg (3.0), EAGLE-2 / LANTERN tree depth 4,
top_k_draft 10, total_tokens 59 (EaModel.from_pretrained's defaults), LANTERN lantern_k 1000 delta
0.1, LANTERN++ tree naive_extend_57 lantern_k 1000 lambda 2, relax_rule paper (the reference's rule).
Captions: captions.npz's right-padded embeddings moved to the end with runtime.models.t5.
left_pad_captions (what the runtime's T5 path does, and what EaModel.generate does with T5's output).

Timing: per image, Decoder.generate_one between two perf_counter reads (backend.synchronize() is a
no-op on CPU); the decoder of each method is built once and warmed up (graph mode: the warm-up
compiles every step) before the timed repeats; repeats are interleaved across methods. For each
timed image the count of graphs compiled during it (backend.capture_count) is recorded, so a
recompilation inside a timed repeat shows.
"""
from __future__ import annotations

import os
import sys

sys.dont_write_bytecode = True  # write nothing (no __pycache__) in the repository
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LANTERN_RUNTIME_CACHE", os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache"))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import refenv  # noqa: E402  (the shared settings and work folder; it imports no reference code)

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = refenv.WORK
REPO = os.path.dirname(os.path.dirname(HERE))  # the project repository
METHODS = ("ar", "eagle2", "lantern", "lantern++")


def make_spec(method: str, args):
    from runtime.core import MethodSpec, SamplingParams

    sp = SamplingParams(greedy=True, cfg=args.cfg)
    if method == "ar":
        return MethodSpec("ar", sp)
    if method == "eagle2":
        return MethodSpec("eagle2", sp, depth=4, top_k_draft=10, total_tokens=59)
    if method == "lantern":
        return MethodSpec("lantern", sp, depth=4, top_k_draft=10, total_tokens=59, lantern_k=args.lantern_k,
                          lantern_delta=args.lantern_delta, relax_rule="paper")
    if method == "lantern++":
        return MethodSpec("lantern++", sp, tree=args.tree, lantern_k=args.lantern_k,
                          lantern_lambda=args.lantern_lambda, relax_rule="paper")
    raise ValueError(method)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.path.join(WORK, "models"))
    ap.add_argument("--mode", choices=("graph", "eager"), required=True)
    ap.add_argument("--methods", default=",".join(METHODS))
    refenv.add_settings(ap)
    ap.add_argument("--no-gc", action="store_true", help="gc.disable() during the timed repeats")
    ap.add_argument("--phases", action="store_true", help="after the timed repeats, one extra untimed image per "
                    "method with the runtime's phase timer on (prefill/draft/verify/accept seconds)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from backends import get_backend
    from runtime.generation.loading import load_model
    from runtime.models.t5 import left_pad_captions
    from runtime.generation.pipeline import make_decoder

    backend = get_backend("cpu", dtype="fp32", graph_mode=args.mode == "graph")
    m = args.models
    loaded = load_model(model=None, gpt_model=None, gpt_ckpt=os.path.join(m, "target"), vq_ckpt=os.path.join(m, "vq.pt"),
                        image_size=None, drafter=os.path.join(m, "drafter"), gpt_type="t2i", trust=False,
                        device=backend.device, dtype=backend.dtype)
    data = np.load(os.path.join(m, "captions.npz"))
    emb, mask = left_pad_captions(torch.from_numpy(data["emb"]).float(), torch.from_numpy(data["mask"]).bool())
    n = min(args.images, emb.shape[0])
    work = [(emb[i:i + 1].to(backend.dtype), mask[i:i + 1], 0) for i in range(n)]

    methods = [x for x in args.methods.split(",") if x]
    decoders, build_s, warm_s = {}, {}, {}
    for meth in methods:
        t0 = time.perf_counter()
        decoders[meth] = make_decoder(loaded, make_spec(meth, args), backend, batch_size=1, watch_law=False)
        build_s[meth] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            decoders[meth].generate_one(*work[0])
        warm_s[meth] = time.perf_counter() - t0
        print(f"{meth:10s} built {build_s[meth]:.1f} s, warm-up {warm_s[meth]:.1f} s", flush=True)

    seconds = {x: [[None] * n for _ in range(args.repeats)] for x in methods}
    compiles = {x: [[None] * n for _ in range(args.repeats)] for x in methods}
    gcs = {x: [[None] * n for _ in range(args.repeats)] for x in methods}
    cpu = {x: [[None] * n for _ in range(args.repeats)] for x in methods}  # this process's CPU seconds
    tokens, stats = {}, {}
    if args.no_gc:
        gc.collect()
        gc.disable()
    for r in range(args.repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for meth in order:
            dec = decoders[meth]
            for i, (c, mk, seed) in enumerate(work):
                before = sum(backend.capture_count.values())
                gc_before = sum(s["collections"] for s in gc.get_stats())
                backend.synchronize()
                c0, t0 = time.process_time(), time.perf_counter()
                tok, st = dec.generate_one(c, mk, seed)
                backend.synchronize()
                seconds[meth][r][i] = time.perf_counter() - t0
                cpu[meth][r][i] = time.process_time() - c0
                compiles[meth][r][i] = sum(backend.capture_count.values()) - before
                gcs[meth][r][i] = sum(s["collections"] for s in gc.get_stats()) - gc_before
                t = tok.cpu().numpy().astype(np.int64)
                if meth in tokens and i < len(tokens[meth]):
                    if not np.array_equal(tokens[meth][i], t):
                        print(f"warning: {meth} image {i} tokens changed between repeats", file=sys.stderr)
                else:
                    tokens.setdefault(meth, []).append(t)
                    iters = st.target_forwards - 1
                    stats.setdefault(meth, []).append({
                        "target_forwards": st.target_forwards, "iterations": iters,
                        "accepted_tokens": st.accepted_tokens,
                        "tau": (st.accepted_tokens - 1) / iters if iters else None})
            per_image = sum(seconds[meth][r]) / n
            print(f"repeat {r} {meth:10s} {per_image:.3f} s/image", flush=True)
    if args.no_gc:
        gc.enable()
    phases = {}
    if args.phases:
        for meth in methods:
            dec = decoders[meth]
            dec.timer = backend.timer()
            t0 = time.perf_counter()
            dec.generate_one(*work[0])
            phases[meth] = {"wall_s": time.perf_counter() - t0, "phases": dec.timer.summary()}
            dec.timer = None
            print(f"phases {meth:10s} " + json.dumps(phases[meth]), flush=True)

    os.makedirs(args.out, exist_ok=True)
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain"], capture_output=True, text=True).stdout.split("\n")
    except OSError:
        commit, dirty = None, []
    result = {"side": "runtime", "mode": args.mode, "commit": commit, "dirty": [d for d in dirty if d],
              "threads": torch.get_num_threads(), "images": n, "repeats": args.repeats, "warmup": args.warmup,
              "settings": vars(args), "torch": torch.__version__, "platform": platform.platform(),
              "command": " ".join(sys.argv), "capture_count": dict(backend.capture_count), "methods": {}}
    for meth in methods:
        per_repeat = [sum(x) / n for x in seconds[meth]]
        toks = np.stack(tokens[meth])
        name = f"tokens_{meth.replace('+', 'p')}.npy"
        np.save(os.path.join(args.out, name), toks)
        result["methods"][meth] = {
            "spec": make_spec(meth, args).describe() if hasattr(make_spec(meth, args), "describe") else None,
            "per_image_s_repeats": per_repeat, "per_image_s_median": statistics.median(per_repeat),
            "image_s": seconds[meth], "compiles_during_image": compiles[meth], "gc_collections_during_image": gcs[meth],
            "process_cpu_s": cpu[meth],
            "build_s": build_s[meth], "warmup_s": warm_s[meth], "stats": stats[meth],
            "tokens_file": name, "tokens_shape": list(toks.shape), "phases_untimed_image0": phases.get(meth),
        }
        taus = [s["tau"] for s in stats[meth] if s["tau"] is not None]
        print(f"{meth:10s} median {statistics.median(per_repeat):.3f} s/image  repeats "
              + " ".join(f"{x:.3f}" for x in per_repeat) + (f"  tau {np.mean(taus):.2f}" if taus else ""))
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
