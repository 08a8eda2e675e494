#!/usr/bin/env bash
# GPU proof of issue #16 (steps 09_hopper_wgmma and 10_hopper_pingpong) on an H100/H200.
# Assumes a built tree in $FA_BUILD_DIR (default build-gpu, every step, sm_90). Writes
# $OUT/hopper.log (and $OUT/hopper_compare.json) and prints a summary table at the end.
#
# Phases, cheapest and most diagnostic first, each under `timeout` (a hang cannot eat the
# budget; the kernels also have a 10 s mbarrier watchdog that fails the launch):
#   1. fa_hopper_blocks: TMA load, wgmma SS, wgmma RS (V N-major), epilogue TMA store, each
#      alone with exact arithmetic: if the full kernel fails, this says which block is wrong.
#   2. one runner call per step (d = 128, causal, checked against the oracle) and the ceilings
#      (mma.sync, cuBLAS, wgmma).
#   3. the GPU conformance suite for 09 and 10 (matrix, edge cases, random problems), the two
#      steps side by side.
#   4. compare.py: 06, 09, 10 beside PyTorch FLASH and cuDNN, fp16, 16K tokens, hidden 2048,
#      seqlen 1024..16384, d 64/128, causal off/on, forward; one table of ratios.
#   4b. the same sweep for 09 and 10 with 192-key blocks (FA_HOPPER_BLOCK_N=192, a tuning
#      run), after a short conformance check of that variant.
#   5. compute-sanitizer memcheck, racecheck, synccheck, initcheck over a short slice of the
#      suite (common/scripts/sanitize.sh), within a time budget.
# Expected device time: about 5-6 minutes (1: 10 s, 2: 30 s, 3: <= 150 s, 4: ~60 s,
# 4b: ~60 s, 5: <= 110 s). HOPPER_SKIP="tune sanitize compare" skips phases.
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
cat > "$tmp/ratios.py" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
rows = [r for r in doc["results"] if r["direction"] == "fwd"]
t = {}
for r in rows:
    t[(r["impl"], r["head_dim"], r["causal"], r["seqlen_q"])] = r
print("TFLOP/s (fp16 fwd); ratios to FLASH; check = oracle/FLASH agreement of the step rows")
print("%4s %-6s %6s %7s %7s %7s %7s %7s | %6s %6s %6s %7s  %s" % (
    "d", "mask", "N", "FLASH", "cuDNN", "06", "09", "10", "09/FL", "10/FL", "10/09",
    "10/cuDNN", "check"))
worst = {}
for d in (64, 128):
    for c in (False, True):
        for n in (1024, 2048, 4096, 8192, 16384):
            get = lambda i: t.get((i, d, c, n))
            def tf(i):
                r = get(i)
                return r["tflops"] if r and not r.get("error") else float("nan")
            f, cu, s6, s9, s10 = (tf(i) for i in ("sdpa_flash", "sdpa_cudnn", "06_causal_skip",
                                                  "09_hopper_wgmma", "10_hopper_pingpong"))
            chk = []
            for i in ("06_causal_skip", "09_hopper_wgmma", "10_hopper_pingpong"):
                r = get(i)
                if r is None: continue
                elif r.get("error"): chk.append(i[:2] + ":ERR " + r["error"][:60])
                elif r.get("checked") and not r.get("passed"): chk.append(i[:2] + ":FAIL")
            print("%4d %-6s %6d %7.1f %7.1f %7.1f %7.1f %7.1f | %6.2f %6.2f %6.2f %7.2f  %s" % (
                d, "causal" if c else "none", n, f, cu, s6, s9, s10, s9 / f, s10 / f, s10 / s9,
                s10 / cu, " ".join(chk) or "ok"))
            for k, v in (("09/FLASH", s9 / f), ("10/FLASH", s10 / f)):
                key = (k, d)
                worst[key] = min(worst.get(key, 9e9), v)
print("worst ratio over seqlen and causal: " + ", ".join(
    "%s d=%d %.2f" % (k, d, v) for (k, d), v in sorted(worst.items())))
print("bar: 09/FLASH >= 1.30 (d=128), >= 1.15 (d=64); 10/FLASH >= 1.60 (d=128), >= 1.30 (d=64)")
EOF
note() { echo "$*" | tee -a "$log"; }
result() { summary+=("$(printf '%-34s %s' "$1" "$2")"); note "== $1: $2"; }
t0=$SECONDS

note "hopper.sh on $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null), build $build, commit $(git rev-parse --short HEAD 2>/dev/null)"

# 1. Building blocks
timeout 60 "$build/bin/fa_hopper_blocks" > "$tmp/blocks.txt" 2>&1
rc=$?
cat "$tmp/blocks.txt" >> "$log"
result "1 building blocks" "rc=$rc, $(grep -c '^PASS' "$tmp/blocks.txt") pass, $(grep -c '^FAIL' "$tmp/blocks.txt") fail$([ $rc -eq 124 ] && echo ' (TIMEOUT)')"

# 2. One checked run per step, and the ceilings
for step in 09_hopper_wgmma 10_hopper_pingpong; do
  flags=""; [ $step = 10_hopper_pingpong ] && flags=--no-ceilings  # the ceilings once
  timeout 60 "$build/bin/$step" --batch 2 --heads 16 --seqlen 4096 --head-dim 128 --causal \
    $flags > "$tmp/run_$step.txt" 2>&1
  rc=$?
  cat "$tmp/run_$step.txt" >> "$log"
  result "2 runner $step" "rc=$rc: $(grep -E "^$step " "$tmp/run_$step.txt" | head -1 | tr -s ' ' | cut -d' ' -f10-)"
done
result "2 ceilings" "$(grep -h '^Ceilings' "$tmp"/run_*.txt | head -1)"

# 3. Conformance (both steps side by side: the fp64 oracle is CPU work)
export FA_RANDOM_PROBLEMS=${FA_RANDOM_PROBLEMS:-60} FA_RANDOM_SECONDS=${FA_RANDOM_SECONDS:-50}
for step in 09_hopper_wgmma 10_hopper_pingpong; do
  timeout 170 "$build/bin/fa_gpu_tests" --gtest_filter="*/${step}*:*.${step}*" \
    > "$tmp/conf_$step.txt" 2>&1 &
done
wait
for step in 09_hopper_wgmma 10_hopper_pingpong; do
  f=$tmp/conf_$step.txt
  { grep -E "^\[  (PASSED|FAILED) |test suites ran|Skipping|GPU:|problems" "$f"; \
    grep -B1 -A4 "Failure" "$f" | head -60; tail -3 "$f"; } >> "$log"
  passed=$(grep -E "^\[  PASSED  \]" "$f" | grep -oE "[0-9]+ test" | head -1)
  failed=$(grep -cE "^\[  FAILED  \] .*\(" "$f")
  skipped=$(grep -cE "^\[  SKIPPED \] .*\(" "$f")
  done_line=$(grep -c "test suites ran" "$f")
  result "3 conformance $step" "${passed:-0 test}s passed, $failed failed, $skipped skipped$([ "$done_line" = 0 ] && echo ', DID NOT FINISH (timeout or crash)')"
done

# 4. Speed beside PyTorch FLASH and cuDNN (same tensors, one process)
if [[ " $skip " != *" compare "* ]]; then
  FA_LIB=$build/lib/libfa.so timeout 300 python3 common/python/compare.py \
    --steps 06_causal_skip,09_hopper_wgmma,10_hopper_pingpong --backends flash,cudnn \
    --seqlens 1024,2048,4096,8192,16384 --head-dims 64,128 --causal 0,1 --directions fwd \
    --warmup 3 --repeats 10 --out "$tmp/compare.json" --log-dir "" > "$tmp/compare.txt" 2>&1
  rc=$?
  tail -5 "$tmp/compare.txt" >> "$log"
  cp "$tmp/compare.json" "$out/hopper_compare.json" 2>/dev/null
  [ -f "$tmp/compare.json" ] && python3 "$tmp/ratios.py" "$tmp/compare.json" > "$tmp/ratios.txt" 2>&1
  cat "$tmp/ratios.txt" >> "$log" 2>/dev/null
  result "4 compare.py" "rc=$rc; $(grep '^worst' "$tmp/ratios.txt" 2>/dev/null)"
fi

# 4b. Tuning: the same sweep with 192-key blocks (FA_HOPPER_BLOCK_N=192), checked first
if [[ " $skip " != *" tune "* ]]; then
  FA_HOPPER_BLOCK_N=192 timeout 120 "$build/bin/fa_gpu_tests" \
    --gtest_filter='Steps/ForwardConformance.*/*_hopper_*:Steps/EdgeCases.*/*_hopper_*' \
    > "$tmp/conf192.txt" 2>&1
  rc=$?
  { grep -E "^\[  (PASSED|FAILED) " "$tmp/conf192.txt"; grep -A4 "Failure" "$tmp/conf192.txt" | head -30; } >> "$log"
  result "4b conformance kBlockN=192" "rc=$rc, $(grep -E '^\[  PASSED  \]' "$tmp/conf192.txt" | grep -oE '[0-9]+ test' | head -1)s passed, $(grep -cE '^\[  FAILED  \] .*\(' "$tmp/conf192.txt") failed"
  FA_HOPPER_BLOCK_N=192 FA_LIB=$build/lib/libfa.so timeout 200 python3 common/python/compare.py \
    --steps 09_hopper_wgmma,10_hopper_pingpong --backends flash \
    --seqlens 1024,2048,4096,8192,16384 --head-dims 64,128 --causal 0,1 --directions fwd \
    --warmup 3 --repeats 10 --out "$tmp/compare192.json" --log-dir "" > "$tmp/compare192.txt" 2>&1
  rc=$?
  cp "$tmp/compare192.json" "$out/hopper_compare_bn192.json" 2>/dev/null
  note "--- the same with FA_HOPPER_BLOCK_N=192 (FLASH re-measured in this run)"
  [ -f "$tmp/compare192.json" ] && python3 "$tmp/ratios.py" "$tmp/compare192.json" > "$tmp/ratios192.txt" 2>&1
  cat "$tmp/ratios192.txt" >> "$log" 2>/dev/null
  result "4b compare.py kBlockN=192" "rc=$rc; $(grep '^worst' "$tmp/ratios192.txt" 2>/dev/null)"
fi

# 5. Sanitizers (a short slice; racecheck may not model wgmma/TMA accesses: see the log)
if [[ " $skip " != *" sanitize "* ]]; then
  # Per step: 5 forward matrix cases (257 x 257 MQA in fp16, d 64/128, causal off/on; bf16
  # d = 128 causal Nq > Nk), the named edge cases, 2 random problems up to 384 rows.
  FA_SANITIZE_FILTER='Steps/ForwardConformance.*/@STEP@_fp16_*_odd_mqa:Steps/ForwardConformance.*/@STEP@_bf16_d128_causal_q_gt_k:Steps/EdgeCases.*/@STEP@:Random/RandomConformance.*/@STEP@_fwd' \
  FA_BUILD_DIR=$build FA_SANITIZE_STEPS="09_hopper_wgmma,10_hopper_pingpong" \
    FA_SANITIZE_BUDGET=${FA_SANITIZE_BUDGET:-110} FA_SANITIZE_TIMEOUT=100 \
    FA_RANDOM_PROBLEMS=2 FA_RANDOM_SECONDS=0 \
    timeout 130 bash common/scripts/sanitize.sh "$tmp/sanitize" > "$tmp/sanitize.txt" 2>&1
  rc=$?
  cat "$tmp/sanitize/summary.txt" >> "$log" 2>/dev/null
  for f in "$tmp"/sanitize/*.sanitizer.log; do  # the first reports of a tool that found any
    [ -f "$f" ] || continue
    if grep -qE "^========= [A-Z]" "$f" && ! grep -qE "ERROR SUMMARY: 0 errors" "$f"; then
      note "--- $(basename "$f"): $(grep -E 'SUMMARY' "$f" | tail -2 | tr '\n' ' ')"
      grep -E "^=========" "$f" | grep -v "SUMMARY" | head -30 >> "$log"
    fi
  done
  result "5 sanitizers" "rc=$rc; $(grep -E 'memcheck|racecheck|synccheck|initcheck' "$tmp/sanitize/summary.txt" 2>/dev/null | tr '\n' ';' | cut -c1-300)"
fi

note ""
note "hopper.sh summary ($((SECONDS - t0)) s)"
for line in "${summary[@]}"; do note "  $line"; done
[ -f "$tmp/ratios.txt" ] && cat "$tmp/ratios.txt"
[ -f "$tmp/ratios192.txt" ] && { echo "kBlockN = 192:"; cat "$tmp/ratios192.txt"; }
rm -rf "$tmp"
