#!/usr/bin/env bash
# GPU proof of issue #16 (steps 09_hopper_wgmma and 10_hopper_pingpong) on an H100/H200, and
# the measurements that decide their tile shapes. Assumes a built tree in $FA_BUILD_DIR
# (default build-gpu, every step, sm_90). Writes $OUT/hopper.log (and the compare.py JSON
# files hopper_compare*.json) and prints a summary table at the end.
#
# Phases, cheapest and most diagnostic first, each under `timeout` (a hang cannot eat the
# budget; the kernels also have a 10 s mbarrier watchdog that fails the launch):
#   1. fa_hopper_blocks: TMA load (also of a box that starts before row 0), wgmma SS, wgmma RS
#      (V N-major), epilogue TMA store, for every tile shape, each alone with exact arithmetic.
#      If only the boxes before row 0 fail, the rest of the run uses FA_HOPPER_ALIGN=start
#      (Q blocks from row 0, as step 06) and says so.
#   2. one runner call per step (checked against the oracle: 09 at d = 128 causal, 10 at
#      d = 64) and the ceilings.
#   3. the GPU conformance suite, all at once (the fp64 oracle is CPU work):
#      09 and 10 as built (matrix, edge cases, 60 random problems), and the variants:
#      FA_HOPPER_GRID=3 (at most 3 thread blocks: every thread block works through many
#      tiles, the persistent loop on small problems), FA_HOPPER_BLOCK_M=128 (d = 64 with two
#      consumers), FA_HOPPER_BLOCK_M=128 FA_HOPPER_BLOCK_N=192, FA_HOPPER_GRID=tiles
#      (one thread block per tile).
#   4. compare.py, fp16, 16K tokens, hidden 2048, seqlen 1024..16384, d 64/128, causal off/on,
#      forward: FLASH, cuDNN, 09, 10 as built; then 09 and 10 again under each variant (the
#      d = 64 shapes at d = 64 only, FA_HOPPER_ALIGN=start at d = 64 causal only), each
#      checked against compare.py's fp32 reference; one table with every ratio.
#   3b. at the same time as 3 (neither is timed): compute-sanitizer memcheck, racecheck,
#      synccheck, initcheck over a short slice of the suite under FA_HOPPER_GRID=2
#      (common/scripts/sanitize.sh), within a time budget of 100 s.
# Expected device time: about 3.5 minutes (1: 5 s, 2: 15 s, 3 and 3b: <= 130 s, 4: ~70 s).
# HOPPER_SKIP="variants compare tune sanitize" skips phases or parts (variants: the variant
# conformance runs; tune: the variant compare.py runs).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
build=${FA_BUILD_DIR:-build-gpu}
case $build in /*) ;; *) build=$PWD/$build ;; esac
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
log=$out/hopper.log
: > "$log"
skip=${HOPPER_SKIP:-}
tmp=$(mktemp -d /tmp/hopper.XXXXXX)
declare -a summary=()
note() { echo "$*" | tee -a "$log"; }
result() { summary+=("$(printf '%-40s %s' "$1" "$2")"); note "== $1: $2"; }
skipped() { [[ " $skip " == *" $1 "* ]]; }
t0=$SECONDS

note "hopper.sh on $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null), build $build, commit $(git rev-parse --short HEAD 2>/dev/null)"

# 1. Building blocks
timeout 60 "$build/bin/fa_hopper_blocks" > "$tmp/blocks.txt" 2>&1
rc=$?
cat "$tmp/blocks.txt" >> "$log"
result "1 building blocks" "rc=$rc, $(grep -c '^PASS ' "$tmp/blocks.txt") pass, $(grep -c '^FAIL ' "$tmp/blocks.txt") fail$([ $rc -eq 124 ] && echo ' (TIMEOUT)')"
# The boxes that start before row 0 come last, after a marker line: if only they fail (or the
# program dies among them), the rest of the run puts the partial Q block last instead.
marker='^Boxes that start before row 0:'
fails_before=$(sed "/$marker/,\$d" "$tmp/blocks.txt" | grep -c '^FAIL')
fails_after=$(sed -n "/$marker/,\$p" "$tmp/blocks.txt" | grep -c '^FAIL')
if grep -q "$marker" "$tmp/blocks.txt" && [ "$fails_before" = 0 ] &&
   { [ "$fails_after" -gt 0 ] || [ $rc -ne 0 ]; }; then
  export FA_HOPPER_ALIGN=start
  result "1 boxes before row 0" "FAILED: the rest of this run uses FA_HOPPER_ALIGN=start"
fi

# 2. One checked run per step, and the ceilings
for run in "09_hopper_wgmma 128 --causal" "10_hopper_pingpong 64 --no-ceilings"; do
  read -r step dim flag <<< "$run"
  timeout 60 "$build/bin/$step" --batch 2 --heads 16 --seqlen 4096 --head-dim "$dim" "$flag" \
    > "$tmp/run.txt" 2>&1
  rc=$?
  cat "$tmp/run.txt" >> "$log"
  grep -h '^Ceilings' "$tmp/run.txt" >> "$tmp/ceilings.txt"
  result "2 runner $step d=$dim" "rc=$rc: $(grep -E "^$step " "$tmp/run.txt" | head -1 | tr -s ' ' | cut -d' ' -f10-)"
done
result "2 ceilings" "$(head -1 "$tmp/ceilings.txt" 2>/dev/null)"

# 3. Conformance: the steps as built, and every variant, side by side
conf() {  # name timeout filter [VAR=value ...]
  local name=$1 limit=$2 filter=$3
  shift 3
  env "$@" timeout "$limit" "$build/bin/fa_gpu_tests" --gtest_filter="$filter" \
    > "$tmp/conf_$name.txt" 2>&1 &
}
conf_report() {  # name
  local f=$tmp/conf_$1.txt passed failed skipped done_line
  { echo "--- conformance $1"; grep -E "^\[  (PASSED|FAILED) |test suites ran|problems" "$f"; \
    grep -B1 -A4 "Failure" "$f" | head -40; } >> "$log"
  passed=$(grep -E "^\[  PASSED  \]" "$f" | grep -oE "[0-9]+ test" | head -1)
  failed=$(grep -cE "^\[  FAILED  \] .*\(" "$f")
  skipped=$(grep -cE "^\[  SKIPPED \] .*\(" "$f")
  done_line=$(grep -c "test suites ran" "$f")
  result "3 conformance $1" "${passed:-0 test}s passed, $failed failed, $skipped skipped$([ "$done_line" = 0 ] && echo ', DID NOT FINISH (timeout or crash)')"
}
full() { echo "*/$1*:*.$1*"; }
short() { echo "Steps/ForwardConformance.*/$1*:Steps/EdgeCases.*/$1:Steps/SafetyEdgeCases.*/$1:Random/RandomConformance.*/$1_fwd"; }
names=()
# sanitize.sh (3b) builds fa_gpu_tests first: do it now, so that it cannot relink the binary
# under the running suites (a no-op on a built tree).
cmake --build "$build" --target fa_gpu_tests > "$tmp/build.txt" 2>&1 || tail -5 "$tmp/build.txt" >> "$log"
for step in 09_hopper_wgmma 10_hopper_pingpong; do
  s=${step:0:2}
  conf "$s" 150 "$(full $step)" FA_RANDOM_PROBLEMS=60 FA_RANDOM_SECONDS=45
  names+=("$s")
  if ! skipped variants; then
    conf "${s}_grid3" 150 "$(full $step)" FA_HOPPER_GRID=3 FA_RANDOM_PROBLEMS=24 FA_RANDOM_SECONDS=35
    conf "${s}_bm128" 100 "$(short $step)" FA_HOPPER_BLOCK_M=128 FA_RANDOM_PROBLEMS=12 FA_RANDOM_SECONDS=20
    conf "${s}_bm128_bn192" 100 "$(short $step)" FA_HOPPER_BLOCK_M=128 FA_HOPPER_BLOCK_N=192 FA_RANDOM_PROBLEMS=12 FA_RANDOM_SECONDS=20
    conf "${s}_tiles" 100 "$(short $step)" FA_HOPPER_GRID=tiles FA_RANDOM_PROBLEMS=12 FA_RANDOM_SECONDS=20
    names+=("${s}_grid3" "${s}_bm128" "${s}_bm128_bn192" "${s}_tiles")
  fi
done
# 3b. Sanitizers at the same time (a short slice, with at most 2 thread blocks so that the
# persistent loop runs; racecheck may not model wgmma/TMA accesses: see the log)
if ! skipped sanitize; then
  # Per step: 5 forward matrix cases (257 x 257 MQA in fp16, d 64/128, causal off/on; bf16
  # d = 128 causal Nq > Nk), the named edge cases, 9 random problems up to 384 rows (the
  # fewest that cover the 9 classes the forward random test promises).
  FA_HOPPER_GRID=2 \
  FA_SANITIZE_FILTER='Steps/ForwardConformance.*/@STEP@_fp16_*_odd_mqa:Steps/ForwardConformance.*/@STEP@_bf16_d128_causal_q_gt_k:Steps/EdgeCases.*/@STEP@:Random/RandomConformance.*/@STEP@_fwd' \
  FA_BUILD_DIR=$build FA_SANITIZE_STEPS="09_hopper_wgmma,10_hopper_pingpong" \
    FA_SANITIZE_BUDGET=${FA_SANITIZE_BUDGET:-100} FA_SANITIZE_TIMEOUT=95 \
    FA_RANDOM_PROBLEMS=9 FA_RANDOM_SECONDS=0 \
    timeout 130 bash common/scripts/sanitize.sh "$tmp/sanitize" > "$tmp/sanitize.txt" 2>&1 &
fi
wait
for n in "${names[@]}"; do conf_report "$n"; done
if ! skipped sanitize; then
  cat "$tmp/sanitize/summary.txt" >> "$log" 2>/dev/null
  for f in "$tmp"/sanitize/*.sanitizer.log; do  # the first reports of a tool that found any
    [ -f "$f" ] || continue
    if grep -qE "^========= [A-Z]" "$f" && ! grep -qE "ERROR SUMMARY: 0 errors" "$f"; then
      note "--- $(basename "$f"): $(grep -E 'SUMMARY' "$f" | tail -2 | tr '\n' ' ')"
      grep -E "^=========" "$f" | grep -v "SUMMARY" | head -30 >> "$log"
    fi
  done
  result "3b sanitizers" "$(grep -E 'memcheck|racecheck|synccheck|initcheck' "$tmp/sanitize/summary.txt" 2>/dev/null | tr '\n' ';' | cut -c1-300)"
fi

# 4. Speed beside PyTorch FLASH and cuDNN (same tensors, one process), then the variants
cmp() {  # name backends head_dims causal [VAR=value ...]
  local name=$1 backends=$2 dims=$3 causal=$4
  shift 4
  env "$@" FA_LIB="$build/lib/libfa.so" timeout 200 python3 common/python/compare.py \
    --steps 09_hopper_wgmma,10_hopper_pingpong --backends "$backends" \
    --seqlens 1024,2048,4096,8192,16384 --head-dims "$dims" --causal "$causal" --directions fwd \
    --warmup 3 --repeats 10 --out "$tmp/cmp_$name.json" --log-dir "" > "$tmp/cmp_$name.txt" 2>&1
  local rc=$?
  cp "$tmp/cmp_$name.json" "$out/hopper_compare_$name.json" 2>/dev/null
  tail -2 "$tmp/cmp_$name.txt" >> "$log"
  result "4 compare.py $name" "rc=$rc, $(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["results"]))' "$tmp/cmp_$name.json" 2>/dev/null || echo 0) rows, $(grep -cE ' FAIL$| error' "$tmp/cmp_$name.txt") failed or errored"
}
if ! skipped compare; then
  cmp default flash,cudnn 64,128 0,1
  if ! skipped tune; then
    cmp bm128 "" 64 0,1 FA_HOPPER_BLOCK_M=128
    cmp bm128_bn192 "" 64 0,1 FA_HOPPER_BLOCK_M=128 FA_HOPPER_BLOCK_N=192
    cmp tiles "" 64,128 0,1 FA_HOPPER_GRID=tiles
    cmp align_start "" 64 1 FA_HOPPER_ALIGN=start
  fi
  python3 common/scripts/gpu/hopper_table.py "$tmp" > "$tmp/table.txt" 2>&1
  cat "$tmp/table.txt" >> "$log"
  result "4 bars" "$(grep '^bars' "$tmp/table.txt" | head -1 | cut -c1-200)"
fi

note ""
note "hopper.sh summary ($((SECONDS - t0)) s)"
for line in "${summary[@]}"; do note "  $line"; done
[ -f "$tmp/table.txt" ] && cat "$tmp/table.txt"
rm -rf "$tmp"
