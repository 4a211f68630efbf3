"""Run the released Parallel Jacobi Decoding loop (boyaliao/PJD @ e7b93ad,
scheduler/jacobi_iteration_lumina_mgpt.py) unmodified on the tiny model from make_model.py, on
CPU in fp32, as test_lumina_mgpt.py drives it, and record per image the target forwards and, per
forward, each ongoing image row's window and committed token count.

    cd $PJDHARNESS_WORK/tiny && OMP_NUM_THREADS=1 $PJDHARNESS_WORK/venv/bin/python \
        /path/to/scripts/reference_pjd/released_run.py --work . --out ../results/released_topk2000.json

How it is driven (test_lumina_mgpt.py): FlexARInferenceSolver(model_path, precision, target_size,
device) -> renew_pipeline_sampler(solver, max_num_new_tokens=8, guidance_scale=3.0, seed,
multi_token_init_scheme='random', do_cfg=True, image_top_k, text_top_k=10,
prefix_token_sampler_scheme='speculative_jacobi', target_size) -> per image: solver.model.seed =
seed; solver.generate(images=[], qas=[[question, None]], max_gen_len=8192, temperature=1.0,
logits_processor=solver.create_logits_processor(cfg=3.0, image_top_k=...)). Here precision is
"fp32" and device "cpu" (the script: bf16, cuda:0), target_size --size (the script: 768), seeds are
integers (the script: [None], i.e. the global RNG unseeded), and the tiny model's folder replaces
the downloaded checkpoint. Note: `max_num_new_tokens` is accepted and ignored by the released
`_init_new_params`; the window is its hardcoded `window_size = 8` (and `long_size = 9`).

Workarounds (pjdenv.py's three, plus):
  4. The working directory must hold ckpts/chameleon/tokenizer/text_tokenizer.json (the released
     `_init_new_params` opens it by that relative path to list the image tokens); make_model.py
     writes it in the work folder, and this script chdirs there.
  5. A random tiny model does not itself write Lumina-mGPT's image header (<racm3:break> and the
     two size tokens, which the real model samples in text mode before the Jacobi phase). A logits
     processor appended after the released ones (`ForceImageHeader`) puts all mass on them while
     the header is incomplete and passes scores through untouched afterwards. Those three
     forwards (and the prompt's prefill) are counted apart from the image forwards.
  6. transformers 4.45.2 (the released code imports `_flash_attention_forward`, GenerateNonBeamOutput,
     `generation_config._pad_token_tensor`: 4.43 - 4.46 era) passes no `logits_warper` to `_sample`
     (warpers were merged into `logits_processor` in 4.45); the released `_sample` then skips its
     warper branch, and the released create_logits_processor puts its top-k warper in the
     processor list, so top-k is applied either way.
Instrumentation, from outside only: a forward pre-hook on the model counts forwards and input
lengths; the instance attribute `prefix_matching_next_tokens` wraps the released method to log the
ongoing rows, their windows (`verify_num`) and the per-row committed counts it returns; the instance
attributes `_sample` / `generate` wrap the released ones to record the processor list and the
returned sequence.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

import pjdenv

PROMPTS = ["a red cat on the grass", "a lighthouse at night by the sea"]
RELEASED_FILES = ["scheduler/jacobi_iteration_lumina_mgpt.py", "scheduler/logit_processor_3dim.py",
                  "lumina_mgpt/inference_solver.py", "lumina_mgpt/model/chameleon/modeling_chameleon.py"]


class ForceImageHeader:
    """Workaround 5: <racm3:break>, size, size while the image header is incomplete."""

    def __init__(self, size: int) -> None:
        self.seq = [pjdenv.IMAGE_START, pjdenv.size_token(size), pjdenv.size_token(size)]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ids = input_ids[0].tolist()
        if pjdenv.IMAGE_START in ids:
            after = len(ids) - 1 - ids.index(pjdenv.IMAGE_START)
            if after >= 2:
                return scores
            k = 1 + after
        else:
            k = 0
        forced = torch.full_like(scores, -math.inf)
        forced[..., self.seq[k]] = 0.0
        return forced


class Recorder:
    current: "Recorder | None" = None

    def __init__(self, model) -> None:
        self.model = model
        self.reset()
        model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        orig = model.prefix_matching_next_tokens

        def prefix_matching_next_tokens(*args, **kwargs):
            rows = [int(r) for r in model.ongoing_row_list]
            window = [int(model.verify_num[r]) for r in rows]
            out = orig(*args, **kwargs)
            counts = out[0]
            n_in = int(kwargs["model_input_ids"].shape[1])
            shape = self.shapes.pop() if self.shapes else None
            self.rounds.append({"rows": rows, "window": window,
                                "committed": None if counts is None else [int(c) for c in counts],
                                "input_len": n_in, "sampler_draft_len": None if shape is None else shape[0],
                                "sampler_target_len": None if shape is None else shape[1]})
            return out

        model.prefix_matching_next_tokens = prefix_matching_next_tokens
        sampler_cls = sys.modules[type(model).__module__].SpeculativeSampler
        if not getattr(sampler_cls, "_pjdharness", False):
            orig_call = sampler_cls.__call__

            def __call__(sampler, draft_tokens, advanced_tokens, *args, **kwargs):
                Recorder.current.shapes.append((int(draft_tokens.shape[1]), int(advanced_tokens.shape[1])))
                return orig_call(sampler, draft_tokens, advanced_tokens, *args, **kwargs)

            sampler_cls.__call__ = __call__
            sampler_cls._pjdharness = True
        Recorder.current = self
        orig_sample = model._sample

        def _sample(*args, **kwargs):
            lp = kwargs.get("logits_processor", args[1] if len(args) > 1 else None)
            self.processors = [type(p).__name__ for p in lp] if lp is not None else None
            self.warper = kwargs.get("logits_warper")
            return orig_sample(*args, **kwargs)

        model._sample = _sample
        orig_generate = model.generate

        def generate(*args, **kwargs):
            out = orig_generate(*args, **kwargs)
            self.sequence = out[0].tolist()
            return out

        model.generate = generate

    def reset(self) -> None:
        self.forwards: list[int] = []  # input length (cond half) of each forward
        self.rounds: list[dict] = []
        self.shapes: list[tuple[int, int]] = []  # (draft_tokens, advanced_tokens) lengths per sampler call
        self.sequence: list[int] | None = None
        self.processors = None
        self.warper = None

    def _pre_forward(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.forwards.append(int(ids.shape[1]) if ids is not None else -1)


def parse_image(generated: list[int], side: int) -> tuple[list[list[int]] | None, str]:
    """The generated ids after the prompt -> (side x side VQ codes, 'ok' or what is wrong)."""
    try:
        s = generated.index(pjdenv.IMAGE_START)
    except ValueError:
        return None, "no <racm3:break>"
    body = generated[s + 3:]
    need = side * (side + 1)
    if len(body) < need + 1:
        return None, f"image body has {len(body)} tokens, want {need} + <eoss>"
    grid, problems = [], []
    for r in range(side):
        row = body[r * (side + 1):(r + 1) * (side + 1)]
        if row[-1] != pjdenv.ROW_END:
            problems.append(f"row {r} ends with {row[-1]}")
        bad = [t for t in row[:-1] if not 4 <= t < 4 + pjdenv.N_CODES]
        if bad:
            problems.append(f"row {r} has non-image ids {bad[:3]}")
        grid.append([t - 4 for t in row[:-1]])
    if body[need] != pjdenv.IMAGE_END:
        problems.append(f"after the rows comes {body[need]}, not <eoss>")
    return grid, "ok" if not problems else "; ".join(problems)


def summarize_rounds(rounds: list[dict], side: int) -> dict:
    image_rounds = [r for r in rounds if r["committed"] is not None]
    per_row: dict[int, list[int]] = {}
    per_row_drafts: dict[int, list[int]] = {}
    for rd in image_rounds:
        for k, (row, c) in enumerate(zip(rd["rows"], rd["committed"])):
            per_row.setdefault(row, []).append(c)
            # the first ongoing row commits its accepted drafts + one sampled token (residual or
            # bonus); later rows commit accepted drafts only
            per_row_drafts.setdefault(row, []).append(c - 1 if k == 0 else c)
        rd["drafts_accepted"] = [c - 1 if k == 0 else c for k, c in enumerate(rd["committed"])]
        rd["extra_input"] = rd["input_len"] - sum(rd["window"])
    committed = sum(sum(r["committed"]) for r in image_rounds)
    return {
        "image_forwards": len(image_rounds),
        "committed_total": committed,
        "mean_committed_per_forward": committed / max(1, len(image_rounds)),
        "mean_rows_per_forward": statistics.mean(len(r["rows"]) for r in image_rounds) if image_rounds else 0,
        "max_rows_per_forward": max((len(r["rows"]) for r in image_rounds), default=0),
        "forwards_with_extra_input": sum(1 for r in image_rounds if r["extra_input"]),
        "forwards_with_misaligned_sampler_inputs": sum(1 for r in image_rounds if r["sampler_draft_len"] is not None
                                                       and r["sampler_draft_len"] != r["sampler_target_len"]),
        "per_row": {str(row): {"forwards": len(c), "committed": sum(c), "mean_committed": sum(c) / len(c),
                               "mean_drafts_accepted": sum(per_row_drafts[row]) / len(c)}
                    for row, c in sorted(per_row.items())},
    }


def sha256(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=os.path.join(pjdenv.WORK, "tiny"), help="make_model.py's --out")
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--size", type=int, default=256, help="target_size px (rows = cols = size / 16)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--image-top-k", type=int, default=2000)
    ap.add_argument("--text-top-k", type=int, default=10)
    ap.add_argument("--max-num-new-tokens", type=int, default=8, help="passed as the script does; ignored by the code")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = os.path.abspath(args.work)
    out_path = os.path.abspath(args.out)
    os.chdir(work)  # workaround 4
    pjdenv.TOKENIZER_JSON = os.path.join(work, "model", "tokenizer.json")
    jac = pjdenv.install()
    from lumina_mgpt.inference_solver import FlexARInferenceSolver

    if args.size % 32 or args.size // 32 > pjdenv.MAX_GRID:
        raise SystemExit("--size must be a multiple of 32, at most 1024")
    side = args.size // 16
    seeds = [int(s) for s in args.seeds.split(",")]
    solver = FlexARInferenceSolver(model_path=os.path.join(work, "model"), precision="fp32",
                                   target_size=args.size, device="cpu")
    solver = jac.renew_pipeline_sampler(
        solver, max_num_new_tokens=args.max_num_new_tokens, guidance_scale=args.cfg, seed=seeds[0],
        multi_token_init_scheme="random", do_cfg=True, image_top_k=args.image_top_k, text_top_k=args.text_top_k,
        prefix_token_sampler_scheme="speculative_jacobi", target_size=args.size)
    model = solver.model
    rec = Recorder(model)
    settings = {
        "target_size": args.size, "rows": side, "cols": side, "tokens_per_row": model.tokens_per_row,
        "window_size": model.window_size, "long_size": model.long_size,
        "max_num_new_tokens_passed": args.max_num_new_tokens, "guidance_scale": args.cfg,
        "image_top_k": args.image_top_k, "text_top_k": args.text_top_k, "temperature": 1.0,
        "max_gen_len": 8192, "multi_token_init_scheme": "random", "do_cfg": True,
        "prefix_token_sampler_scheme": "speculative_jacobi", "precision": "fp32", "device": "cpu",
        "threads": args.threads, "seeds": seeds, "img_vocab_size": int(model.img_vocab.numel()),
    }
    images = []
    for p in range(args.prompts):
        prompt = PROMPTS[p % len(PROMPTS)]
        question = pjdenv.lumina_question(prompt, args.size)
        for seed in seeds:
            model.seed = seed
            rec.reset()
            lp = solver.create_logits_processor(cfg=args.cfg, image_top_k=args.image_top_k)
            lp.append(ForceImageHeader(args.size))
            t0 = time.perf_counter()
            text, imgs = solver.generate(images=[], qas=[[question, None]], max_gen_len=8192, temperature=1.0,
                                         logits_processor=lp)
            seconds = time.perf_counter() - t0
            prompt_ids = solver.item_processor.process_item(
                {"image": [], "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": None}]})
            generated = rec.sequence[len(prompt_ids):]
            grid, status = parse_image(generated, side)
            summary = summarize_rounds(rec.rounds, side)
            images.append({
                "prompt": prompt, "question": question, "seed": seed, "prompt_ids": prompt_ids,
                "steps": len(rec.forwards), "steps_before_image": len(rec.forwards) - summary["image_forwards"],
                **summary, "seconds": seconds, "grid_status": status,
                "generated_ids": generated, "codes": grid, "decoded_text": text,
                "forward_input_lengths": rec.forwards, "forwards": rec.rounds,
                "processors_seen_by_sample": rec.processors, "logits_warper_passed": rec.warper is not None,
            })
            print(json.dumps({"prompt": prompt, "seed": seed, "steps": len(rec.forwards),
                              "image_forwards": summary["image_forwards"],
                              "mean_committed_per_forward": round(summary["mean_committed_per_forward"], 3),
                              "grid": status, "seconds": round(seconds, 1)}), flush=True)
    import transformers

    result = {
        "released": {"repo": "boyaliao/PJD", "commit": pjdenv.PJD_COMMIT, "checkout": pjdenv.PJD,
                     "entry": "scheduler/jacobi_iteration_lumina_mgpt.py: renew_pipeline_sampler",
                     "sha256": {f: sha256(os.path.join(pjdenv.PJD, f)) for f in RELEASED_FILES}},
        "env": {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "attn_implementation": model.config._attn_implementation},
        "model": {"folder": os.path.join(work, "model"), "vocab_size": model.config.vocab_size,
                  "hidden_size": model.config.hidden_size, "layers": model.config.num_hidden_layers,
                  "heads": model.config.num_attention_heads, "ffn": model.config.intermediate_size},
        "settings": settings,
        "summary": {
            "images": len(images),
            "steps": [im["steps"] for im in images],
            "image_forwards": [im["image_forwards"] for im in images],
            "mean_committed_per_image_forward": [round(im["mean_committed_per_forward"], 4) for im in images],
            "grid_status": [im["grid_status"] for im in images],
        },
        "images": images,
    }
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
