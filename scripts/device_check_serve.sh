#!/usr/bin/env bash
# A lent GPU's serving checks (docs/serving.md, "Load test"), in order of value:
#  1. the load test on the demo (LANTERN++ and AR, batch 8): served vs offline images/s, latency;
#  2. the same on a LlamaGen-XL-shaped model with random weights (python -m runtime.bench.projection
#     writes it in LlamaGen's layout; the speed is the real shape's, the images are noise);
#  3. the drain under load (--sigterm-after) on the demo.
# Each load test checks every image against offline generation and that the server exits 0 on
# SIGTERM. Results land in $OUT (the device tool) or ./out. Run from the repository root, with
# the serve extra's wheels in .whl/ (carried: the device machine reaches no package index).
set -uo pipefail
# shellcheck source=scripts/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
LOAD="python3 -m runtime.serve.load --concurrency 16 --max-n 3 --verify 8"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, fastapi, uvicorn; print('torch', torch.__version__, 'fastapi', fastapi.__version__)"

  echo "== 1 demo"
  for m in lantern++ ar; do
    LANTERN_CUDA_FUSE=0 timeout 150 $LOAD --requests 200 --out "$OUT/serve_load_cuda_demo_${m/++/pp}.json" \
      -- --device cuda --profile-name h100 --batch-size 8 --method "$m"; echo "rc=$?"
  done

  echo "== 2 xl-shaped"
  FLAGS=$(timeout 120 python3 -m runtime.bench.projection --shape llamagen-xl --out /tmp/xl | tail -1)
  echo "$FLAGS"
  for m in "lantern++ --tree chain3" ar; do
    name=${m%% *}
    LANTERN_CUDA_FUSE=0 timeout 200 $LOAD --requests 48 --out "$OUT/serve_load_cuda_xlshape_${name/++/pp}.json" \
      -- --device cuda --profile-name h100 $FLAGS --batch-size 8 --method $m; echo "rc=$?"
  done

  echo "== 3 drain under load"
  LANTERN_CUDA_FUSE=0 timeout 90 $LOAD --requests 120 --sigterm-after 40 --out "$OUT/serve_drain_cuda_demo.json" \
    -- --device cuda --profile-name h100 --batch-size 8 --method lantern++; echo "rc=$?"
} 2>&1 | tee "$OUT/device_log_serve.txt"
