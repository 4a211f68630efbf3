#!/usr/bin/env bash
# One lent-GPU session's checks, in order of value (each step has its own time limit):
#  1. same-run bench of the methods on the demo (steps captured as CUDA graphs of eager kernels:
#     LANTERN_CUDA_FUSE=0, because inductor's sd.draft kernel faulted on torch 2.11 / H200);
#  2. sampling-at-scale throughput (runtime sample, ADM layout) for lantern++ and ar;
#  3. eval-pipeline throughput (runtime eval, torch-fidelity InceptionV3 with random weights);
#  4. the inductor fault, re-run with CUDA_LAUNCH_BLOCKING=1 and the generated code logged;
#  5. the quick cuda-marked tests.
# Results land in $OUT (the device tool) or ./out. Run from the repository root.
set -uo pipefail
# shellcheck source=scripts/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
P="--device cuda --profile-name h100"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

  echo "== 1 bench"
  LANTERN_CUDA_FUSE=0 timeout 150 runtime bench $P --methods ar,sd,eagle2,lantern,lantern++ --num-images 16 \
    --warmup 1 --repeats 5 --out /tmp/bench/cuda_demo_graph_eagerkernels_sampling.json; echo "rc=$?"
  cp /tmp/bench/*.json "$OUT/" 2>/dev/null

  echo "== 2 sample"
  for m in lantern++ ar; do
    LANTERN_CUDA_FUSE=0 timeout 60 runtime sample $P --method "$m" --num-images 96 --chunk 48 --batch-size 16 \
      --out "/tmp/sample_$m"; echo "rc=$?"
    cp "/tmp/sample_$m/result.json" "$OUT/cuda_sample_${m/++/pp}.json" 2>/dev/null
  done

  echo "== 3 eval"
  python3 -c "from runtime.metrics.fidelity import save_random_inception as s; s('/tmp/inception.safetensors')"
  python3 -c "import numpy as np; from runtime.metrics.adm import write_npz; \
a = np.random.default_rng(0).integers(0, 256, (1024, 256, 256, 3), dtype=np.uint8); write_npz('/tmp/rand.npz', a.shape, [a])"
  timeout 60 runtime eval /tmp/rand.npz --reference /tmp/sample_ar --inception-weights /tmp/inception.safetensors \
    --device cuda --bootstrap 0 --batch-size 128 --out "$OUT/cuda_eval_1024x256px.json"; echo "rc=$?"
  timeout 60 runtime eval /tmp/sample_lantern++ --reference /tmp/sample_ar --inception-weights /tmp/inception.safetensors \
    --device cuda --bootstrap 20 --out "$OUT/cuda_eval_demo_lpp_vs_ar.json"; echo "rc=$?"

  echo "== 4 inductor fault"
  CUDA_LAUNCH_BLOCKING=1 TORCH_LOGS=output_code timeout 60 runtime bench $P --methods sd --num-images 1 --warmup 0 \
    --repeats 1 --no-quality --no-measure-law --out /tmp/diag.json > /tmp/diag.log 2>&1; echo "rc=$?"
  grep -n -i "misaligned\|error" /tmp/diag.log | head -20
  tail -n 150 /tmp/diag.log > "$OUT/inductor_fault_tail.txt"; gzip -c /tmp/diag.log > "$OUT/inductor_fault.log.gz"

  echo "== 5 cuda tests"
  timeout 60 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_backends.py \
    "tests/test_accelerators.py::test_bf16_incremental_decoding_matches_full_forward"; echo "rc=$?"
} 2>&1 | tee "$OUT/device_log.txt"
