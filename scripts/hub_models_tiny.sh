#!/usr/bin/env bash
# Every method on the tests' tiny random Janus-Pro and Emu3 (tests/hf_tiny.py), by Hub id with
# HF_HUB_OFFLINE=1, as `runtime run` reports it: tau, target forwards, seconds per image. Greedy
# (tokens compared with AR's; lantern++ runs at the profile's relaxation and exact, lambda 1) and sampled. A drafter is trained for each target by
# `runtime train drafter` first. Writes OUT/summary.tsv and each run's folder.
#
#   bash scripts/hub_models_tiny.sh OUT
set -euo pipefail
OUT="${1:?usage: hub_models_tiny.sh OUT}"
mkdir -p "$OUT"
export HF_HOME="$OUT/hf_home" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python - "$HF_HOME" <<'EOF'
import sys
sys.path.insert(0, "tests")
from pathlib import Path
import hf_tiny
hf_tiny.write_hub_cache(Path(sys.argv[1]))
EOF
printf 'a red cat\nthe blue dog on the grass\na photo of a cat\nthe red dog\n' > "$OUT/prompts.txt"
printf 'model\tmode\tmethod\ttau\tforwards\ts_per_image\ttokens_equal_ar\n' > "$OUT/summary.tsv"
for model in tiny-random/Janus-Pro tiny-random/Emu3-Gen; do
  tag=${model#tiny-random/}
  size=(); [ "$tag" = Emu3-Gen ] && size=(--image-size 32)
  runtime train drafter --model "$model" "${size[@]}" --prompts "$OUT/prompts.txt" --num-images 64 --steps 200 \
    --batch 8 --eval-images 4 --device cpu --threads 1 --out "$OUT/$tag-drafter" > "$OUT/$tag-train.log" 2>&1
  for mode in greedy sampled; do
    flags=(); [ "$mode" = greedy ] && flags=(--greedy)
    for method in ar sjd pjd pjd-published lantern++ lantern++-exact eagle2; do
      extra=(--method "$method")
      case $method in
        pjd-published) extra=(--method pjd --accept published) ;;
        lantern++) extra=(--method lantern++ --tree chain3 --drafter "$OUT/$tag-drafter") ;;  # the profile's lambda
        lantern++-exact) extra=(--method lantern++ --tree chain3 --lantern-lambda 1 --drafter "$OUT/$tag-drafter") ;;
        eagle2) extra=(--method eagle2 --drafter "$OUT/$tag-drafter") ;;
      esac
      dir="$OUT/$tag-$mode-$method"
      # 4 prompts x 4 = 16 images; one warm-up image first (the same command on 1 image)
      runtime run --model "$model" "${size[@]}" --prompts "$OUT/prompts.txt" --num-images 1 --device cpu \
        --no-graph "${flags[@]}" "${extra[@]}" --out "$dir-warmup" > /dev/null 2>&1
      runtime run --model "$model" "${size[@]}" --prompts "$OUT/prompts.txt" --num-images 16 --seed 1 \
        --device cpu --no-graph "${flags[@]}" "${extra[@]}" --out "$dir" > "$dir.log" 2>&1
      python - "$dir" "$OUT/$tag-$mode-ar" "$model" "$mode" "$method" >> "$OUT/summary.tsv" <<'EOF'
import json, sys
import numpy as np
d, ar, model, mode, method = sys.argv[1:]
r = json.load(open(f"{d}/result.json"))
stats = r.get("stats", {})
t = r["timing"]
equal = bool((np.load(f"{d}/tokens.npy") == np.load(f"{ar}/tokens.npy")).all()) if mode == "greedy" else "-"
tau = stats.get("mean_accepted_length")
print("\t".join(map(str, [model, mode, method, f"{tau:.2f}" if tau else "-", stats.get("target_forwards", "-"),
                          f"{t['total_s'] / 16:.4f}", equal])))
EOF
    done
  done
done
column -t -s $'\t' "$OUT/summary.tsv"
