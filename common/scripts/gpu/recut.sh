#!/usr/bin/env bash
# GPU proof for issue #13 (the re-cut of steps 01-06: one idea per diff). Assumes an already
# built tree in $FA_BUILD_DIR (default build-gpu, every step, sm_90); writes $OUT/recut.log
# (plus the raw JSON: recut_bench.json, recut_variants.json, recut_compare.json, and the riders'
# Markdown table for 05_split_q/README.md: recut_riders.md) and prints a summary at the end. What it runs, in this order (the GPU-light build of the rider
# variants runs in the background meanwhile):
#   1. the GPU conformance suite of steps 01-06 (fa_gpu_tests; random problems: 8 per step and
#      direction, at most 10 s each);
#   2. the bench sweep of 01-06, forward (16K tokens, hidden 2048, seqlen 512..16384, d 64/128,
#      causal off/on) and the table of each step's gain over the one before, with the issue's
#      checks: 02 >= 01, each of 03..06 >= 0.97x the step before;
#   3. the riders of 05 both ways (FA_FWD_BLOCK_M=64, FA_RESCALE_SKIP=0, both) and 02 with
#      B_c = 128 at d = 128, built as extra registered steps in build-recut-variants (FA_LAB_DIRS)
#      and benched side by side with the default 05 and 02 in one process;
#   4. compare.py: 01-06 and PyTorch's FLASH on the same tensors at N = 2048 and 8192, and the
#      agreement of bench and compare.py per step and shape (issue: within 5%);
#   5. compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on 02-05, memcheck on 01
#      (common/scripts/sanitize.sh, FA_RANDOM_PROBLEMS=2, budgets 100 s + 40 s; RECUT_SANITIZE=0
#      skips this part).
# Expected device time on an H200: about 6 minutes (tests ~1, bench ~2, variants ~0.5,
# compare.py ~0.5, sanitizers <= 2.3).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
root=$PWD
build=${FA_BUILD_DIR:-build-gpu}
case $build in /*) ;; *) build=$root/$build ;; esac
out=${OUT:-$root/gpu-logs}
mkdir -p "$out"
log=$out/recut.log
: > "$log"
work=$(mktemp -d /tmp/recut.XXXXXX)
steps=01_naive,02_tiled_fa1,03_loop_swap,04_deferred_rescale,05_split_q,06_causal_skip
say() { echo "$*" | tee -a "$log"; }
t_start=$SECONDS
stamp() { say "[$((SECONDS - t_start)) s] $*"; }

[ -x "$build/bin/bench" ] && [ -x "$build/bin/fa_gpu_tests" ] ||
  { say "recut: no built tree in $build (bin/bench, bin/fa_gpu_tests)"; exit 2; }
say "recut: commit $(git rev-parse --short HEAD 2>/dev/null), build $build"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 |
  head -1 | tee -a "$log"

# --- 0. the rider variants: a small second build in the background (CPU only) ---------------
vbuild=$root/build-recut-variants
vsrc=$work/variants
mkdir -p "$vsrc"
variant() {  # name source_step definitions...
  local name=$1 src=$2
  shift 2
  mkdir -p "$vsrc/$name"
  cp "$root/$src/kernel.cu" "$vsrc/$name/kernel.cu"
  {
    echo "fa_add_step($name)"
    echo "target_compile_definitions(fa_step_$name PRIVATE $*)"
  } > "$vsrc/$name/CMakeLists.txt"
  echo -n "$vsrc/$name;"
}
labs=""
labs+=$(variant 05_split_q_bm64 05_split_q FA_FWD_BLOCK_M=64)
labs+=$(variant 05_split_q_noskip 05_split_q FA_RESCALE_SKIP=0)
labs+=$(variant 05_split_q_bm64_noskip 05_split_q FA_FWD_BLOCK_M=64 FA_RESCALE_SKIP=0)
labs+=$(variant 02_tiled_fa1_bn128 02_tiled_fa1 FA_FWD_BLOCK_N_D128=128)
(
  cmake -S "$root" -B "$vbuild" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF \
    -DFA_BUILD_TESTS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFA_ONLY_STEPS="02_tiled_fa1;05_split_q" -DFA_LAB_DIRS="${labs%;}" &&
    nice -n 10 cmake --build "$vbuild" -j 8 --target bench
) > "$work/variants_build.log" 2>&1 &
vpid=$!

# --- 1. conformance ---------------------------------------------------------------------------
filter=""
for s in ${steps//,/ }; do filter+="*/$s*:*.$s*:"; done
stamp "1. GPU conformance suite of $steps"
FA_RANDOM_PROBLEMS=${FA_RANDOM_PROBLEMS:-8} FA_RANDOM_SECONDS=${FA_RANDOM_SECONDS:-10} \
  "$build/bin/fa_gpu_tests" --gtest_filter="$filter" \
  --gtest_brief=1 > "$work/tests.log" 2>&1
tests_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |seed" "$work/tests.log" | head -8 | tee -a "$log"
grep -B2 -A10 "Failure" "$work/tests.log" | head -60 >> "$log"
say "conformance rc=$tests_rc"

# --- 2. the bench sweep -----------------------------------------------------------------------
stamp "2. bench sweep, forward, steps 01-06"
"$build/bin/bench" --steps "$steps" --direction fwd --warmup 2 --repeats 5 \
  --out "$work/bench.json" > "$work/bench.txt" 2> "$work/bench_progress.log"
bench_rc=$?
say "bench rc=$bench_rc"
python3 - "$work/bench.json" "$steps" > "$work/bench_summary.txt" 2>&1 << 'EOF'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r["direction"] == "fwd"]
steps = sys.argv[2].split(",")
shapes = sorted({(r["head_dim"], r["causal"], r["seqlen_q"]) for r in rows})
tf = {(r["step"], r["head_dim"], r["causal"], r["seqlen_q"]): r for r in rows}
print("TFLOP/s (gain over the step before); '!' marks a miss of the issue's bound")
print("d   causal N      " + " ".join("%-15s" % s[:15] for s in steps))
misses = []
for d, c, n in shapes:
    cells = []
    for i, s in enumerate(steps):
        r = tf.get((s, d, c, n))
        if r is None or r.get("error") or not r.get("passed", False):
            cells.append("%-15s" % ("FAIL" if r else "-"))
            misses.append("%s d=%d c=%d N=%d: %s" % (s, d, c, n, r.get("error") if r else "missing"))
            continue
        if i == 0:
            cells.append("%-15s" % ("%.1f" % r["tflops"]))
            continue
        p = tf.get((steps[i - 1], d, c, n))
        g = r["tflops"] / p["tflops"] if p and p["tflops"] > 0 else 0
        bound = 1.0 if i == 1 else 0.97
        mark = "!" if g < bound else ""
        if mark:
            misses.append("%s / %s = %.2f at d=%d causal=%d N=%d (bound %.2f)"
                          % (s, steps[i - 1], g, d, c, n, bound))
        cells.append("%-15s" % ("%.1f (%.2fx)%s" % (r["tflops"], g, mark)))
    print("%-3d %-6d %-6d " % (d, c, n) + " ".join(cells))
print("misses: %d" % len(misses))
for m in misses:
    print("  " + m)
EOF
cat "$work/bench_summary.txt" >> "$log"

# --- 3. the riders of 05 and 02's d = 128 tile --------------------------------------------------
stamp "3. rider variants (waiting for their build)"
wait $vpid
vrc=$?
if [ $vrc -ne 0 ]; then
  say "variant build failed (rc=$vrc):"
  grep -E "error|Error" "$work/variants_build.log" | head -20 | tee -a "$log"
else
  grep -E "spill" "$work/variants_build.log" | sed -E 's/.*function .([^ ]*). (.*)/\1 \2/' |
    sort -u | head -12 >> "$log"
  "$vbuild/bin/bench" --steps 05_split_q,05_split_q_bm64,05_split_q_noskip,05_split_q_bm64_noskip,02_tiled_fa1,02_tiled_fa1_bn128 \
    --direction fwd --seqlens 1024,4096,16384 --warmup 2 --repeats 5 \
    --out "$work/variants.json" > "$work/variants.txt" 2> "$work/variants_progress.log"
  say "variant bench rc=$?"
  python3 - "$work/variants.json" "$out/recut_riders.md" >> "$log" 2>&1 << 'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
rows = [r for r in doc["results"] if r["direction"] == "fwd"]
tf = {(r["step"], r["head_dim"], r["causal"], r["seqlen_q"]):
      (r["tflops"] if r.get("passed") and not r.get("error") else 0.0) for r in rows}
shapes = sorted({(r["head_dim"], r["causal"], r["seqlen_q"]) for r in rows})
groups = [("05_split_q", ["05_split_q_bm64", "05_split_q_noskip", "05_split_q_bm64_noskip"]),
          ("02_tiled_fa1", ["02_tiled_fa1_bn128"])]
for base, others in groups:
    print("%s (both riders on) vs the variants: TFLOP/s, and the variant / default ratio" % base)
    print("d   causal N      %-10s " % "default" + " ".join("%-26s" % o for o in others))
    for d, c, n in shapes:
        b = tf.get((base, d, c, n), 0.0)
        cells = ["%-26s" % ("%.1f (%.2fx)" % (tf.get((o, d, c, n), 0.0),
                                              tf.get((o, d, c, n), 0.0) / b if b else 0))
                 for o in others]
        print("%-3d %-6d %-6d %-10.1f " % (d, c, n, b) + " ".join(cells))
# The same as a Markdown block for 05_split_q/README.md (between its riders markers).
gpu, run = doc.get("gpu", {}), doc.get("run", {})
md = ["Measured on **%s** (%s SMs), commit `%s`, %s, with `%s`: TFLOP/s, fp16, 16K tokens, "
      "hidden 2048, forward; in brackets the ratio to the default build (both riders on). Each "
      "variant is this kernel.cu built with the switch set, registered as an extra step "
      "(`common/scripts/gpu/recut.sh`)." % (gpu.get("name", "?"), gpu.get("sm_count", "?"),
                                            run.get("commit", "?"), run.get("date", "?"),
                                            run.get("command", "?")),
      "", "| d | causal | seqlen | default | `FA_FWD_BLOCK_M=64` | `FA_RESCALE_SKIP=0` | both off |",
      "|---|---|---|---|---|---|---|"]
for d, c, n in shapes:
    b = tf.get(("05_split_q", d, c, n), 0.0)
    cell = lambda o: "%.1f (%.2fx)" % (tf.get((o, d, c, n), 0.0), tf.get((o, d, c, n), 0.0) / b if b else 0)
    md.append("| %d | %s | %d | %.1f | %s | %s | %s |" % (d, "yes" if c else "no", n, b,
              cell("05_split_q_bm64"), cell("05_split_q_noskip"), cell("05_split_q_bm64_noskip")))
open(sys.argv[2], "w").write("\n".join(md) + "\n")
EOF
fi

# --- 4. compare.py: FLASH beside the steps, and bench vs compare.py ---------------------------
stamp "4. compare.py (01-06 + FLASH, N = 2048, 8192)"
FA_LIB=$build/lib/libfa.so python3 common/python/compare.py --steps "$steps" --backends flash \
  --seqlens 2048,8192 --head-dims 64,128 --causal 0,1 --directions fwd --warmup 3 --repeats 10 \
  --out "$work/compare.json" --log-dir "$work/compare_logs" > "$work/compare.txt" 2>&1
say "compare.py rc=$?"
python3 - "$work/compare.json" "$work/bench.json" >> "$log" 2>&1 << 'EOF'
import json, sys
cmp_rows = json.load(open(sys.argv[1]))["results"]
bench = {(r["step"], r["head_dim"], r["causal"], r["seqlen_q"]): r
         for r in json.load(open(sys.argv[2]))["results"] if r["direction"] == "fwd"}
flash = {(r["head_dim"], r["causal"], r["seqlen_q"]): r["tflops"] for r in cmp_rows
         if r["impl"] == "sdpa_flash" and r["direction"] == "fwd"}
print("bench vs compare.py, same step and shape (issue: within 5%); 06 / FLASH (>= 1.05, causal >= 1.1)")
print("step                 d   causal N      bench ms  compare ms  ratio   vs FLASH")
worst = 0.0
for r in cmp_rows:
    if r["kind"] != "step" or r["direction"] != "fwd":
        continue
    key = (r["impl"], r["head_dim"], r["causal"], r["seqlen_q"])
    b = bench.get(key)
    if not b or not r.get("median_ms"):
        continue
    ratio = b["median_ms"] / r["median_ms"]
    worst = max(worst, abs(ratio - 1))
    f = flash.get(key[1:])
    vs = "%.2fx" % (r["tflops"] / f) if f else "-"
    mark = " !" if abs(ratio - 1) > 0.05 else ""
    print("%-20s %-3d %-6d %-6d %-9.3f %-11.3f %-7.3f %s%s" % (key[0], key[1], key[2], key[3],
          b["median_ms"], r["median_ms"], ratio, vs, mark))
print("largest bench/compare.py disagreement: %.1f%%" % (100 * worst))
EOF

# --- 5. sanitizers ------------------------------------------------------------------------------
san_rc=skipped
san01_rc=skipped
if [ "${RECUT_SANITIZE:-1}" != 0 ]; then
  stamp "5. compute-sanitizer on 02-05 (4 tools) and 01 (memcheck)"
  FA_BUILD_DIR=$build FA_SANITIZE_STEPS=02_tiled_fa1,03_loop_swap,04_deferred_rescale,05_split_q \
    FA_RANDOM_PROBLEMS=2 FA_SANITIZE_BUDGET=${FA_SANITIZE_BUDGET:-100} \
    bash common/scripts/sanitize.sh "$work/sanitize" > "$work/sanitize.txt" 2>&1
  san_rc=$?
  FA_BUILD_DIR=$build FA_SANITIZE_STEPS=01_naive FA_SANITIZE_TOOLS=memcheck FA_RANDOM_PROBLEMS=2 \
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
  grep -E "^misses" "$work/bench_summary.txt" | sed 's/^/bench must-show: /'
  grep -E "largest bench" "$log" | tail -1
  echo "sanitizers: rc=$san_rc (02-05), $san01_rc (01)"
  echo "full tables above in $log"
} | tee -a "$log"
cp "$work/bench.json" "$out/recut_bench.json" 2>/dev/null
cp "$work/variants.json" "$out/recut_variants.json" 2>/dev/null
cp "$work/compare.json" "$out/recut_compare.json" 2>/dev/null
rm -rf "$work"
