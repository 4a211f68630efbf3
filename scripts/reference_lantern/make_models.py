"""Make a tiny LlamaGen-T2I target in LANTERN's HF layout, a drafter folder in LANTERN's
cnets_llamagen layout, a random LlamaGen VQ-16 checkpoint, fixed caption embeddings and the
reference's neighbour table -- all from fixed seeds.

    venv/bin/python make_models.py [--layers 8 --dim 512 --heads 8 --sigma 0.02] [--tune]

Writes (under --out, default $REFHARNESS_WORK/models):
  target/config.json + target/model.safetensors   reference LlamaForCausalLM (modeling_llamagen_kv.py)
  drafter/config.json + drafter/pytorch_model.bin  reference cnets_llamagen.Model state dict
  vq.pt                                            {"model": VQ_16 state dict} (LlamaGen layout)
  captions.npz                                     emb (n,120,2048) right-padded as T5 returns it, mask (n,120)
and refcwd/ckpts/llamagen/vq_distances/top_16383_indices.npy (the path EaModel reads relative to
its working directory), built the way entrypoints/generate_codebook.py builds it (cdist p=2 over
the raw quantize.embedding.weight, diagonal inf, ascending topk), but kept to the first 1024
columns and stored as int64 (the reference's greedy path `gather`s with it; uint16 is refused).

Weights are random but shaped so the drafter agrees with the target often: the target's layers are
small next to the token embedding in the residual stream, so its next token is mostly a fixed
function of the current one (argmax lm_head(e_x)), which the drafter (fc = [I | 0] on
[embedding, feature], the target's embedding, small layer weights, the target's head at run time)
computes exactly; --sigma (the target layers' weight std) sets how often the layers overrule it.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

import refenv

refenv.install()

from safetensors.torch import save_file  # noqa: E402
from transformers.models.llama import LlamaConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = refenv.WORK


def target_config(layers: int, dim: int, heads: int) -> dict:
    ffn = ((int(8 * dim / 3) + 255) // 256) * 256  # LlamaGen's SwiGLU width (multiple_of 256)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": dim, "intermediate_size": ffn, "multiple_of": 256,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "rms_norm_eps": 1e-5, "vocab_size": 16384, "block_size": 256, "cls_token_num": 120,
        "input_type": "t2i", "caption_dim": 2048, "num_classes": 1000, "class_dropout_p": 0.1,
        "token_dropout_p": 0.0, "resid_dropout_p": 0.0, "ffn_dropout_p": 0.0,
        "rope_base": 10000, "rope_theta": 10000.0, "attention_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": False, "max_position_embeddings": 2048, "initializer_range": 0.02,
        "bos_token_id": 1, "eos_token_id": 2, "use_cache": True, "torch_dtype": "float32",
    }


def drafter_config(dim: int, heads: int, ffn: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": dim, "intermediate_size": ffn, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": heads, "rms_norm_eps": 1e-6,
        "vocab_size": 16384, "max_position_embeddings": 2048, "input_type": "t2i", "bias": True,
        "pretraining_tp": 1, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def build_target(cfg: dict, sigma: float, head_scale: float, seed: int):
    from models.kv_variants.modeling_llamagen_kv import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    dim = cfg["hidden_size"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) * head_scale / dim ** 0.5)
            elif ".layers." in name:
                p.copy_(torch.randn(p.shape, generator=g) * sigma)
            elif "cls_embedding.cap_proj" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                raise RuntimeError(f"unexpected parameter {name}")
        emb = model.model.cls_embedding.uncond_embedding
        emb.copy_(torch.randn(emb.shape, generator=g) / emb.shape[1] ** 0.5)
    return model


def build_drafter(dcfg: dict, target, sigma: float, seed: int):
    from models.configs.configs import EConfig
    from models.drafters.cnets_llamagen import Model

    torch.manual_seed(seed)
    model = Model(EConfig(**dcfg), bias=True, total_tokens=59, depth=4, top_k=10).eval()
    g = torch.Generator().manual_seed(seed + 2)
    dim = dcfg["hidden_size"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embed_tokens.weight":
                p.copy_(target.model.embed_tokens.weight)
            elif name == "fc.weight":
                w = torch.zeros(p.shape)
                w[:, :dim] = torch.eye(dim)
                w += torch.randn(p.shape, generator=g) * 0.002
                p.copy_(w)
            elif name == "fc.bias":
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.startswith("layers."):
                p.copy_(torch.randn(p.shape, generator=g) * sigma)
            else:
                raise RuntimeError(f"unexpected drafter parameter {name}")
    return model


def build_vq(seed: int):
    from models.base_models.llamagen.vq_model import VQ_16

    torch.manual_seed(seed)
    vq = VQ_16(codebook_size=16384, codebook_embed_dim=8).eval()
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():  # raw (un-normalised) codebook rows, as a trained checkpoint stores them
        w = torch.randn(16384, 8, generator=g) * (0.5 + torch.rand(16384, 1, generator=g))
        vq.quantize.embedding.weight.copy_(w)
    return vq


def neighbour_table(vq, keep: int = 1024) -> np.ndarray:
    latents = vq.quantize.embedding.weight.detach()
    distances = torch.cdist(latents, latents, p=2)
    distances.fill_diagonal_(float("inf"))
    _, idx = torch.topk(distances, keep, dim=-1, largest=False)
    return idx.to(torch.int64).numpy()


def make_captions(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(seed + 4)
    emb = torch.randn(n, 120, 2048, generator=g) * 0.2
    emb = emb.to(torch.bfloat16).float()  # flan-t5-xl runs in bf16 in the reference
    lengths = [12, 27, 45, 8, 70, 19, 33, 100][:n] + [20] * max(0, n - 8)
    mask = torch.zeros(n, 120, dtype=torch.int64)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1  # valid tokens first, padding after (T5 tokenizer's right padding)
    return emb.numpy(), mask.numpy()


@torch.no_grad()
def agreement(target, drafter, captions, cfg_scale: float) -> dict:
    """Teacher-forced top-1 agreement between the target's next token (CFG-mixed) and the
    drafter's, on random image-token sequences; a cheap proxy for acceptance."""
    emb, mask = captions
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(min(2, emb.shape[0])):
        e, m = torch.from_numpy(emb[i]), torch.from_numpy(mask[i])
        n = int(m.sum())
        c = torch.cat([e[n:], e[:n]])[None] * torch.flip(m, [0])[None, :, None]
        cond = torch.cat([c, torch.zeros_like(c) + target.model.cls_embedding.uncond_embedding])
        am = torch.cat([torch.flip(m, [0])[None]] * 2)
        # greedy-ish trajectory: follow the target's own argmax 64 steps by teacher forcing rounds
        toks = torch.randint(0, 16384, (1, 64), generator=g)
        for _ in range(3):
            ids = torch.cat([toks, toks])
            outp = target.model(input_ids=ids, cond_idx=cond, attention_mask=torch.cat([am, torch.ones(2, 64, dtype=am.dtype)], 1))
            h = outp[0]
            logits = target.lm_head(h).float()
            mixed = logits[1:] + (logits[:1] - logits[1:]) * cfg_scale
            nxt = mixed[0, 119:-1].argmax(-1)  # prediction for tokens 0..63
            toks = torch.cat([nxt[:1], nxt[1:]])[None]
        # drafter: input (embedding of token j+1, target feature at j) predicts token j+2
        ids = torch.cat([toks, toks])
        outp = target.model(input_ids=ids, cond_idx=cond, attention_mask=torch.cat([am, torch.ones(2, 64, dtype=am.dtype)], 1))
        h = outp[0]
        logits = target.lm_head(h).float()
        mixed = logits[1:] + (logits[:1] - logits[1:]) * cfg_scale
        tgt_next = mixed[0, 120:-1].argmax(-1)  # target's token after image token j (j = 0..62)
        d_in = torch.cat([torch.zeros(2, 119, dtype=torch.long), ids], 1)
        d_h = drafter(h[:, :-1], input_ids=d_in[:, : h.shape[1] - 1])
        d_logits = target.lm_head(d_h).float()
        d_mixed = d_logits[1:] + (d_logits[:1] - d_logits[1:]) * cfg_scale
        d_next = d_mixed[0, 119:-1].argmax(-1)
        probs = torch.softmax(mixed[0, 120:-1], -1)
        out.append({"top1": float((d_next == tgt_next).float().mean()),
                    "target_top_prob": float(probs.max(-1).values.mean())})
    return {k: sum(o[k] for o in out) / len(out) for k in out[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(WORK, "models"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--sigma", type=float, default=0.015, help="target layer weight std")
    ap.add_argument("--drafter-sigma", type=float, default=0.005)
    ap.add_argument("--head-scale", type=float, default=4.0, help="lm_head logit std on a unit-RMS state")
    ap.add_argument("--captions", type=int, default=4)
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tune", action="store_true", help="print agreement only, write nothing")
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = target_config(args.layers, args.dim, args.heads)
    dcfg = drafter_config(args.dim, args.heads, cfg["intermediate_size"])
    target = build_target(cfg, args.sigma, args.head_scale, args.seed)
    drafter = build_drafter(dcfg, target, args.drafter_sigma, args.seed)
    captions = make_captions(args.captions, args.seed)
    if args.tune:
        print(json.dumps({"sigma": args.sigma, "head_scale": args.head_scale,
                          **agreement(target, drafter, captions, args.cfg)}))
        return

    tdir, ddir = os.path.join(args.out, "target"), os.path.join(args.out, "drafter")
    os.makedirs(tdir, exist_ok=True)
    os.makedirs(ddir, exist_ok=True)
    with open(os.path.join(tdir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in target.state_dict().items()}, os.path.join(tdir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(ddir, "config.json"), "w") as f:
        json.dump(dcfg, f, indent=2)
    torch.save({k: v.contiguous() for k, v in drafter.state_dict().items()}, os.path.join(ddir, "pytorch_model.bin"))
    vq = build_vq(args.seed)
    torch.save({"model": vq.state_dict()}, os.path.join(args.out, "vq.pt"))
    np.savez(os.path.join(args.out, "captions.npz"), emb=captions[0], mask=captions[1])
    table = neighbour_table(vq)
    np.save(os.path.join(args.out, "top_16383_indices.npy"), table)  # reference_run.py --table default
    # EaModel.__init__ np.load()s this path relative to its working directory (reference_run.py
    # chdirs to refcwd); it holds the default models' table and is overwritten by each run
    table_dir = os.path.join(WORK, "refcwd", "ckpts", "llamagen", "vq_distances")
    os.makedirs(table_dir, exist_ok=True)
    np.save(os.path.join(table_dir, "top_16383_indices.npy"), table)
    meta = {"args": vars(args), "target_params": sum(p.numel() for p in target.parameters()),
            "drafter_params": sum(p.numel() for p in drafter.parameters()),
            "agreement": agreement(target, drafter, captions, args.cfg)}
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
