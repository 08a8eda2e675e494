#!/usr/bin/env bash
# One GPU session in one go: configure and build for the GPU at hand, run every test (host
# and GPU), print the runner's figures at the issue's shapes, optionally the sanitizers and
# the bench. Logs go to $OUT (or ./gpu-logs).
#   FA_ONLY_STEPS="01_naive;05_split_q"  build only these steps
#   FA_SANITIZE=1                        also run common/scripts/sanitize.sh (4 tools)
#   FA_BENCH="--seqlens 4096"            also run the bench with these flags ("all": defaults)
#   FA_LARGE=1                           also run the large tests (ctest -L large: over 2^31
#                                        elements per tensor, about a minute, 48+ GiB)
set -uo pipefail
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
build=${FA_BUILD_DIR:-build-gpu}
jobs=$(nproc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF \
  ${FA_ONLY_STEPS:+-DFA_ONLY_STEPS="$FA_ONLY_STEPS"} > "$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$build" -j "$jobs" > "$out/build.log" 2>&1 || { grep -E "error|Error" "$out/build.log" | head -40; exit 1; }
grep -E "spill|stack frame" "$out/build.log" | sort -u | head -20
(cd "$build" && ctest -L host --output-on-failure -j "$jobs" > "$out/host_tests.log" 2>&1); echo "host tests rc=$? ($(grep -E 'tests passed' "$out/host_tests.log"))"
"$build/bin/fa_gpu_tests" > "$out/gpu_tests.log" 2>&1; rc=$?
echo "gpu tests rc=$rc"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran|GPU:" "$out/gpu_tests.log" | head -60
grep -B2 -A6 "Failure" "$out/gpu_tests.log" | head -80
for step in $(ls "$build/bin" | grep -E '^[0-9]{2}_'); do
  for causal in "" "--causal"; do
    "$build/bin/$step" --batch 1 --heads 16 --seqlen 4096 --head-dim 128 $causal 2>&1 | tail -1
    "$build/bin/$step" --batch 1 --heads 16 --seqlen 4096 --head-dim 128 $causal --backward \
      --no-ceilings 2>&1 | grep -v "has no backward" | tail -1
  done
done | tee "$out/runner.log"
"$build/bin/01_naive" --seqlen 256 2>&1 | grep -E "GPU|Ceilings"
if [ -n "${FA_LARGE:-}" ]; then
  (cd "$build" && ctest -L large --output-on-failure > "$out/large_tests.log" 2>&1)
  echo "large tests rc=$? ($(grep -E 'tests passed' "$out/large_tests.log"))"
  grep -E "^\[ large" "$out/large_tests.log"
fi
if [ -n "${FA_SANITIZE:-}" ]; then
  FA_BUILD_DIR="$PWD/$build" FA_SANITIZE_BUDGET=${FA_SANITIZE_BUDGET:-420} \
    bash common/scripts/sanitize.sh "$out/sanitize" 2>&1 | tail -40
fi
if [ -n "${FA_BENCH:-}" ]; then
  [ "$FA_BENCH" = all ] && FA_BENCH=""
  "$build/bin/bench" $FA_BENCH --out "$out/bench.json" 2> "$out/bench_progress.log" | tee "$out/bench.txt"
fi
