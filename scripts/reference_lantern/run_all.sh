#!/usr/bin/env bash
# The whole measurement, one job at a time (each side in its own process, 1 thread).
# Usage: bash run_all.sh [IMAGES] [REPEATS]     (default 2 images, 5 repeats, 1 warm-up)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export REFHARNESS_WORK=${REFHARNESS_WORK:-$PWD/refharness-work}
mkdir -p "$REFHARNESS_WORK/results" && cd "$REFHARNESS_WORK"
N=${1:-2}; R=${2:-5}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
export LANTERN_RUNTIME_CACHE=$REFHARNESS_WORK/cache
RT=${RUNTIME_PYTHON:-$HERE/../../.venv/bin/python}   # the project's venv (the same torch as the reference's)
REF=${REFERENCE_PYTHON:-$REFHARNESS_WORK/venv/bin/python}   # the reference's venv (torch 2.13.0+cpu, transformers 4.45.2)
[ -f models/target/model.safetensors ] || $REF $HERE/make_models.py
date -u +"%F %T start reference"
$REF $HERE/reference_run.py --images $N --repeats $R --warmup 1 --out results/ref 2>&1 | grep -v -i warning | tee results/ref.log
date -u +"%F %T start runtime eager"
$RT $HERE/runtime_run.py --mode eager --images $N --repeats $R --warmup 1 --phases --out results/rt_eager 2>&1 | tee results/rt_eager.log
date -u +"%F %T start runtime graph"
$RT $HERE/runtime_run.py --mode graph --images $N --repeats $R --warmup 1 --phases --out results/rt_graph 2>&1 | tee results/rt_graph.log
date -u +"%F %T done"
$REF $HERE/compare.py --ref results/ref --graph results/rt_graph --eager results/rt_eager --out results/compare.json | tee results/compare.md
