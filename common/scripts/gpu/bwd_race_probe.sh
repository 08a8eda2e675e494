#!/usr/bin/env bash
# Probe of 07's racecheck reports (issue #14): compute-sanitizer's racecheck reports shared
# memory hazards in deterministic mode with the large tiles only, where the thread block hands
# its dQ turn on through a named barrier (bar.arrive / bar.sync, FA_BWD_DQ_HANDOFF=2). Are the
# reports tied to that hand-off? Builds 06, 07 and x07_h1 (07 with FA_BWD_DQ_HANDOFF 1: one
# turn per warp, no named barrier) in build-probe, runs racecheck over two deterministic
# backward problems of each, then compare.py for 06 and 07 beside PyTorch FLASH (one run).
# Writes $OUT/race_*.log, $OUT/compare_probe.{log,json}.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"
b=$PWD/build-probe; x=$PWD/build-probe-labs
rm -rf "$x"; mkdir -p "$x"
python3 common/scripts/lab.py start 07_backward --reference --name x07_h1 --dir "$x" --build "$b" --no-configure > /dev/null || exit 1
sed -i 's/^#define FA_BWD_DQ_HANDOFF 2$/#define FA_BWD_DQ_HANDOFF 1/' "$x/x07_h1/kernel.cu"
grep -c "^#define FA_BWD_DQ_HANDOFF 1$" "$x/x07_h1/kernel.cu"
cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DFA_ONLY_STEPS="06_causal_skip;07_backward" "-DFA_LAB_DIRS=$x/x07_h1" > "$out/probe_configure.log" 2>&1 \
  || { tail -20 "$out/probe_configure.log"; exit 1; }
cmake --build "$b" -j "$(nproc)" --target fa_gpu_tests fa > "$out/probe_build.log" 2>&1 || { grep -E "error" "$out/probe_build.log" | head; exit 1; }
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ "${FA_PROBE_ONLY_TIMING:-0}" = 1 ] || for s in 07_backward x07_h1; do
  f="Steps/BackwardConformance.*/${s}_fp16_d64_full_odd_mqa_det:Steps/BackwardConformance.*/${s}_fp16_d128_causal_q_lt_k_gqa_det"
  timeout 240 "$cs" --tool racecheck --print-limit 20 --log-file "$out/race_$s.log" "$b/bin/fa_gpu_tests" \
    --gtest_filter="$f" > "$out/race_$s.out" 2>&1 &
done
wait
[ "${FA_PROBE_ONLY_TIMING:-0}" = 1 ] || for s in 07_backward x07_h1; do
  echo "$s: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/race_$s.out" | tr '\n' ' ') $(grep -E 'RACECHECK SUMMARY' "$out/race_$s.log")"
done
[ "${FA_PROBE_ONLY_TIMING:-0}" = 1 ] || FA_LIB=$b/lib/libfa.so OUT=$out timeout 150 python3 common/python/compare.py --steps 06_causal_skip,07_backward \
  --backends flash --seqlens 1024,2048,4096,8192,16384 --warmup 3 --repeats 10 \
  --out "$out/compare_probe.json" > "$out/compare_probe.log" 2>&1
[ "${FA_PROBE_ONLY_TIMING:-0}" = 1 ] || echo "compare.py: rc=$? $(tail -1 "$out/compare_probe.log")"
# Deterministic mode, hand-off 2 (07's default) against 1 (x07_h1), A B A B, and the default
# (non-deterministic) mode once, at 16K tokens, N = 16384 (FA_PROBE_TIMING=0 leaves it out).
[ "${FA_PROBE_TIMING:-1}" = 0 ] && exit 0
cmake --build "$b" -j "$(nproc)" --target 07_backward x07_h1 > "$out/probe_build_runners.log" 2>&1 || exit 1
for d in 64 128; do for c in "" --causal; do
  for r in "07_backward" "07_backward --deterministic" "x07_h1 --deterministic" "07_backward --deterministic" "x07_h1 --deterministic"; do
    set -- $r
    "$b/bin/$1" --backward ${2:-} --seqlen 16384 --head-dim $d $c --batch 1 --heads $((2048 / d)) --seed 7 \
      --warmup 3 --repeats 10 --no-ceilings 2>&1 | tail -1 | sed "s/^/[$r] d$d ${c:-none} /"
  done
done; done | tee "$out/det_timing.txt"
