#!/usr/bin/env bash
# One lent-GPU session's checks: install into the container's own torch, selfcheck on cuda,
# the cuda-marked tests, a same-run bench of every method on the demo, and LlamaGen-XL-shaped
# step costs projected with the taus it measured. Results land in $OUT (the device tool) or ./out.
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
log="$OUT/device_log.txt"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  runtime devices
  echo "== selfcheck"; time runtime selfcheck --device cuda --out "$OUT/selfcheck_cuda.json"; echo "rc=$?"
  echo "== cuda tests"; python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_backends.py tests/test_accelerators.py; echo "rc=$?"
  echo "== bench"; time runtime bench --device cuda --profile-name h100 --num-images 16 --warmup 2 --repeats 5 --out "$OUT/cuda_demo_graph_all_sampling.json"; echo "rc=$?"
  echo "== xl projection"; time runtime bench --device cuda --profile-name h100 --shape llamagen-xl \
     --tau-from "$OUT/cuda_demo_graph_all_sampling.json" --out "$OUT/cuda_xl_projection_sampling.json"; echo "rc=$?"
} 2>&1 | tee "$log"
