#!/usr/bin/env bash
# GPU proof for issue 14 (07_backward: phases a reader can follow, and ahead of FA2's backward).
# Assumes a tree built for the GPU in $FA_BUILD_DIR (default build-gpu, every step, sm_90).
# Writes $OUT/backward.log (plus the compare JSONs) and prints a summary table at the end.
# Expected time on one H200: about 4 minutes (correctness ~2 min, the sanitizers capped at
# 120 s, while the variant builds; then ~2 min of timing with the GPU to itself).
#
#   1. 07's GPU suite (conformance, edge cases incl. the bitwise-repeatable deterministic test,
#      random problems) on the large shapes and on the 99 KB shapes (FA_SMEM_LIMIT=101376),
#      and memcheck/racecheck/synccheck/initcheck (short: sanitize.sh, both families), side by
#      side with the build of one variant (FA_BWD_LONGEST_FIRST=0: the old causal order);
#   2. compare.py, 07 vs PyTorch FLASH backward, same tensors, one run: seqlen 1024..16384,
#      d 64/128, causal off/on (fp16, 16K tokens, hidden 2048);
#   3. the same for the variant build, causal only (the switch changes nothing else);
#   4. deterministic vs default, runner, same inputs per shape, back to back.
#   FA_BWD_NCU=1 adds a short Nsight Compute profile of one shape (07 and FLASH kernels).
. "$(dirname "$0")/setup.sh" backward
step=07_backward
t0=$(date +%s)
say "== backward.sh $(git rev-parse --short=12 HEAD 2>/dev/null) $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$log"
[ -x "$bin/fa_gpu_tests" ] || { say "no $bin/fa_gpu_tests: build the tree first"; exit 2; }

# --- 1. correctness, both tile families, and the variant build, side by side --------------
filter="*/${step}*:*.${step}*"
(FA_RANDOM_PROBLEMS=${FA_RANDOM_PROBLEMS:-100} "$bin/fa_gpu_tests" --gtest_filter="$filter" \
  > "$out/bwd_suite_large.log" 2>&1; echo "rc=$?" >> "$out/bwd_suite_large.log") &
p1=$!
(FA_SMEM_LIMIT=101376 FA_RANDOM_PROBLEMS=${FA_RANDOM_PROBLEMS:-100} "$bin/fa_gpu_tests" \
  --gtest_filter="$filter" > "$out/bwd_suite_99k.log" 2>&1; echo "rc=$?" >> "$out/bwd_suite_99k.log") &
p2=$!
(FA_BUILD_DIR=$build FA_SANITIZE_STEPS=$step FA_SANITIZE_BUDGET=${FA_SANITIZE_BUDGET:-120} \
  FA_SANITIZE_JOBS=4 bash common/scripts/sanitize.sh "$out/san_large" > "$out/san_large.txt" 2>&1) &
p3=$!
(FA_SMEM_LIMIT=101376 FA_BUILD_DIR=$build FA_SANITIZE_STEPS=$step \
  FA_SANITIZE_BUDGET=${FA_SANITIZE_BUDGET:-120} FA_SANITIZE_JOBS=4 \
  bash common/scripts/sanitize.sh "$out/san_99k" > "$out/san_99k.txt" 2>&1) &
p5=$!
variant=${TMPDIR:-/tmp}/fa-build-bwd-v0  # outside the tree: compare.py must not find it by default
(cmake -S . -B "$variant" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DFA_ONLY_STEPS=$step -DFA_BUILD_TESTS=OFF -DFA_BUILD_DOCS=OFF \
  -DCMAKE_CUDA_FLAGS="-DFA_BWD_LONGEST_FIRST=0" > "$out/variant_build.log" 2>&1 &&
  cmake --build "$variant" --target fa -j "$(nproc)" >> "$out/variant_build.log" 2>&1
 echo "rc=$?" >> "$out/variant_build.log") &
p4=$!
wait $p1 $p2 $p3 $p4 $p5
for f in bwd_suite_large bwd_suite_99k; do
  say "-- $f: $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]|tests? ran' "$out/$f.log" | tr '\n' ' ') $(tail -1 "$out/$f.log")"
  grep -E "^\[  FAILED  \]|Failure" -A4 "$out/$f.log" | head -40 >> "$log"
  grep -E "GPU:|random problems|smem" "$out/$f.log" | head -5 >> "$log"
done
for f in san_large san_99k; do say "-- $f:"; grep -E "^sanitize:" "$out/$f.txt" | tail -8 | tee -a "$log"; done
say "-- variant build (FA_BWD_LONGEST_FIRST=0): $(tail -1 "$out/variant_build.log")"
say "-- correctness phase: $(( $(date +%s) - t0 )) s"

# --- 2-3. 07 vs FLASH backward, same tensors, one run -------------------------------------
cmp="python3 common/python/compare.py --steps $step --backends flash --directions bwd \
  --seqlens 1024,2048,4096,8192,16384 --head-dims 64,128 --warmup 3 --repeats 10"
FA_LIB=$build/lib $cmp --causal 0,1 --out "$out/bwd_vs_flash.json" > "$out/bwd_vs_flash.txt" 2>&1
say "-- compare (default build): rc=$?"
FA_LIB=$variant/lib $cmp --causal 1 --out "$out/bwd_vs_flash_v0.json" > "$out/bwd_vs_flash_v0.txt" 2>&1
say "-- compare (FA_BWD_LONGEST_FIRST=0, causal): rc=$?"
cat "$out/bwd_vs_flash.txt" "$out/bwd_vs_flash_v0.txt" >> "$log"

# --- 4. deterministic vs default (runner: same inputs, both modes back to back) -----------
say "-- deterministic vs default (runner, median of 10, fp16, 16K tokens, hidden 2048)"
: > "$out/det.txt"
for d in 64 128; do
  for n in 1024 8192; do
    for causal in "" "--causal"; do
      for det in "" "--deterministic"; do
        line=$("$bin/$step" --backward --no-ceilings --batch $((16384 / n)) --heads $((2048 / d)) \
          --seqlen $n --head-dim $d $causal $det --warmup 3 --repeats 10 --no-check 2>&1 | tail -1)
        echo "d=$d N=$n ${causal:-full} ${det:-default} | $line" | tee -a "$out/det.txt" >> "$log"
      done
    done
  done
done

# --- optional: Nsight Compute, one shape ------------------------------------------------
if [ "${FA_BWD_NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
  ncu --clock-control none -k regex:'bwd_dk_dv|flash_bwd' -c 2 \
    --metrics gpu__time_duration.sum,sm__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    python3 common/python/compare.py --steps $step --backends flash --directions bwd \
    --seqlens 4096 --head-dims 128 --causal 1 --warmup 0 --repeats 1 --no-check \
    --out "$out/ncu_cmp.json" > "$out/ncu.txt" 2>&1
  tail -40 "$out/ncu.txt" >> "$log"
fi

# --- summary ------------------------------------------------------------------------------
python3 - "$out" <<'EOF' | tee -a "$log"
import json, os, re, sys
out = sys.argv[1]
def ratios(path):
    if not os.path.exists(path):
        return {}
    rows = json.load(open(path))["results"]
    t = {}
    for r in rows:
        if r.get("error") or r["direction"] != "bwd":
            continue
        t[(r["head_dim"], bool(r["causal"]), r["seqlen_q"], r["impl"])] = (r["tflops"], r.get("passed", True))
    res = {}
    for (d, c, n, impl), (tf, ok) in t.items():
        if impl == "07_backward" and (d, c, n, "sdpa_flash") in t:
            res[(d, c, n)] = (tf, t[(d, c, n, "sdpa_flash")][0], ok)
    return res
a = ratios(os.path.join(out, "bwd_vs_flash.json"))
v = ratios(os.path.join(out, "bwd_vs_flash_v0.json"))
print("\nSUMMARY 07 backward vs PyTorch FLASH (TFLOP/s, same tensors, one run; bar >= 1.05x)")
print("%-4s %-6s %6s | %7s %7s %6s %4s | %-22s" % ("d", "causal", "N", "07", "FLASH", "07/FL", "ok", "old causal order 07/FL"))
worst = None
for k in sorted(a):
    tf, fl, ok = a[k]
    r = tf / fl
    worst = r if worst is None else min(worst, r)
    old = "%.3f" % (v[k][0] / v[k][1]) if k in v else ""
    print("%-4d %-6s %6d | %7.1f %7.1f %6.3f %4s | %s" % (k[0], "yes" if k[1] else "no", k[2], tf, fl, r, "ok" if ok else "FAIL", old))
if worst is not None:
    print("worst 07/FLASH: %.3f (%s the 1.05x bar)" % (worst, "meets" if worst >= 1.05 else "misses"))
det = {}
for line in open(os.path.join(out, "det.txt")) if os.path.exists(os.path.join(out, "det.txt")) else []:
    m = re.match(r"d=(\d+) N=(\d+) (\S+) (\S+) \| (.*)", line)
    if not m:
        continue
    toks = m.group(5).split()  # the runner's row: ... ms spread% TFLOP/s ...
    pct = [i for i, t in enumerate(toks) if t.endswith("%") and i + 1 < len(toks)]
    tf = float(toks[pct[0] + 1]) if pct else None
    det[(m.group(1), m.group(2), m.group(3), m.group(4))] = (tf, m.group(5))
print("\nDeterministic vs default (runner; bar: det >= 0.85x default, bit-identical: suite test)")
for (d, n, c, mode) in sorted(det):
    if mode != "default":
        continue
    a_, b_ = det[(d, n, c, "default")][0], det.get((d, n, c, "--deterministic"), (None,))[0]
    ratio = "%.3f" % (b_ / a_) if a_ and b_ else "n/a (see log)"
    print("d=%-4s N=%-6s %-9s default %7s  deterministic %7s  det/default %s" % (d, n, c, a_, b_, ratio))
EOF
say "-- total: $(( $(date +%s) - t0 )) s"
