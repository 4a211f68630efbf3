"""Make a tiny random Lumina-mGPT-layout Chameleon with the released PJD code's own model class
(boyaliao/PJD @ e7b93ad, lumina_mgpt/model/chameleon/modeling_chameleon.py), no downloads.

    OMP_NUM_THREADS=1 $PJDHARNESS_WORK/venv/bin/python make_model.py --out $PJDHARNESS_WORK/tiny

Writes under --out:
  model/config.json, model/model.safetensors   the PJD ChameleonForConditionalGeneration, saved with
                                                save_pretrained; config.json's `architectures` set to
                                                ["ChameleonXLLMXForConditionalGeneration"] (Lumina-mGPT's),
                                                which is what the runtime keys its Lumina layout on
  model/tokenizer.json                          a word-level tokenizer over the vocabulary (the
                                                prompt words; the runtime's PromptEncoder and the
                                                harness's stub item processor both read it)
  ckpts/chameleon/tokenizer/text_tokenizer.json {"model": {"vocab": vocabulary_map}}, the file the
                                                released `_init_new_params` reads relative to its
                                                working directory to list the image tokens
  reference_logits.pt                           the PJD model's full-vocabulary logits (plain forward,
                                                no cache) on one runtime-layout prompt + image tokens,
                                                for runtime_check.py

The vocabulary keeps Chameleon's ids for everything the released code hardcodes (pjdenv.py): image
tokens 4..8195 (8192 codes: the processors' range(4, 8195 + 1), so the image vocabulary cannot be
made smaller), <eoss> 8196, <racm3:break> 8197, <reserved08706> 8710, <reserved08799> (row end)
8803, size tokens <reserved{8800+g}> = 8804 + g; the prompt words follow at 8840.., 8880 tokens in
all. Weights: the class's own init (std 0.02), then, like tests/test_chameleon.py's tiny model,
every norm weight/bias perturbed by N(0, 0.1) and lm_head drawn N(0, --head-std) so the
next-token distributions are peaked enough for draws to repeat. q/k norms: model_parallel_size =
heads, so each head has its own LayerNorm weight (heads, head_dim) as in transformers' layout.
mask_image_logits is False (Lumina-mGPT generates image tokens; True would mask all of them).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import pjdenv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(pjdenv.WORK, "tiny"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--head-std", type=float, default=0.5)
    ap.add_argument("--norm-noise", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-size", type=int, default=256, help="image size of the reference-logits prompt")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    pjdenv.install()
    from model.chameleon.configuration_chameleon import ChameleonConfig
    from model.chameleon.modeling_chameleon import ChameleonForConditionalGeneration

    vocab = pjdenv.vocabulary_map()
    vq = dict(embed_dim=8, num_embeddings=pjdenv.N_CODES, latent_channels=8, resolution=args.check_size,
              in_channels=3, base_channels=32, channel_multiplier=[1, 1, 2, 2, 4], num_res_blocks=1,
              attn_resolutions=[])
    cfg = ChameleonConfig(
        vocab_size=pjdenv.VOCAB_SIZE, hidden_size=args.dim, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=4096, model_parallel_size=args.heads, vq_config=vq, vocabulary_map=vocab,
        mask_image_logits=False, bos_token_id=pjdenv.BOS, eos_token_id=pjdenv.EOS, pad_token_id=pjdenv.PAD,
        rope_theta=10000.0)
    torch.manual_seed(args.seed)
    model = ChameleonForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "vqmodel" not in name:
                p.add_(torch.randn_like(p) * args.norm_noise)
        model.lm_head.weight.normal_(0, args.head_std)

    out = os.path.abspath(args.out)
    mdir = os.path.join(out, "model")
    os.makedirs(mdir, exist_ok=True)
    model.save_pretrained(mdir, safe_serialization=True)
    path = os.path.join(mdir, "config.json")
    config = json.load(open(path))
    config["architectures"] = ["ChameleonXLLMXForConditionalGeneration"]
    json.dump(config, open(path, "w"), indent=2)

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(os.path.join(mdir, "tokenizer.json"))
    tdir = os.path.join(out, "ckpts", "chameleon", "tokenizer")
    os.makedirs(tdir, exist_ok=True)
    with open(os.path.join(tdir, "text_tokenizer.json"), "w") as f:
        f.write(pjdenv.text_tokenizer_json(vocab))

    # reference logits: the runtime's Lumina prompt layout + a few image tokens and a row end
    size = args.check_size
    words = tok.encode(pjdenv.lumina_question("a red cat", size), add_special_tokens=False).ids
    prompt = [pjdenv.BOS, *words, pjdenv.END_OF_TURN, pjdenv.IMAGE_START, pjdenv.size_token(size),
              pjdenv.size_token(size)]
    g = torch.Generator().manual_seed(1)
    side = size // 16
    image = (4 + torch.randint(0, pjdenv.N_CODES, (side + 3,), generator=g)).tolist()
    image[side] = pjdenv.ROW_END
    ids = torch.tensor([prompt + image])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False, return_dict=True).logits.float()
    torch.save({"prompt": prompt, "image": image, "logits": logits[0], "size": size},
               os.path.join(out, "reference_logits.pt"))
    n = sum(p.numel() for k, p in model.named_parameters() if "vqmodel" not in k)
    print(json.dumps({"out": out, "decoder_params": n, "vocab_size": pjdenv.VOCAB_SIZE, "layers": args.layers,
                      "dim": args.dim, "heads": args.heads, "ffn": args.ffn, "head_std": args.head_std,
                      "attn_implementation": model.config._attn_implementation}))


if __name__ == "__main__":
    main()
