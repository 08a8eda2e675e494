#!/usr/bin/env bash
# GPU proof of issue #16 (steps 09_hopper_wgmma and 10_hopper_pingpong) on an H100/H200.
# Assumes a built tree in $FA_BUILD_DIR (default build-gpu, every step, sm_90). Writes
# $OUT/hopper.log and the compare.py JSON files $OUT/hopper_compare_<run>.json, and prints a
# summary table at the end. Every phase runs under `timeout` (the kernels also have a 10 s
# mbarrier watchdog that fails the launch instead of hanging).
#
# Default run (expected: 1-2 minutes of device time; at most about 2.5 by the timeouts):
#   1. fa_hopper_blocks: TMA load, wgmma SS, wgmma RS (V N-major), epilogue TMA store, for
#      every tile shape, each alone with exact arithmetic (~5 s).
#   2. the GPU conformance suite of 09 and of 10 (matrix, edge cases, decode shapes, 60 random
#      problems each), both at once, and beside them
#   3. compute-sanitizer memcheck, racecheck, synccheck, initcheck on both steps (8 runs at
#      once, common/scripts/sanitize.sh) over a short slice of the suite under
#      FA_HOPPER_GRID=2, so that every thread block works through several tiles
#      (2 and 3 together: <= 95 s; neither is timed).
#   4. compare.py, fp16, 16K tokens, hidden 2048, seqlen 1024..16384, d 64/128, causal
#      off/on, forward: PyTorch FLASH, cuDNN, 09, 10, each checked against compare.py's fp32
#      reference; one table with the ratios against issue 16's bars (~20 s).
# HOPPER_VARIANTS=1 adds (about 1.5 minutes more) the runner of each step with the ceilings
# (wgmma m64n256k16 among them), the conformance suite under each tuning knob
# (FA_HOPPER_GRID=3: the persistent loop on small problems; FA_HOPPER_BLOCK_M=128: two
# consumers at d = 64; FA_HOPPER_GRID=tiles: no persistent grid) and compare.py of 09 and 10
# under FA_HOPPER_BLOCK_M=128 (d = 64) and FA_HOPPER_GRID=tiles: each change of step 09
# measured with and without, in the same table.
# HOPPER_SKIP="sanitize compare" skips those phases.
. "$(dirname "$0")/setup.sh" hopper
skip=${HOPPER_SKIP:-}
variants=${HOPPER_VARIANTS:-0}
tmp=$(mktemp -d /tmp/hopper.XXXXXX)
declare -a summary=()
note() { say "$@"; }  # setup.sh's say, under the name this script uses
result() { summary+=("$(printf '%-34s %s' "$1" "$2")"); note "== $1: $2"; }
skipped() { [[ " $skip " == *" $1 "* ]]; }
t0=$SECONDS

note "hopper.sh on $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null), build $build, commit $(git rev-parse --short HEAD 2>/dev/null), variants=$variants"

# 1. Building blocks
timeout 60 "$build/bin/fa_hopper_blocks" > "$tmp/blocks.txt" 2>&1
rc=$?
cat "$tmp/blocks.txt" >> "$log"
result "1 building blocks" "rc=$rc, $(grep -c '^PASS ' "$tmp/blocks.txt") pass, $(grep -c '^FAIL ' "$tmp/blocks.txt") fail$([ $rc -eq 124 ] && echo ' (TIMEOUT)')"

# Variants only: one checked runner call per step, and the ceilings.
if [ "$variants" = 1 ]; then
  for run in "09_hopper_wgmma 128 --causal" "10_hopper_pingpong 64 --no-ceilings"; do
    read -r step dim flag <<< "$run"
    timeout 60 "$build/bin/$step" --batch 2 --heads 16 --seqlen 4096 --head-dim "$dim" "$flag" \
      > "$tmp/run.txt" 2>&1
    rc=$?
    cat "$tmp/run.txt" >> "$log"
    grep -h '^Ceilings' "$tmp/run.txt" >> "$tmp/ceilings.txt"
    line=$(grep -E "^$step " "$tmp/run.txt" | head -1 | tr -s ' ' | cut -d' ' -f10-)
    result "runner $step d=$dim" "rc=$rc: ${line:-$(tail -1 "$tmp/run.txt" | cut -c1-150)}"
  done
  result "ceilings" "$(head -1 "$tmp/ceilings.txt" 2>/dev/null | cut -c1-150)"
fi

# 2. Conformance (the fp64 oracle is CPU work: the runs go side by side)
conf() {  # name timeout filter [VAR=value ...]
  local name=$1 limit=$2 filter=$3
  shift 3
  env "$@" timeout "$limit" "$build/bin/fa_gpu_tests" --gtest_filter="$filter" \
    > "$tmp/conf_$name.txt" 2>&1 &
}
conf_report() {  # name
  local f=$tmp/conf_$1.txt passed failed skipped why=""
  { echo "--- conformance $1"; grep -E "^\[  (PASSED|FAILED) |test suites ran|problems" "$f"; \
    grep -B1 -A4 "Failure" "$f" | head -40; } >> "$log"
  passed=$(grep -E "^\[  PASSED  \]" "$f" | grep -oE "[0-9]+ test" | head -1)
  failed=$(grep -cE "^\[  FAILED  \] .*\(" "$f")
  skipped=$(grep -cE "^\[  SKIPPED \] .*\(" "$f")
  if ! grep -q "test suites ran" "$f"; then  # cut short: say how, and what it printed last
    why=", DID NOT FINISH: $(grep -v '^[[:space:]]*$' "$f" | tail -1 | cut -c1-120)"
    tail -5 "$f" >> "$log"
  fi
  result "2 conformance $1" "${passed:-0 test}s passed, $failed failed, $skipped skipped$why"
}
full() { echo "*/$1*:*.$1*"; }
short() { echo "Steps/ForwardConformance.*/$1*:Steps/EdgeCases.*/$1:Steps/SafetyEdgeCases.*/$1:Random/RandomConformance.*/$1_fwd"; }
names=()
# sanitize.sh (3) builds fa_gpu_tests first: do it now, so that it cannot relink the binary
# under the running suites (a no-op on a built tree).
cmake --build "$build" --target fa_gpu_tests > "$tmp/build.txt" 2>&1 || tail -5 "$tmp/build.txt" >> "$log"
for step in 09_hopper_wgmma 10_hopper_pingpong; do
  s=${step:0:2}
  conf "$s" 90 "$(full $step)" FA_RANDOM_PROBLEMS=60 FA_RANDOM_SECONDS=45
  names+=("$s")
  if [ "$variants" = 1 ]; then
    conf "${s}_grid3" 120 "$(full $step)" FA_HOPPER_GRID=3 FA_RANDOM_PROBLEMS=24 FA_RANDOM_SECONDS=35
    conf "${s}_bm128" 90 "$(short $step)" FA_HOPPER_BLOCK_M=128 FA_RANDOM_PROBLEMS=12 FA_RANDOM_SECONDS=20
    conf "${s}_tiles" 90 "$(short $step)" FA_HOPPER_GRID=tiles FA_RANDOM_PROBLEMS=12 FA_RANDOM_SECONDS=20
    names+=("${s}_grid3" "${s}_bm128" "${s}_tiles")
  fi
done

# 3. Sanitizers at the same time. Per step: the forward matrix in fp16 for the odd_mqa shape
# (257 x 257, MQA; d 64/128, causal off/on) and bf16 d = 128 causal Nq > Nk, the named edge
# cases, and 9 random problems up to 384 rows (the fewest that cover the 9 classes the forward
# random test promises; no FA_RANDOM_SECONDS: the suite takes only values > 0).
if ! skipped sanitize; then
  FA_HOPPER_GRID=2 \
  FA_SANITIZE_FILTER='Steps/ForwardConformance.*/@STEP@_fp16_*_odd_mqa:Steps/ForwardConformance.*/@STEP@_bf16_d128_causal_q_gt_k:Steps/EdgeCases.*/@STEP@:Random/RandomConformance.*/@STEP@_fwd' \
  FA_BUILD_DIR=$build FA_SANITIZE_STEPS="09_hopper_wgmma,10_hopper_pingpong" \
    FA_SANITIZE_BUDGET=${FA_SANITIZE_BUDGET:-90} FA_SANITIZE_TIMEOUT=80 FA_SANITIZE_JOBS=8 \
    FA_RANDOM_PROBLEMS=9 \
    timeout 110 bash common/scripts/sanitize.sh "$tmp/sanitize" > "$tmp/sanitize.txt" 2>&1 &
fi
wait
for n in "${names[@]}"; do conf_report "$n"; done
if ! skipped sanitize; then
  sed "s|$tmp/sanitize/||g" "$tmp/sanitize/summary.txt" >> "$log" 2>/dev/null || cat "$tmp/sanitize.txt" >> "$log"
  for f in "$tmp"/sanitize/*.sanitizer.log; do  # the first reports of a run that found any
    [ -f "$f" ] || continue
    if grep -qE "^========= [A-Z]" "$f" && ! grep -qE "SUMMARY: 0 (errors|hazards)" "$f"; then
      note "--- $(basename "$f"): $(grep -E 'SUMMARY' "$f" | tail -2 | tr '\n' ' ')"
      grep -E "^=========" "$f" | grep -v "SUMMARY" | head -30 >> "$log"
    fi
  done
  runs=$(grep -cE '^(memcheck|racecheck|synccheck|initcheck) ' "$tmp/sanitize/summary.txt" 2>/dev/null)
  clean=$(grep -cE '^(memcheck|racecheck|synccheck|initcheck) +[0-9a-z_]+ +clean ' "$tmp/sanitize/summary.txt" 2>/dev/null)
  others=$(grep -E '^(memcheck|racecheck|synccheck|initcheck) ' "$tmp/sanitize/summary.txt" 2>/dev/null |
           grep -vE ' clean ' | awk '{printf "%s%s %s %s", (NR > 1 ? "; " : ""), $1, substr($2, 1, 2), $3}')
  said=""
  [ "${runs:-0}" = 0 ] && said=": $(tail -1 "$tmp/sanitize/summary.txt" 2>/dev/null || tail -1 "$tmp/sanitize.txt")"
  result "3 sanitizers" "${clean:-0} of ${runs:-0} (tool, step) runs clean${others:+; not clean: $others}$said"
fi

# 4. Speed beside PyTorch FLASH and cuDNN (same tensors, one process), then the variants
cmp() {  # name backends head_dims causal [VAR=value ...]
  local name=$1 backends=$2 dims=$3 causal=$4
  shift 4
  env "$@" FA_LIB="$build/lib/libfa.so" timeout 60 python3 common/python/compare.py \
    --steps 09_hopper_wgmma,10_hopper_pingpong --backends "$backends" \
    --seqlens 1024,2048,4096,8192,16384 --head-dims "$dims" --causal "$causal" --directions fwd \
    --warmup 3 --repeats 10 --out "$tmp/cmp_$name.json" --log-dir "" > "$tmp/cmp_$name.txt" 2>&1
  local rc=$?
  cp "$tmp/cmp_$name.json" "$out/hopper_compare_$name.json" 2>/dev/null
  tail -2 "$tmp/cmp_$name.txt" >> "$log"
  result "4 compare.py $name" "rc=$rc, $(python3 common/scripts/gpu/hopper_table.py --rows "$tmp/cmp_$name.json")"
}
if ! skipped compare; then
  cmp default flash,cudnn 64,128 0,1
  if [ "$variants" = 1 ]; then
    cmp bm128 "" 64 0,1 FA_HOPPER_BLOCK_M=128
    cmp tiles "" 64,128 0,1 FA_HOPPER_GRID=tiles
  fi
  python3 common/scripts/gpu/hopper_table.py "$tmp" > "$tmp/table.txt" 2>&1
  cat "$tmp/table.txt" >> "$log"
  result "4 bars" "$(grep '^bars' "$tmp/table.txt" | head -1 | cut -c1-220)"
fi

note ""
note "hopper.sh summary ($((SECONDS - t0)) s)"
for line in "${summary[@]}"; do note "  $line"; done
[ -f "$tmp/table.txt" ] && cat "$tmp/table.txt"
rm -rf "$tmp"
