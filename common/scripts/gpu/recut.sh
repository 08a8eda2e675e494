#!/usr/bin/env bash
# GPU proof for issue #13 (the re-cut of steps 01-06: one idea per diff). Assumes an already
# built tree in $FA_BUILD_DIR (default build-gpu, every step, sm_90); writes $OUT/recut.log, the
# raw JSON (recut_bench.json, recut_variants_d128.json, recut_variants_d64.json,
# recut_riders.json, recut_compare.json) and the riders' Markdown block for 05_split_q/README.md
# (recut_riders.md), and prints a summary at the end. The tables come from recut_report.py.
#
# What it runs, in this order (the CPU-only build of the variants runs in the background
# meanwhile, in build-recut-variants):
#   1. the GPU conformance suite of steps 01-06 (fa_gpu_tests; random problems: 8 per step and
#      direction, at most 10 s each);
#   2. the bench sweep of 01-06, forward (16K tokens, hidden 2048, seqlen 512..16384, d 64/128,
#      causal off/on), each step's gain over the one before, and the issue's bounds: 02 >= 01,
#      each of 03..06 >= 0.97x the step before;
#   3. the variants, each a copy of a step's kernel.cu built with one switch and registered as an
#      extra step (FA_LAB_DIRS), benched beside 01-06 in one process:
#        02 with B_c = 64 at d = 128 (`_bn64`: 03's tile; 02's default is FlashAttention-1's 128),
#        03/04 with B_c = 128 at d = 128 (`_bn128`: 02's tile; they then need 154 KiB of shared
#        memory),
#        02/03/04 without the minimum of 2 thread blocks per SM in __launch_bounds__ (`_lb0`),
#        05 without its riders (`_bm64`: 64-row Q blocks; `_noskip`: FA_RESCALE_SKIP=0; both);
#      at d = 128 every seqlen of the sweep, at d = 64 seqlen 1024, 4096, 16384; then the chain
#      01..06 again for every choice of variants (which choice meets the issue's bounds), the
#      variant / default ratios, the 05 riders' table, registers and spills from ptxas -v;
#   4. compare.py: 01-06 and PyTorch's FLASH on the same tensors at N = 1024 ... 16384 (06 /
#      FLASH: issue >= 1.05, causal >= 1.1), and the agreement of bench and compare.py per step
#      and shape (issue: within 5%);
#   5. compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on 02-05, memcheck on 01
#      (common/scripts/sanitize.sh, FA_RANDOM_PROBLEMS=2, budgets 100 s + 40 s).
# Knobs: RECUT_SANITIZE=0 skips 5; RECUT_VARIANTS=0 skips 3; RECUT_QUICK=1 is the quick pass:
# 1, 3 and compare.py's FLASH ratios only (no sweep, no agreement check, no sanitizers).
# Expected device time on an H200: about 3.5 minutes with RECUT_SANITIZE=0 (tests ~0.5, sweep
# ~1, variants ~1.5, compare.py ~0.5), 6 minutes in full, 2.5 with RECUT_QUICK=1. Under all.sh
# give it FA_GPU_LIMIT_recut=420 (full) or 300 (RECUT_SANITIZE=0).
. "$(dirname "$0")/setup.sh" recut
work=$(mktemp -d /tmp/recut.XXXXXX)
report="python3 $root/common/scripts/gpu/recut_report.py"
steps=01_naive,02_tiled_fa1,03_loop_swap,04_deferred_rescale,05_split_q,06_causal_skip
quick=${RECUT_QUICK:-0}
do_variants=${RECUT_VARIANTS:-1}
do_sanitize=${RECUT_SANITIZE:-1}
[ "$quick" = 1 ] && do_sanitize=0
t_start=$SECONDS
stamp() { say "[$((SECONDS - t_start)) s] $*"; }

[ -x "$build/bin/bench" ] && [ -x "$build/bin/fa_gpu_tests" ] ||
  { say "recut: no built tree in $build (bin/bench, bin/fa_gpu_tests)"; exit 2; }
say "recut: commit $(git rev-parse --short HEAD 2>/dev/null), build $build, quick=$quick" \
  "variants=$do_variants sanitize=$do_sanitize"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 |
  head -1 | tee -a "$log"

# --- 0. the variants: a second build in the background (CPU only) ----------------------------
vbuild=$root/build-recut-variants
vsrc=$work/variants
variant() {  # name source_step sed_expression definitions...
  local name=$1 src=$2 expr=$3
  shift 3
  mkdir -p "$vsrc/$name"
  sed -e "${expr:-s/^//}" "$root/$src/kernel.cu" > "$vsrc/$name/kernel.cu"
  if [ -n "$expr" ] && cmp -s "$root/$src/kernel.cu" "$vsrc/$name/kernel.cu"; then
    echo "variant $name: the edit '$expr' changed nothing in $src/kernel.cu" | tee -a "$log" >&2
  fi
  echo "fa_add_step($name)" > "$vsrc/$name/CMakeLists.txt"
  [ $# -gt 0 ] && echo "target_compile_definitions(fa_step_$name PRIVATE $*)" \
    >> "$vsrc/$name/CMakeLists.txt"
  echo -n "$vsrc/$name;"
}
lb0='s/__launch_bounds__(Traits<kHeadDim>::kNumThreads, 2)/__launch_bounds__(Traits<kHeadDim>::kNumThreads)/'
v02=02_tiled_fa1 v03=03_loop_swap v04=04_deferred_rescale v05=05_split_q
if [ "$do_variants" = 1 ]; then
  labs=""
  labs+=$(variant ${v02}_bn64 $v02 "" FA_FWD_BLOCK_N_D128=64)
  labs+=$(variant ${v02}_lb0 $v02 "$lb0")
  labs+=$(variant ${v02}_bn64_lb0 $v02 "$lb0" FA_FWD_BLOCK_N_D128=64)
  labs+=$(variant ${v03}_bn128 $v03 "" FA_FWD_BLOCK_N_D128=128)
  labs+=$(variant ${v03}_lb0 $v03 "$lb0")
  labs+=$(variant ${v04}_bn128 $v04 "" FA_FWD_BLOCK_N_D128=128)
  labs+=$(variant ${v04}_lb0 $v04 "$lb0")
  labs+=$(variant ${v05}_bm64 $v05 "" FA_FWD_BLOCK_M=64)
  labs+=$(variant ${v05}_noskip $v05 "" FA_RESCALE_SKIP=0)
  labs+=$(variant ${v05}_bm64_noskip $v05 "" FA_FWD_BLOCK_M=64 FA_RESCALE_SKIP=0)
  (
    cmake -S "$root" -B "$vbuild" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF \
      -DFA_BUILD_TESTS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-Xptxas=-v \
      -DFA_ONLY_STEPS="${steps//,/;}" -DFA_LAB_DIRS="${labs%;}" &&
      nice -n 10 cmake --build "$vbuild" -j 8 --target bench
  ) > "$work/variants_build.log" 2>&1 &
  vpid=$!
fi

# --- 1. conformance ---------------------------------------------------------------------------
filter=""
for s in ${steps//,/ }; do filter+="*/$s*:*.$s*:"; done
stamp "1. GPU conformance suite of $steps"
FA_RANDOM_PROBLEMS=${FA_RANDOM_PROBLEMS:-10} FA_RANDOM_SECONDS=${FA_RANDOM_SECONDS:-10} \
  "$build/bin/fa_gpu_tests" --gtest_filter="$filter" \
  --gtest_brief=1 > "$work/tests.log" 2>&1
tests_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |seed" "$work/tests.log" | head -8 | tee -a "$log"
grep -B2 -A10 "Failure" "$work/tests.log" | head -60 >> "$log"
say "conformance rc=$tests_rc"

# --- 2. the bench sweep -----------------------------------------------------------------------
bench_rc=skipped
if [ "$quick" != 1 ]; then
  stamp "2. bench sweep, forward, steps 01-06"
  "$build/bin/bench" --steps "$steps" --direction fwd --warmup 2 --repeats 5 \
    --out "$work/bench.json" > "$work/bench.txt" 2> "$work/bench_progress.log"
  bench_rc=$?
  say "bench rc=$bench_rc"
  $report chain "$work/bench.json" "$steps" > "$work/bench_summary.txt" 2>&1
  cat "$work/bench_summary.txt" >> "$log"
fi

# --- 3. the variants --------------------------------------------------------------------------
variants_rc=skipped
if [ "$do_variants" = 1 ]; then
  stamp "3. variants (waiting for their build)"
  wait $vpid
  variants_rc=$?
  if [ "$variants_rc" != 0 ]; then
    say "variant build failed (rc=$variants_rc):"
    grep -E "error|Error" "$work/variants_build.log" | head -20 | tee -a "$log"
  else
    stamp "3a. d = 128, every seqlen: 01-06 and the 02/03/04 variants"
    vb=$vbuild/bin/bench
    d128="$steps,${v02}_bn64,${v02}_lb0,${v02}_bn64_lb0,${v03}_bn128,${v03}_lb0"
    d128+=",${v04}_bn128,${v04}_lb0"
    "$vb" --steps "$d128" --direction fwd --head-dims 128 --warmup 2 --repeats 5 \
      --check-rows 16 --out "$work/variants_d128.json" > "$work/variants_d128.txt" 2>&1
    variants_rc=$?
    stamp "3b. d = 64, seqlen 1024/4096/16384: 01-06 and the 02/03/04 _lb0 variants"
    "$vb" --steps "$steps,${v02}_lb0,${v03}_lb0,${v04}_lb0" --direction fwd --head-dims 64 \
      --seqlens 1024,4096,16384 --warmup 2 --repeats 5 --check-rows 16 \
      --out "$work/variants_d64.json" > "$work/variants_d64.txt" 2>&1
    variants_rc="$variants_rc/$?"
    stamp "3c. the riders of 05"
    "$vb" --steps "$v05,${v05}_bm64,${v05}_noskip,${v05}_bm64_noskip" --direction fwd \
      --seqlens 1024,4096,16384 --warmup 2 --repeats 5 --check-rows 16 \
      --out "$work/riders.json" > "$work/riders.txt" 2>&1
    variants_rc="$variants_rc/$?"
    say "variant benches rc=$variants_rc"
    {
      echo "--- d = 128: the chain with the defaults (same process as the variants)"
      $report chain "$work/variants_d128.json" "$steps"
      echo "--- d = 128: the chain for every choice of variants"
      $report whatif "$work/variants_d128.json" \
        "$v02=${v02}_bn64,${v02}_lb0,${v02}_bn64_lb0;$v03=${v03}_bn128,${v03}_lb0;$v04=${v04}_bn128,${v04}_lb0"
      $report ratios "$work/variants_d128.json" \
        "$v02=${v02}_bn64,${v02}_lb0,${v02}_bn64_lb0;$v03=${v03}_bn128,${v03}_lb0;$v04=${v04}_bn128,${v04}_lb0"
      echo "--- d = 64"
      $report chain "$work/variants_d64.json" "$steps"
      $report whatif "$work/variants_d64.json" "$v02=${v02}_lb0;$v03=${v03}_lb0;$v04=${v04}_lb0"
      $report ratios "$work/variants_d64.json" "$v02=${v02}_lb0;$v03=${v03}_lb0;$v04=${v04}_lb0"
      echo "--- the riders of 05 (Markdown for its README: recut_riders.md)"
      $report riders "$work/riders.json" "$out/recut_riders.md"
      echo "--- registers and spills (ptxas -v, sm_90, fp16; bf16 is the same)"
      $report regs "$work/variants_build.log"
    } >> "$log" 2>&1
  fi
fi

# --- 4. compare.py: FLASH beside the steps, and bench vs compare.py ---------------------------
stamp "4. compare.py (01-06 + FLASH, N = 1024-16384)"
FA_LIB=$build/lib/libfa.so python3 common/python/compare.py --steps "$steps" --backends flash \
  --seqlens 1024,2048,4096,8192,16384 --head-dims 64,128 --causal 0,1 --directions fwd \
  --warmup 3 --repeats 10 \
  --out "$work/compare.json" --log-dir "$work/compare_logs" > "$work/compare.txt" 2>&1
compare_rc=$?
say "compare.py rc=$compare_rc"
bench_json=$work/bench.json
[ -f "$bench_json" ] || bench_json=-
$report agree "$work/compare.json" "$bench_json" >> "$log" 2>&1

# --- 5. sanitizers ------------------------------------------------------------------------------
san_rc=skipped
san01_rc=skipped
if [ "$do_sanitize" = 1 ]; then
  stamp "5. compute-sanitizer on 02-05 (4 tools) and 01 (memcheck)"
  FA_BUILD_DIR=$build FA_SANITIZE_STEPS=02_tiled_fa1,03_loop_swap,04_deferred_rescale,05_split_q \
    FA_RANDOM_PROBLEMS=10 FA_SANITIZE_BUDGET=${FA_SANITIZE_BUDGET:-100} \
    bash common/scripts/sanitize.sh "$work/sanitize" > "$work/sanitize.txt" 2>&1
  san_rc=$?
  FA_BUILD_DIR=$build FA_SANITIZE_STEPS=01_naive FA_SANITIZE_TOOLS=memcheck FA_RANDOM_PROBLEMS=10 \
    FA_SANITIZE_BUDGET=40 bash common/scripts/sanitize.sh "$work/sanitize01" \
    > "$work/sanitize01.txt" 2>&1
  san01_rc=$?
  grep -E "^(memcheck|racecheck|synccheck|initcheck) " "$work/sanitize.txt" "$work/sanitize01.txt" |
    sed 's|^[^:]*:||' | tee -a "$log"
  # The first lines of the sanitizer's own log of every run that was not clean.
  for f in $(grep -ohE "logs: [^,]*, [^ ]*sanitizer.log" "$work/sanitize.txt" "$work/sanitize01.txt" |
             sed 's/.*, //'); do
    echo "--- $(basename "$f")" >> "$log"
    grep -E "^=========" "$f" | head -40 >> "$log"
  done
  say "sanitizers rc=$san_rc (02-05), $san01_rc (01)"
fi

# --- summary ------------------------------------------------------------------------------------
stamp "done"
{
  echo
  echo "=== recut summary ==="
  echo "conformance 01-06: rc=$tests_rc ($(grep -E '^\[  PASSED' "$work/tests.log" | head -1))"
  echo "bench sweep: rc=$bench_rc; $(grep -E '^misses' "$work/bench_summary.txt" 2>/dev/null)"
  grep -A2 "^every choice of variants" "$log" | grep -E "misses" | sed 's/^ */whatif: /'
  echo "variants: rc=$variants_rc"
  grep -E "largest bench|^06 / FLASH" "$log" | tail -2
  echo "compare.py rc=$compare_rc; sanitizers: rc=$san_rc (02-05), $san01_rc (01)"
  echo "full tables above in $log"
} | tee -a "$log"
cp "$work/bench.json" "$out/recut_bench.json" 2>/dev/null
cp "$work/variants_d128.json" "$out/recut_variants_d128.json" 2>/dev/null
cp "$work/variants_d64.json" "$out/recut_variants_d64.json" 2>/dev/null
cp "$work/riders.json" "$out/recut_riders.json" 2>/dev/null
cp "$work/compare.json" "$out/recut_compare.json" 2>/dev/null
rm -rf "$work"
