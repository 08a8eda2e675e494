#!/usr/bin/env bash
# The coordinator's closing GPU run, standalone (not through all.sh: the README's own command
# builds ./build). In order of what matters most if the time runs out:
#   1. the README's test command, `cmake --workflow --preset test` (configure, build for this
#      GPU, every test but the opt-in large ones, gpu.lab included), timed;
#   2. compare.py over every step beside PyTorch FLASH and cuDNN (forward and backward) and
#      the decode sweep: the JSON the results page is written from;
#   3. the bench sweep (the per-step gains of the README's first command);
#   4. compute-sanitizer, four tools, over the steps this session changed;
#   5. the test preset again (gpu.lab aside) with new clock seeds, until FA_FINAL_RUNS runs in
#      all or FA_FINAL_DEADLINE seconds.
# Logs and JSON under $OUT/final, packed into $OUT/final.tgz; a summary last.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
out=${OUT:-$PWD/gpu-out}/final
mkdir -p "$out"
if [ -z "${FA_FINAL_BODY:-}" ]; then  # the body under a hard limit, then always the archive
  FA_FINAL_BODY=1 timeout -k 5 "${FA_FINAL_LIMIT:-560}" bash "$0" | tee "$out/summary.txt"
  tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
  exit 0
fi
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
deadline=${FA_FINAL_DEADLINE:-540}
runs=${FA_FINAL_RUNS:-10}
summary=()
note() { summary+=("$*"); echo "[$(el) s] $*"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1

# 1. the README's test command
cmake --workflow --preset test > "$out/readme_1.log" 2>&1; rc=$?
note "README test command, run 1: rc=$rc, $(grep -E 'tests passed|tests failed' "$out/readme_1.log" | tail -1)"
grep -E "\(Failed\)|\(Timeout\)|\*\*\*Exception" "$out/readme_1.log" | head -10
grep -E "spill" "$out/readme_1.log" | grep -v " 0 bytes spill" | sort -u > "$out/spills.txt"
export FA_BUILD_DIR=$PWD/build

# 2. compare.py: every step and FLASH/cuDNN; the decode sweep
OUT=$out timeout 200 python3 common/python/compare.py --backends flash,cudnn --seqlens 1024,2048,4096,8192,16384 \
  --warmup 3 --repeats 10 --out "$out/nvidia-h200.json" > "$out/compare.log" 2>&1
note "compare.py (all steps, fwd+bwd): rc=$? $(tail -1 "$out/compare.log")"
OUT=$out timeout 90 python3 common/python/compare.py --decode --steps 06_causal_skip,08_split_kv --backends flash \
  --seqlens-q 1 --heads-kv 8 --warmup 3 --repeats 10 --out "$out/nvidia-h200_decode.json" \
  > "$out/compare_decode.log" 2>&1
note "compare.py --decode: rc=$? $(tail -1 "$out/compare_decode.log")"

# 2b. 07's deterministic backward against its default, same seed, A B A B (runner)
for d in 64 128; do for c in "" --causal; do for n in 4096 16384; do
  for mode in "" --deterministic "" --deterministic; do
    ./build/bin/07_backward --backward $mode --seqlen $n --head-dim $d $c --batch $((16384 / n)) \
      --heads $((2048 / d)) --seed 7 --warmup 3 --repeats 10 --no-ceilings 2>&1 | tail -1 \
      | sed "s/^/det[${mode:-default}] /"
  done
done; done; done > "$out/determ_timing.txt" 2>&1
note "07 deterministic vs default timed: $(grep -c ' ok ' "$out/determ_timing.txt") checked rows ok of $(wc -l < "$out/determ_timing.txt")"

# 3. the bench sweep (FA_FINAL_BENCH=0 leaves it out)
[ "${FA_FINAL_BENCH:-1}" = 0 ] || timeout 120 ./build/bin/bench --out "$out/nvidia-h200_bench.json" > "$out/bench.txt" 2> "$out/bench_progress.log"
note "bench: rc=$?"

# 4. sanitizers over the changed steps
FA_SANITIZE_STEPS=${FA_FINAL_SANITIZE_STEPS:-02_tiled_fa1,03_loop_swap,04_deferred_rescale,05_split_q,07_backward,08_split_kv,09_hopper_wgmma,10_hopper_pingpong} \
  FA_SANITIZE_BUDGET=${FA_FINAL_SANITIZE_BUDGET:-150} FA_SANITIZE_JOBS=8 \
  timeout $(( ${FA_FINAL_SANITIZE_BUDGET:-150} + 40 )) bash common/scripts/sanitize.sh "$out/sanitize" > "$out/sanitize.txt" 2>&1
note "sanitizers: rc=$?"
grep -E "^(memcheck|racecheck|synccheck|initcheck) " "$out/sanitize/summary.txt" 2>/dev/null \
  | awk '{print "   " $1, $2, $3, $4, $5, $6, $7, $8, $9}' | head -40
for f in "$out"/sanitize/*.log; do  # the names of failed tests, for a run that was not clean
  grep -H -m3 -E "^\[  FAILED  \]" "$f" 2>/dev/null
done | head -20

# 5. the test preset again, fresh clock seeds, gpu.lab aside
for i in $(seq 2 "$runs"); do
  if [ "$(el)" -ge "$deadline" ]; then note "suite runs: stopped at the deadline before run $i"; break; fi
  t0=$(date +%s)
  ctest --preset default -j 16 -E '^gpu\.lab$' > "$out/suite_$i.log" 2>&1; rc=$?
  note "test preset run $i (gpu.lab aside): rc=$rc, $(( $(date +%s) - t0 )) s, $(grep -E 'tests passed|tests failed' "$out/suite_$i.log" | tail -1)"
  grep -E "\(Failed\)|\(Timeout\)" "$out/suite_$i.log" | head -5
done

note "total $(el) s"
printf '%s\n' "${summary[@]}"
