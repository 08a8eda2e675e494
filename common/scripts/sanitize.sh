#!/usr/bin/env bash
# Runs the GPU suite under compute-sanitizer's memcheck, racecheck, synccheck and initcheck,
# step by step, and prints one summary line per tool and step. Exits non-zero if any tool
# reports an error, a test fails, a run times out, or no test ran.
#
#   common/scripts/sanitize.sh [LOG_DIR]    logs to LOG_DIR, else $OUT, else build/sanitizer-logs
#
# It builds fa_gpu_tests first (configuring FA_BUILD_DIR, default ./build, if needed). What
# runs per step (a few minutes in all on an H200, several (tool, step) runs in parallel):
#   - the conformance matrix in fp16 and bf16 for the odd_mqa, q_lt_k_gqa and q_gt_k shapes
#     (forward, and backward in both modes where the step has one),
#   - every named edge case (EdgeCases.*, SafetyEdgeCases.* but LargestGrid, LongSequences,
#     CausalGridOfManyPairsWritesEveryRow and BackwardReadsWhatItsPreprocessWroteLast (large
#     problems; the last tests a race between kernels, which the tools' serialized launches
#     cannot show),
#     and for racecheck and initcheck DeterministicBackwardIsBitwiseRepeatableOverSeveralWaves),
#   - FA_RANDOM_PROBLEMS (default 10, the fewest that cover every class the random tests
#     promise) random problems with lengths up to FA_RANDOM_MAX_SEQLEN (default 384),
#   - and the same slice again under each FA_SMEM_LIMIT the step's CMakeLists lists
#     (SMEM_LIMITS, e.g. 07_backward's 99 KB shapes), as "07_backward@101376".
# Environment:
#   FA_SANITIZE_STEPS="01_naive,05_split_q"   only these steps (default: every registered one);
#       "07_backward@101376" runs a step under FA_SMEM_LIMIT=101376 (added by default for
#       every limit ctest knows, gpu.conformance.<step>.smem_<bytes>)
#   FA_SANITIZE_TOOLS="memcheck racecheck"     only these tools
#   FA_SANITIZE_FILTER='...@STEP@...'          replace the per-step gtest filter (@STEP@ = step)
#   FA_SANITIZE_TIMEOUT=900                    seconds per (tool, step) run
#   FA_SANITIZE_BUDGET=540                     seconds for all runs together, after the build
#       (default: no limit);
#       runs that would not fit are cut short (TIMEOUT) or not started (NOT-RUN), and the
#       summary is still printed: use it under a hard wall-clock limit
#   FA_SANITIZE_JOBS=8                         (tool, step) runs at the same time (nproc/2, <= 8)
#   FA_SANITIZE_SHARDS="01_naive:initcheck=8"  split a (tool, step) run into N gtest shards
#       (GTEST_TOTAL_SHARDS) that run side by side, for the slow ones (cuBLAS under initcheck);
#       space-separated STEP:TOOL=N entries, STEP or TOOL may be '*'. Results are summed.
#   FA_INITCHECK_IGNORE='regex'                initcheck errors in kernels whose name matches
#       are listed as "ignored" instead of failing (for a library kernel shown to be a false
#       positive, e.g. reads of a cudaMallocAsync pool the tool cannot see initialized). Empty
#       by default: nothing is ignored unless you say so, and the ignored ones are still printed.
#   COMPUTE_SANITIZER=/path/to/compute-sanitizer
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
root=$PWD
build=${FA_BUILD_DIR:-build}
case $build in /*) build_abs=$build ;; *) build_abs=$root/$build ;; esac
out=${1:-${OUT:-$build_abs/sanitizer-logs}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
tools=${FA_SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}
timeout_s=${FA_SANITIZE_TIMEOUT:-900}
ncpu=$(nproc)
jobs=${FA_SANITIZE_JOBS:-$(( ncpu / 2 > 8 ? 8 : (ncpu / 2 < 1 ? 1 : ncpu / 2) ))}
export FA_RANDOM_PROBLEMS=${FA_RANDOM_PROBLEMS:-10}
export FA_RANDOM_MAX_SEQLEN=${FA_RANDOM_MAX_SEQLEN:-384}

say() { echo "sanitize: $*" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"

# compute-sanitizer ships with the CUDA toolkit but is not always on PATH.
cs=${COMPUTE_SANITIZER:-}
if [ -z "$cs" ]; then
  for c in "$(command -v compute-sanitizer 2>/dev/null)" \
           "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" \
           "$(dirname "$(command -v nvcc 2>/dev/null || echo /nonexistent/nvcc)")/compute-sanitizer" \
           /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           /opt/nvidia/compute-sanitizer/compute-sanitizer; do
    if [ -n "$c" ] && [ -x "$c" ]; then cs=$c; break; fi
  done
fi
[ -n "$cs" ] || { say "compute-sanitizer not found (install the CUDA toolkit's, or set COMPUTE_SANITIZER)"; exit 2; }
if ! nvidia-smi -L > /dev/null 2>&1; then
  say "no GPU (nvidia-smi finds none); the sanitizers need an sm_80+ GPU"
  exit 1
fi
"$cs" --version 2>&1 | tail -1 > "$out/version.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$out/version.txt" 2>&1

# Build (incremental when the build folder exists).
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF \
    > "$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; say "configure failed"; exit 2; }
fi
cmake --build "$build" -j "$(nproc)" --target fa_gpu_tests > "$out/build.log" 2>&1 \
  || { grep -E "error" "$out/build.log" | head -20; say "build failed (see $out/build.log)"; exit 2; }
bin=$build/bin/fa_gpu_tests

# The registered steps: the parameters of the named edge cases. Then, per step, the shared
# memory limits its ctest entries run under (gpu.conformance.<step>.smem_<bytes>), as
# "<step>@<bytes>" units.
if [ -n "${FA_SANITIZE_STEPS:-}" ]; then
  steps=$(echo "$FA_SANITIZE_STEPS" | tr ',;' '  ')
else
  steps=$("$bin" --gtest_list_tests --gtest_filter='Steps/EdgeCases.*' 2>/dev/null |
          sed -n 's/^  [A-Za-z0-9_]*\/\([A-Za-z0-9_]*\).*/\1/p' | awk '!seen[$0]++')
  limited=$(ctest --test-dir "$build" -N 2>/dev/null |
            sed -n 's/.* gpu\.conformance\.\([A-Za-z0-9_]*\)\.smem_\([0-9]*\)$/\1@\2/p')
  steps="$steps $limited"
fi
[ -n "$steps" ] || { say "no registered step found in $bin"; exit 2; }

filter_for() {  # the gtest filter of one step ("<step>@<bytes>": the step's)
  local s=${1%@*}
  if [ -n "${FA_SANITIZE_FILTER:-}" ]; then
    echo "${FA_SANITIZE_FILTER//@STEP@/$s}"
    return
  fi
  local f="" shape dt
  for shape in odd_mqa q_lt_k_gqa q_gt_k; do
    for dt in fp16 bf16; do
      f+="Steps/ForwardConformance.*/${s}_${dt}_*_${shape}:"
      f+="Steps/BackwardConformance.*/${s}_${dt}_*_${shape}:Steps/BackwardConformance.*/${s}_${dt}_*_${shape}_det:"
    done
  done
  f+="Steps/EdgeCases.*/${s}:Steps/SafetyEdgeCases.*/${s}:Random/RandomConformance.*/${s}_fwd:"
  f+="Random/RandomConformance.*/${s}_bwd"
  f+="-*LargestGrid*:*LongSequences*:*CausalGridOfManyPairs*:*BackwardReadsWhatItsPreprocess*"
  echo "$f"
}

shards_for() {  # tool step -> how many gtest shards its run is split into
  local e n=1
  for e in ${FA_SANITIZE_SHARDS:-}; do
    case "$2:$1" in ${e%%=*}) n=${e#*=} ;; esac
  done
  echo "$n"
}

run_one() {  # tool step shard shards: one tool over one shard of a step's slice; writes
  # "<rc> <seconds>" to <base>.rc, base = $out/<tool>_<step>[.<shard>]
  local tool=$1 s=$2 base="$out/${1}_${2}"
  [ "$4" -gt 1 ] && base+=".$3"
  local t0=$SECONDS rc limit=$timeout_s
  if [ -n "$deadline" ]; then  # stay inside the overall budget, keeping time for the summary
    limit=$((deadline - SECONDS - 20))
    [ "$limit" -gt "$timeout_s" ] && limit=$timeout_s
    if [ "$limit" -lt 30 ]; then
      echo "budget 0" > "$base.rc"
      : > "$base.log"
      return
    fi
  fi
  # initcheck does not see cuBLAS's writes (common/scripts/initcheck_cublas.cu): 01_naive then
  # zeroes the scratch buffers cuBLAS overwrites, so that only our kernels' reads are judged.
  local envs=(GTEST_TOTAL_SHARDS="$4" GTEST_SHARD_INDEX="$3") extra=()
  [ "$tool" = initcheck ] && envs+=(FA_INITCHECK_PREFILL=1)
  # cuBLAS's own kernels are NVIDIA's, not this repository's (library_kernels, below).
  [ "$tool" = initcheck ] && extra+=(--kernel-name-exclude "regex=$library_kernels")
  case $s in *@*) envs+=(FA_SMEM_LIMIT="${s#*@}") ;; esac
  # The deterministic backward over several waves (SafetyEdgeCases, 16 problems of hundreds of
  # thread blocks) ran past 3 minutes under racecheck and initcheck on the H200 and took their
  # whole budget (2026-12-02). It tests the order of the dQ adds across thread blocks, in
  # device memory, which racecheck does not see (shared memory only), and it initializes
  # nothing the small deterministic tests of the slice do not: those two tools leave it out,
  # memcheck and synccheck run it.
  local filter
  filter=$(filter_for "$s")
  case $tool in
    racecheck | initcheck) case $filter in *-*) filter+=":*OverSeveralWaves*" ;;
                                           *) filter+="-*OverSeveralWaves*" ;; esac ;;
  esac
  env "${envs[@]}" timeout --kill-after=15 "$limit" "$cs" --tool "$tool" "${extra[@]}" \
    --error-exitcode 99 --print-limit 200 --log-file "$base.sanitizer.log" \
    "$bin" --gtest_filter="$filter" > "$base.log" 2>&1
  rc=$?
  echo "$rc $((SECONDS - t0))" > "$base.rc"
}

# The kernels of cuBLAS (01_naive's GEMMs: nvjet_*, cublasLt::splitKreduce_kernel) are
# NVIDIA's. On the H200 (CUDA 13.0, compute-sanitizer 2025.3.1) initcheck reports their split-K
# reduction reading the partials their GEMM wrote (it does not see cuBLAS's writes, as above),
# and racecheck a shared-memory hazard inside one of their Hopper GEMMs, in 01 as it was at
# efa9657 too. initcheck does not check them (--kernel-name-exclude; they still run). racecheck
# must check them (under it an excluded kernel does not run, and 01's tests fail), so its
# summary counts a hazard as cuBLAS's when its report names cuBLAS kernels, and the run stays
# clean only if every hazard is.
library_kernels='nvjet_|cublasLt|splitKreduce'

# reports_matching RE LOG: "shown matching", the reports a tool's log displays and how many of
# them name a kernel matching RE (on the report's first line or the four after it). A run's
# errors may be set apart only when every one was displayed and every one matches.
reports_matching() {
  awk -v re="$1" '
    /^========= [A-Z]/ && !/SUMMARY|COMPUTE-SANITIZER/ {
      total++; n = 4; hit = ($0 ~ re); if (hit) matched++; next }
    n > 0 { n--; if (!hit && $0 ~ re) { hit = 1; matched++ } }
    END { print total + 0, matched + 0 }' "$2"
}

# Every (tool, step) run is a separate process, FA_SANITIZE_JOBS at a time: the tools are
# mostly CPU-bound on the host, and the GPU has room for several small test programs.
deadline=""
[ -n "${FA_SANITIZE_BUDGET:-}" ] && deadline=$((SECONDS + FA_SANITIZE_BUDGET))
for s in $steps; do
  for tool in $tools; do
    rm -f "$out/${tool}_${s}".{rc,log,sanitizer.log,ignored.txt} "$out/${tool}_${s}".[0-9]*.*
    n=$(shards_for "$tool" "$s")
    for ((i = 0; i < n; i++)); do
      run_one "$tool" "$s" "$i" "$n" &
      while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    done
  done
done
wait

# One line per tool and step (per shard of a sharded run: "01_naive[3/8]").
failed=0
printf "%-10s %-22s %-8s %s\n" tool step result details | tee -a "$out/summary.txt"
for tool in $tools; do
  for unit in $(for s in $steps; do
                  n=$(shards_for "$tool" "$s")
                  if [ "$n" -gt 1 ]; then seq -f "$s.%g/$n" 0 $((n - 1)); else echo "$s"; fi
                done); do
    s=${unit%%.*}
    base="$out/${tool}_${unit%/*}"
    [ "$unit" != "$s" ] && s="$s[${unit#*.}]"
    read -r rc secs < "$base.rc" || { rc=1; secs=0; }
    log=$base.log
    slog=$base.sanitizer.log
    passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
    failed_tests=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
    skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
    passed=${passed:-0}; failed_tests=${failed_tests:-0}; skipped=${skipped:-0}
    errors=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' "$slog" 2>/dev/null | tail -1)
    if [ "$tool" = racecheck ]; then  # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
      rerr=$(sed -n 's/.*RACECHECK SUMMARY:.*(\([0-9]*\) error.*/\1/p' "$slog" 2>/dev/null | tail -1)
      rwarn=$(sed -n 's/.*RACECHECK SUMMARY:.*, \([0-9]*\) warning.*/\1/p' "$slog" 2>/dev/null | tail -1)
      errors=${rerr:-${errors:-}}
    fi
    ignored=0
    if [ "$tool" = initcheck ] && [ -n "${FA_INITCHECK_IGNORE:-}" ] && [ "${errors:-0}" -gt 0 ]; then
      # An error is ignored only if its report names a matching kernel, and only if every
      # error was displayed and matches: one real error keeps the count.
      read -r shown ignored < <(reports_matching "$FA_INITCHECK_IGNORE" "$slog")
      if [ "$ignored" -gt 0 ]; then
        awk -v re="$FA_INITCHECK_IGNORE" '/^========= [A-Z]/,0 { if ($0 ~ re) print }' "$slog" |
          sort | uniq -c | sort -rn > "$base.ignored.txt"
      fi
      [ "$ignored" = "$shown" ] && [ "$shown" = "$errors" ] && errors=0
    fi
    library=0
    if [ "$tool" = racecheck ] && [ "${errors:-0}" -gt 0 ]; then
      read -r shown library < <(reports_matching "$library_kernels" "$slog")
      [ "$library" = "$shown" ] && [ "$shown" = "$errors" ] && errors=0 || library=0
    fi
    kernels=""
    if [ "${errors:-0}" != 0 ] && [ -f "$slog" ]; then  # where the errors are, by kernel (best effort)
      kernels=$(grep -E "^=========.* (at|in) " "$slog" | grep -oE "[A-Za-z_][A-Za-z0-9_]*(<[^()]*>)?\(" |
                sed 's/($//' | sort | uniq -c | sort -rn | head -3 |
                awk '{c = $1; $1 = ""; printf "%s%dx%s", (NR > 1 ? ";" : ""), c, $0}')
    fi
    details="$passed passed, $failed_tests failed, $skipped skipped, ${errors:-?} errors"
    [ "$tool" = racecheck ] && details+=", ${rwarn:-0} warnings"
    [ "$ignored" != 0 ] && details+=", $ignored ignored by FA_INITCHECK_IGNORE (see ${base}.ignored.txt)"
    [ "$library" != 0 ] && details+=", $library in cuBLAS's own kernels (not ours: $slog)"
    details+=", ${secs}s"
    if ! grep -q '^\[==========\]' "$log" 2>/dev/null && [ "$rc" != budget ]; then
      # No test ran: say what the program said last (e.g. an FA_* variable it refused).
      why=$(grep -v '^[[:space:]]*$' "$log" 2>/dev/null | tail -1 | cut -c1-200)
      details+=", exited before any test: ${why:-no output}"
    fi
    if [ "$rc" = budget ]; then
      result=NOT-RUN  # FA_SANITIZE_BUDGET was spent before this run could start
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      result=TIMEOUT
    elif [ -z "${errors:-}" ]; then
      result=NO-SUMMARY  # the tool did not finish (crash?)
    elif [ "$errors" != 0 ]; then
      result=ERRORS
    elif [ "$failed_tests" != 0 ] || { [ "$rc" != 0 ] && [ "$rc" != 99 ]; }; then
      result=FAILED
    elif [ "$passed" = 0 ] || grep -q "No CUDA device" "$log"; then
      result=NO-TESTS
    else
      result=clean
    fi
    [ "$result" = clean ] || failed=$((failed + 1))
    line=$(printf "%-10s %-22s %-8s %s" "$tool" "$s" "$result" "$details")
    [ -n "$kernels" ] && line+="  [$kernels]"
    [ "$result" = clean ] || line+="  logs: $base.log, $base.sanitizer.log"
    echo "$line" | tee -a "$out/summary.txt"
  done
done
if [ "$failed" -gt 0 ]; then
  say "$failed (tool, step) runs not clean; logs in $out"
  exit 1
fi
say "every step clean under: $tools (logs in $out)"
