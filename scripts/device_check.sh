#!/usr/bin/env bash
# The one device check: what a lent accelerator should measure first, in order of value, each step
# under its own time limit and all of them under one budget (BUDGET seconds; a step that would
# start past it is skipped and says so). Results, one log per step and summary.md land in $OUT
# (the device tool's) or ./out. Run from the repository root; carry .whl/ (the serve extra's
# wheels: the device machine reaches no package index).
#
#   bash scripts/device_check.sh                     a lent NVIDIA GPU: about 8 minutes on one H100
#   QUICK=1 DEVICE=cpu bash scripts/device_check.sh  every step at toy sizes on the CPU (CI runs this,
#                                                    so a typo never costs device minutes)
#
#  1. selfcheck: graph == eager, exactness, no host sync, the demo's phases, and the LlamaGen-XL
#     step in bf16, eager and captured, each phase against its roofline floor; then the tests
#     marked cuda / hpu (bf16 decoding, capture == eager on the device);
#     then the LlamaGen-XL target forward over T = 1..58 tokens against the AR step and its floor
#     (python -m runtime.bench.verify_sweep);
#  2. the LlamaGen-XL and -L shape tables in bf16 at batch 1 and 8 (CFG): AR step, chain3, chain6,
#     naive_extend_57 and the EAGLE-2 tree, each phase against its floor, and the projected speedup
#     of naive_extend_57 at the published LlamaGen-XL taus (LANTERN++ 2.67, the lossless static
#     tree 2.42; Cool-SD's table, ../shared/reference/papers.md);
#  3. the demo bench of every method (graph, sampling, 24 images, 5 repeats) with its quality,
#     pjd's lossless form and the released loop (--accept published) included;
#  4. the serve load test on the demo (served vs offline images/s, every image verified);
#  5. if the budget allows, the speed-quality frontier of LANTERN++ on the demo, the load test on
#     a LlamaGen-XL-shaped model and the drain under load (the old serve script's checks);
#  6. the frontier's quality at 600 images per setting (scripts/frontier.py: every setting of
#     scripts/frontier_settings.toml against AR on the same seeds), beside step 5's speedups.
# Exit 0 only when every step that ran exited 0.
set -uo pipefail
# shellcheck source=scripts/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
DEVICE="${DEVICE:-cuda}"
QUICK="${QUICK:-0}"
mkdir -p "$OUT/logs"
: > "$OUT/steps.tsv"
STARTED=$SECONDS

if [ "$QUICK" = 1 ]; then
  BUDGET="${BUDGET:-1200}"; PROFILE="${PROFILE:-cpu}"; GRAPH=--no-graph; XL=--no-xl
  SHAPES="llamagen-b"; BATCHES="1"; ITER=2; IMAGES=2; REPEATS=1; REQUESTS=4; SCALE=4
  METHODS="ar,lantern++,pjd:accept=published:pjd_rows=4"
else
  BUDGET="${BUDGET:-480}"; PROFILE="${PROFILE:-h100}"; GRAPH=--graph; XL=--xl
  SHAPES="llamagen-xl llamagen-l"; BATCHES="1 8"; ITER=10; IMAGES=24; REPEATS=5; REQUESTS=200; SCALE=1
  # the models people run by Hub id (issue 57), at batch 1: their per-phase floors and projected speedups
  HUB_SHAPES="janus-pro-1b janus-pro-7b emu3-8b"
  # pjd as released (lossy) beside the lossless form: its forward counts project a speedup where a
  # 36-node forward costs about what AR's one-node forward does; this measures it
  METHODS="ar,sd,eagle2,ddd,lantern,lantern++,sjd,pjd:pjd_rows=2,pjd:accept=published:pjd_rows=4"
fi
# chains and the EAGLE-2 tree at tau 1: their cost only (the summary gives the tau each needs to break even)
TREES="lantern++:tree=chain3:tau=1,lantern++:tree=chain6:tau=1,lantern++:tree=naive_extend_57:tau=2.67"
TREES="$TREES,lantern++:tree=naive_extend_57:lantern_lambda=1:tau=2.42,eagle2:tau=1"

# step NAME LIMIT COMMAND...: run COMMAND under min(LIMIT, budget left) seconds, log it, record rc.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - STARTED)))
  if [ "$QUICK" = 1 ]; then limit=$((limit * SCALE)); fi
  if [ "$left" -lt 20 ]; then
    printf '%s\tskipped\t0\tbudget spent\n' "$name" >> "$OUT/steps.tsv"; echo "== $name: skipped (budget)"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at most ${limit}s)"
  local began=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  # one row per step: the command's newlines and tabs folded, so every row has four fields
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - began))" "$(printf '%s' "$*" | tr '\n\t' '  ')" \
    >> "$OUT/steps.tsv"
  tail -n 3 "$OUT/logs/$name.log"; echo "rc=$rc"
}

{
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

  step selfcheck 170 runtime selfcheck --device "$DEVICE" $GRAPH $XL --out "$OUT/selfcheck.json"
  # pytest exits 5 when every test is deselected (no device of either kind): nothing failed
  TESTS="tests/test_accelerators.py tests/test_backends.py"
  step device_tests 60 bash -c "python3 -m pytest -q -p no:cacheprovider -m 'cuda or hpu' $TESTS; rc=\$?; [ \$rc = 5 ] && exit 0; exit \$rc"
  # the target forward over T tokens against its AR step and floor, with the operators that take the time
  # (on a CPU: plain and prepacked weights alternating; QUICK: eager at GPT-B size)
  SWEEP_SHAPE="${SHAPES%% *}"
  step "verify_sweep_${SWEEP_SHAPE}" 90 python3 -m runtime.bench.verify_sweep --shape "$SWEEP_SHAPE" --device "$DEVICE" \
    $([ "$QUICK" = 1 ] && echo "--tokens 1,4 --rows 2 --repeats 3 --warmup 1" || echo "--graph --repeats 7") \
    --out "$OUT/verify_sweep_${SWEEP_SHAPE}.json"
  for shape in $SHAPES; do
    for b in $BATCHES; do
      step "shape_${shape}_b$b" 90 runtime bench --shape "$shape" --device "$DEVICE" --profile-name "$PROFILE" $GRAPH \
        --batch-size "$b" --methods "$TREES" --tau 2.67 --iterations "$ITER" --warmup 2 \
        --out "$OUT/shape_${shape}_b$b.json"
    done
  done
  for shape in ${HUB_SHAPES:-}; do
    step "shape_${shape}_b1" 75 runtime bench --shape "$shape" --device "$DEVICE" --profile-name "$PROFILE" $GRAPH \
      --batch-size 1 --methods "$TREES" --tau 2.67 --iterations "$ITER" --warmup 2 --out "$OUT/shape_${shape}_b1.json"
  done
  step bench_demo 120 runtime bench --device "$DEVICE" --profile-name "$PROFILE" $GRAPH --methods "$METHODS" \
    --num-images "$IMAGES" --repeats "$REPEATS" --warmup 1 --out "$OUT/bench_demo_sampling.json"
  step serve_load 90 python3 -m runtime.serve.load --requests "$REQUESTS" --concurrency 16 --max-n 3 --verify 8 \
    --out "$OUT/serve_load_demo.json" -- --device "$DEVICE" --profile-name "$PROFILE" --batch-size 8 --method lantern++
  if [ "$QUICK" != 1 ]; then
    FRONTIER="ar,lantern++:lantern_lambda=1"
    for l in 2 3 5 8; do FRONTIER="$FRONTIER,lantern++:lantern_lambda=$l:relax_rule=paper,lantern++:lantern_lambda=$l:relax_rule=bounded"; done
    step frontier_demo 200 runtime bench --device "$DEVICE" --profile-name "$PROFILE" $GRAPH --tree chain3 \
      --methods "$FRONTIER" --num-images 96 --batch-size 8 --repeats 3 --warmup 1 --out "$OUT/frontier_demo_sampling.json"
    # a LlamaGen-XL-shaped model served (random weights in LlamaGen's layout: the speed is the shape's,
    # the images are noise), then SIGTERM under load (every admitted request must finish)
    step xl_checkpoints 60 python3 -m runtime.bench.projection --shape llamagen-xl --out /tmp/xl
    if [ -f /tmp/xl/c2i_XL_256.pt ]; then
      step serve_load_xlshape 150 python3 -m runtime.serve.load --requests 48 --concurrency 16 --max-n 3 --verify 8 \
        --out "$OUT/serve_load_xlshape.json" -- --device "$DEVICE" --profile-name "$PROFILE" --gpt-model GPT-XL \
        --gpt-ckpt /tmp/xl/c2i_XL_256.pt --vq-ckpt /tmp/xl/vq_ds16_c2i.pt --drafter /tmp/xl/drafter --image-size 256 \
        --batch-size 8 --method lantern++ --tree chain3
    fi
    step serve_drain 90 python3 -m runtime.serve.load --requests 120 --sigterm-after 40 --concurrency 16 --max-n 3 \
      --verify 8 --out "$OUT/serve_drain_demo.json" -- --device "$DEVICE" --profile-name "$PROFILE" --batch-size 8 \
      --method lantern++
  fi
  # the speed-quality frontier at a sample size that separates settings (scripts/frontier_settings.toml): 50
  # images per class per setting from AR's seeds, scored against AR and the AR-vs-AR band, beside the bench's
  # speedups above (the samples stay in /tmp: too large to bring back)
  if [ "$QUICK" = 1 ]; then FPC=1; FONLY="ar,ar_b,lpp_exact"; FRES=20; FBATCH=16; else FPC=50; FONLY=""; FRES=200; FBATCH=64; fi
  FROOT="$(mktemp -d)"
  step frontier_samples 300 python3 scripts/frontier.py sample --root "$FROOT" --device "$DEVICE" --per-class "$FPC" \
    --seed-sets 0 --chunk 120 --batch-size 64 --draft-batch-size "$FBATCH" --only "$FONLY" $([ "$GRAPH" = --graph ] && echo --graph)
  step frontier_score 120 python3 scripts/frontier.py score --root "$FROOT" --resamples "$FRES" \
    --bench $(ls "$OUT"/frontier_demo_sampling.json 2>/dev/null) --out "$OUT/frontier_quality.json" \
    --figure "$OUT/frontier_quality.png"
  python3 "$(dirname "${BASH_SOURCE[0]}")/device_summary.py" "$OUT"
} 2>&1 | tee "$OUT/device_log.txt"
# the exit code: 0 only when every step that ran exited 0 (skipped steps are named in summary.md)
! awk -F'\t' '$2 != "0" && $2 != "skipped" {bad = 1} END {exit !bad}' "$OUT/steps.tsv"
