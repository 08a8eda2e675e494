#!/usr/bin/env bash
# A whole session's GPU proof as a queue of tasks that survives between calls: each call runs
# the tasks not yet done, in order, while the next one's estimate still fits the call's limit,
# and records each task it has run (passed or not) in build/.gpu-queue-done (the build tree is ignored by git
# and stays on a warm machine). Calling it again on the same machine picks up where the last
# call stopped, without rebuilding; on a fresh machine, or given another commit (FA_GIT_COMMIT,
# else git's HEAD), it starts over with the README's command. When no task runs although some
# are left (the limit below the next one's estimate), it says so and exits 3.
#
#   FA_QUEUE_LIMIT=570   seconds this call may take (the device tool's 10 minutes, less a margin)
#   FA_QUEUE_TASKS="..." the task names, in order (default: all below)
#   FA_QUEUE_RUNS=10     runs of the test suite with clock seeds, the README's command included
#   FA_QUEUE_VARIANTS="labs/x03_kvalt"   extra step folders (FA_LAB_DIRS) for the `variant` task
#   FA_QUEUE_VARIANT_STEPS="02_tiled_fa1,03_loop_swap"   the steps built and benched beside them
#   FA_QUEUE_SANITIZE_STEPS, FA_QUEUE_SANITIZE_BUDGET=150, FA_QUEUE_SANITIZE_SHARDS
#                        the `sanitize` task's steps, seconds and gtest shards (sanitize.sh)
#
# Tasks (estimated seconds on an H200 with 16 cores):
#   readme     the README's test command, `cmake --workflow --preset test`: configure, build for
#              this GPU, every test but the opt-in large ones, gpu.lab included          ~480
#   suite      the GPU tests again (ctest -L gpu, gpu.lab and large aside, the test preset's 4
#              jobs), new clock seeds each time, until FA_QUEUE_RUNS runs in all        ~40 each
#   robust     robust.sh without its suite and sanitizer sections: issue 17's seed, bad FA_*
#              values, the large label, the runner's bad inputs                          ~170
#   compare    compare.py, every step beside PyTorch FLASH and cuDNN, forward and backward, in
#              two rounds: the JSON the results pages are written from                   ~330
#   bench      the bench sweep (16K tokens, hidden 2048, seqlen 512..16384, d 64/128, causal
#              off/on), forward and backward, in two rounds                               ~200
#   sanitize   compute-sanitizer's four tools over steps 01-06 (FA_QUEUE_SANITIZE_STEPS) ~190
#   variant    the FA_QUEUE_VARIANTS folders built as extra steps: their conformance, then the
#              bench sweep, forward, beside FA_QUEUE_VARIANT_STEPS in one process         ~150
#   sanitize07 robust.sh's sanitizer section: 07_backward's bf16 slice, default and 99 KB  ~200
#   determ     07's backward, deterministic and default mode back to back (runner, same seed),
#              d 64/128, N 1024/4096/16384, causal off/on                                 ~40
# Logs go to $OUT (default gpu-logs/; under $OUT they are packed into queue-logs.tgz at the end,
# the JSON results and queue.log left beside it); a summary, one line per task, is printed last.
. "$(dirname "$0")/setup.sh" queue
build=$root/build bin=$root/build/bin  # the README's command builds ./build
limit=${FA_QUEUE_LIMIT:-570}
runs=${FA_QUEUE_RUNS:-10}
state=$build/.gpu-queue-done
start=$SECONDS
el() { echo $((SECONDS - start)); }
fits() { [ $(($(el) + $1)) -le "$limit" ]; }
done_() { grep -qx "$1" "$state" 2>/dev/null; }
mark() { mkdir -p "$build" && echo "$1" >> "$state"; }
summary=()
record() { summary+=("$(printf '[%4s s] %-10s %s' "$(el)" "$1" "$2")"); say "== $1: $2"; }
failures() { grep -E "\(Failed\)|\(Timeout\)|\(SEGFAULT\)|\*\*\*Exception|^\[  FAILED  \]" "$1" | head -8; }
suite_runs() { grep -c . "$build/.gpu-queue-suite" 2>/dev/null || echo 0; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader >> "$log" 2>&1
# The tasks done are those of one commit: a warm machine given a new commit starts over.
commit=${FA_GIT_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
if [ -f "$state" ] && [ "$(head -1 "$state")" != "commit $commit" ]; then
  say "queue: the tasks done on this machine were for $(head -1 "$state" | cut -d' ' -f2-); starting over for $commit"
  rm -f "$state" "$build/.gpu-queue-suite"
fi
[ -f "$state" ] || { mkdir -p "$build" && echo "commit $commit" > "$state"; }
say "queue: commit $commit, limit $limit s, done before: $(tail -n +2 "$state" | tr '\n' ' ')"

task_readme() {
  local t0=$SECONDS rc
  timeout -k 5 $((limit - $(el) - 10)) cmake --workflow --preset test > "$out/readme.log" 2>&1; rc=$?
  if [ $rc = 124 ] || [ $rc = 137 ]; then  # cut at the call's limit: the next call runs it again
    record readme "cut at the limit after $((SECONDS - t0)) s (the next call runs it again, on the built tree)"
    return 124
  fi
  echo "readme rc=$rc" >> "$build/.gpu-queue-suite"
  record readme "rc=$rc, $((SECONDS - t0)) s, $(grep -E 'tests passed|tests failed' "$out/readme.log" | tail -1)"
  failures "$out/readme.log" | tee -a "$log"
  grep -E "LAB VERDICT|LAB TABLE" "$out/readme.log" | sed 's/^[0-9]*: //' | tee -a "$log"
  grep -ohE "FA_[A-Z_]*SEED=[0-9]+|base seed [0-9]+" "$out/readme.log" | sort -u | head -4 | tee -a "$log"
  return $rc
}
task_suite() {
  local i t0 rc
  while [ "$(suite_runs)" -lt "$runs" ]; do
    fits 60 || return 1
    i=$(($(suite_runs) + 1)) t0=$SECONDS
    (cd "$build" && ctest -L gpu -LE large -E '^gpu\.lab$' -j 4 --output-on-failure) \
      > "$out/suite_$i.log" 2>&1; rc=$?
    echo "suite rc=$rc" >> "$build/.gpu-queue-suite"
    record "suite $i" "rc=$rc, $((SECONDS - t0)) s, $(grep -E 'tests passed|tests failed' "$out/suite_$i.log" | tail -1); $(grep -ohE 'base seed [0-9]+' "$out/suite_$i.log" | head -1)"
    failures "$out/suite_$i.log" | tee -a "$log"
  done
}
task_robust() {
  FA_BUILD_DIR=$build FA_ROBUST_SKIP="suite sanitize" bash common/scripts/gpu/robust.sh \
    > "$out/robust_summary.txt" 2>&1
  local rc=$?
  record robust "rc=$rc"
  sed -n '/^section  *result/,$p' "$out/robust_summary.txt" | tee -a "$log"
  return $rc
}
task_compare() {
  FA_BUILD_DIR=$build timeout 420 python3 common/python/compare.py --backends flash,cudnn \
    --seqlens 1024,2048,4096,8192,16384 --warmup 3 --repeats 10 --out "$out/nvidia-h200.json" \
    > "$out/compare.log" 2>&1
  local rc=$?
  record compare "rc=$rc $(tail -1 "$out/compare.log")"
  return $rc
}
task_bench() {
  timeout 300 "$bin/bench" --out "$out/nvidia-h200_bench.json" > "$out/bench.txt" 2> "$out/bench_progress.log"
  local rc=$?
  record bench "rc=$rc, $(grep -c . "$out/bench.txt") lines"
  return $rc
}
task_sanitize() {
  FA_BUILD_DIR=$build FA_SANITIZE_STEPS=${FA_QUEUE_SANITIZE_STEPS:-01_naive,02_tiled_fa1,03_loop_swap,04_deferred_rescale,05_split_q,06_causal_skip} \
    FA_SANITIZE_BUDGET=${FA_QUEUE_SANITIZE_BUDGET:-150} FA_SANITIZE_JOBS=8 \
    FA_SANITIZE_SHARDS=${FA_QUEUE_SANITIZE_SHARDS:-"01_naive:initcheck=4"} \
    timeout $((${FA_QUEUE_SANITIZE_BUDGET:-150} + 50)) bash common/scripts/sanitize.sh "$out/sanitize" > "$out/sanitize.txt" 2>&1
  local rc=$?
  record sanitize "rc=$rc"
  grep -E "^(memcheck|racecheck|synccheck|initcheck) " "$out/sanitize/summary.txt" | tee -a "$log"
  return $rc
}
task_variant() {
  local dirs="" names="" d vb=$root/build-variants rc beside=${FA_QUEUE_VARIANT_STEPS:-02_tiled_fa1,03_loop_swap}
  for d in ${FA_QUEUE_VARIANTS:-labs/x03_kvalt}; do
    [ -f "$root/$d/kernel.cu" ] || continue
    dirs+="$root/$d;" names+="$(basename "$d"),"
  done
  [ -n "$dirs" ] || { record variant "no variant folder"; return 1; }
  cmake -S "$root" -B "$vb" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-Xptxas=-v \
    -DFA_ONLY_STEPS="${beside//,/;}" -DFA_LAB_DIRS="${dirs%;}" > "$out/variant_build.log" 2>&1 &&
    cmake --build "$vb" -j 16 --target bench fa_gpu_tests >> "$out/variant_build.log" 2>&1
  rc=$?
  [ $rc = 0 ] || { record variant "build rc=$rc"; grep -E "error" "$out/variant_build.log" | head -10; return 1; }
  local filter=""
  for d in ${names//,/ }; do filter+="*/$d*:*.$d*:"; done
  FA_RANDOM_PROBLEMS=20 timeout 150 "$vb/bin/fa_gpu_tests" --gtest_filter="$filter" --gtest_brief=1 \
    > "$out/variant_tests.log" 2>&1; rc=$?
  record "variant" "conformance rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$out/variant_tests.log" | tr '\n' ' ')"
  failures "$out/variant_tests.log" | tee -a "$log"
  timeout 150 "$vb/bin/bench" --steps "$beside,${names%,}" --direction fwd --warmup 2 \
    --repeats 5 --out "$out/variant_bench.json" > "$out/variant_bench.txt" 2>&1
  record "variant" "bench rc=$?"
  return $rc
}
task_determ() {
  local d n c line
  : > "$out/determ.txt"
  for d in 64 128; do for n in 1024 4096 16384; do for c in "" --causal; do
    for mode in "" --deterministic; do  # back to back, same inputs (the runner's seed)
      line=$("$bin/07_backward" --backward --no-ceilings --no-check --seed 7 --batch $((16384 / n)) \
        --heads $((2048 / d)) --seqlen $n --head-dim $d $c $mode --warmup 3 --repeats 10 2>&1 | tail -1)
      echo "d=$d N=$n ${c:-full} ${mode:-default} | $line" >> "$out/determ.txt"
    done
  done; done; done
  record determ "$(grep -c . "$out/determ.txt") runner lines"
  cat "$out/determ.txt" >> "$log"
}
task_sanitize07() {
  FA_BUILD_DIR=$build FA_ROBUST_SKIP="seed suite env large runner" FA_SANITIZE_BUDGET=170 \
    timeout 230 bash common/scripts/gpu/robust.sh > "$out/sanitize07_summary.txt" 2>&1
  record sanitize07 "$(grep -E '^sanitize ' "$out/sanitize07_summary.txt" | tail -1)"
}

declare -A cost=([readme]=480 [suite]=60 [robust]=170 [compare]=330 [bench]=200
                 [sanitize]=$((${FA_QUEUE_SANITIZE_BUDGET:-150} + 40))
                 [variant]=150 [sanitize07]=200 [determ]=40)
ran=0 pending=0
for t in ${FA_QUEUE_TASKS:-readme suite robust compare bench sanitize variant sanitize07}; do
  done_ "$t" && continue
  if [ "$t" != readme ] && ! done_ readme; then record "$t" "not run: the README's command has not run on this machine"; pending=1; continue; fi
  if ! fits "${cost[$t]:-60}"; then record "$t" "not run: ${cost[$t]:-60} s would not fit ($(el) of $limit s used)"; pending=1; continue; fi
  ran=1
  "task_$t"; rc=$?  # a failure is recorded above, not retried by the next call; a cut one is
  [ $rc = 124 ] && break
  if [ "$t" != suite ] || [ "$(suite_runs)" -ge "$runs" ]; then mark "$t"; fi
done
echo
printf '%s\n' "${summary[@]}" | tee -a "$log"
say "suite runs so far (the README's command first): $(tr '\n' ',' 2>/dev/null < "$build/.gpu-queue-suite")"
# The device tool brings back only a few files per call (8 in this project's sessions): under
# $OUT, every log but the summary goes into one archive, and the JSON results stay beside it.
if [ -n "${OUT:-}" ]; then
  pack=$(mktemp /tmp/queue-logs.XXXXXX)  # outside $out: tar must not read its own archive
  (cd "$out" && tar czf "$pack" --exclude='*.json' --exclude=queue.log . && mv "$pack" queue-logs.tgz &&
    find . -mindepth 1 -type f ! -name '*.json' ! -name queue.log ! -name queue-logs.tgz -delete &&
    find . -mindepth 1 -type d -empty -delete)
fi
# Nothing ran although tasks were left (FA_QUEUE_LIMIT below the next task's estimate, or the
# README's command not in the list on a fresh machine): say so where the caller looks first.
if [ $ran = 0 ] && [ $pending = 1 ]; then
  echo "queue: no task ran; the summary above says why" >&2
  exit 3
fi
