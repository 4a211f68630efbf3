#!/usr/bin/env bash
# The runtime at two commits against the reference, in one window, one job at a time (1 thread):
# per models folder, the reference once, then each commit's runtime in graph and eager mode, then
# compare.py per commit (compare_{after,before}_<models>.{json,md}).
# Usage: bash before_after.sh BEFORE [AFTER]     (AFTER default HEAD)
#   MODELS="models_small models" (folders under $REFHARNESS_WORK; default "models"), IMAGES (2), REPEATS (5)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BEFORE=${1:?usage: before_after.sh BEFORE [AFTER]}; AFTER=${2:-HEAD}
export REFHARNESS_WORK=${REFHARNESS_WORK:-$PWD/refharness-work}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
export LANTERN_RUNTIME_CACHE=$REFHARNESS_WORK/cache
RT=${RUNTIME_PYTHON:-$REPO/.venv/bin/python}
REF=${REFERENCE_PYTHON:-$REFHARNESS_WORK/venv/bin/python}
N=${IMAGES:-2}; R=${REPEATS:-5}
OUT=$REFHARNESS_WORK/results/before_after
TREES=$REFHARNESS_WORK/trees
mkdir -p "$OUT" "$TREES" && cd "$REFHARNESS_WORK"
for side in before after; do  # each commit's own checkout (its runtime and its harness scripts)
  commit=$BEFORE; [ $side = after ] && commit=$AFTER
  git -C "$REPO" worktree remove --force "$TREES/$side" 2>/dev/null || true
  git -C "$REPO" worktree add --detach "$TREES/$side" "$commit" >/dev/null
done
trap 'git -C "$REPO" worktree remove --force "$TREES/before"; git -C "$REPO" worktree remove --force "$TREES/after"' EXIT
for M in ${MODELS:-models}; do
  [ -f "$M/target/model.safetensors" ] || { echo "no models in $REFHARNESS_WORK/$M (make_models.py --out $M)"; exit 2; }
  date -u +"%F %T start reference $M" | tee -a "$OUT/timeline.log"
  $REF "$HERE/reference_run.py" --models "$M" --images $N --repeats $R --warmup 1 --out "$OUT/ref_$M" \
    2>&1 | grep -v -i warning > "$OUT/ref_$M.log"
  for side in after before; do
    for mode in graph eager; do
      date -u +"%F %T start $side $mode $M" | tee -a "$OUT/timeline.log"
      PYTHONPATH="$TREES/$side" $RT "$TREES/$side/scripts/reference_lantern/runtime_run.py" --models "$M" \
        --mode $mode --images $N --repeats $R --warmup 1 --phases --out "$OUT/${side}_${mode}_$M" \
        > "$OUT/${side}_${mode}_$M.log" 2>&1
    done
    $REF "$HERE/compare.py" --ref "$OUT/ref_$M" --graph "$OUT/${side}_graph_$M" --eager "$OUT/${side}_eager_$M" \
      --out "$OUT/compare_${side}_$M.json" > "$OUT/compare_${side}_$M.md"
  done
done
$REF "$HERE/phases.py" "$OUT"
date -u +"%F %T done" | tee -a "$OUT/timeline.log"
