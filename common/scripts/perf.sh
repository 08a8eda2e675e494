#!/usr/bin/env bash
# Quick A/B loop on a GPU machine: build only the steps named, run their conformance tests,
# then the bench on a few shapes. Logs under $OUT (or ./gpu-logs).
#   FA_ONLY_STEPS="05_split_q;06_causal_skip" \
#   FA_BENCH_ARGS="--seqlens 2048,8192 --direction fwd" bash common/scripts/perf.sh
# Extra CMake flags (e.g. tile overrides) go in FA_CMAKE_ARGS. The exit status is non-zero when
# the conformance tests or the bench fail (the bench still runs after failed tests).
set -uo pipefail
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
build=${FA_BUILD_DIR:-build-perf}
steps=${FA_ONLY_STEPS:?set FA_ONLY_STEPS to the steps to build, e.g. \"05_split_q\"}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF \
  -DFA_ONLY_STEPS="$steps" ${FA_CMAKE_ARGS:-} > "$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" > "$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -30; exit 1; }
grep -E "spill|stack frame" "$out/build.log" | sort -u | head
filter=""
for s in ${steps//;/ }; do filter="$filter*/$s*:"; done
FA_RANDOM_PROBLEMS=${FA_RANDOM_PROBLEMS:-10} "$build/bin/fa_gpu_tests" --gtest_filter="$filter" \
  --gtest_brief=1 > "$out/tests.log" 2>&1
tests_rc=$?
echo "conformance rc=$tests_rc $(grep -E '^\[  (PASSED|FAILED) ' "$out/tests.log" | head -3 | tr '\n' ' ')"
grep -A8 "Failure" "$out/tests.log" | head -40
"$build/bin/bench" --steps "${steps//;/,}" ${FA_BENCH_ARGS:-} --out "$out/bench.json" \
  2> "$out/bench_progress.log" | tee "$out/bench.txt"
bench_rc=${PIPESTATUS[0]}
[ "$tests_rc" -eq 0 ] || exit 1
exit "$bench_rc"
