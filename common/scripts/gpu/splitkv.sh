#!/usr/bin/env bash
# GPU proof of issue 18 (step 08_split_kv, FlashDecoding). Assumes a tree built for the GPU in
# $FA_BUILD_DIR (default build-gpu: every step, fa_gpu_tests, bench, libfa) and PyTorch with
# CUDA. Writes one plain log, $OUT/splitkv.log, the JSON of the measurements beside it, and
# prints a summary last.
#
#   OUT=/tmp/out FA_BUILD_DIR=build-gpu bash common/scripts/gpu/splitkv.sh
#   (the coordinator: FA_GPU_AREAS=splitkv bash common/scripts/gpu/all.sh)
#
# Knobs: FA_SPLITKV_SANITIZE=0 skips the sanitizers; FA_SPLITKV_SANITIZE_BUDGET (default 90 s);
# FA_SPLITKV_QUICK=1 runs compare.py on a few shapes only (a smoke run); FA_SPLITKV_TUNE=1 adds
# splitkv_tune.py (08, 06 and FLASH interleaved on the same tensors, the kernels of a call,
# and the training shapes 08 against 06 and 06 against itself: about 40 s more).
#
# What it runs (expected wall time on an H200: about 1.5 minutes):
#   1. correctness, side by side (about 1 minute, the sanitizers' budget sets it):
#      a. every GPU test of 08_split_kv: conformance matrix, edge cases, the random suite
#         (stopped at 30 s), the decode tests (matrix, 60 random decode problems with seqlen_q
#         1..16 and seqlen_k up to 64K, two streams at once);
#      b. the same suite with every problem's keys forced into 3 chunks (FA_NUM_SPLITS=3,
#         ctest gpu.conformance.08_split_kv.num_splits_3): the split path and the merge on
#         every conformance shape; then FA_NUM_SPLITS=0 must be refused;
#      c. compute-sanitizer memcheck, racecheck, synccheck, initcheck on 08: sanitize.sh's
#         per-step slice (its 10 random problems, the fewest the random suite accepts: one per
#         coverage class) plus five decode cases, four of which split the keys (2 to 129
#         splits: the merge's loops over more than 32 splits included). The names of failing
#         tests and the first lines of their failures are copied into the log.
#   2. measurements, alone on the GPU (about 10 s; FA_SPLITKV_TUNE=1 first adds splitkv_tune.py):
#      compare.py --decode (the command README.md cites): 08, 06, FLASH, fp16, seqlen_q 1,
#      heads 32/8, d 128, batch 1-64, seqlen_k 1K-128K, each call on K/V copies that do not
#      fit in L2 together; the summary checks the issue's bars on it.
. "$(dirname "$0")/setup.sh" splitkv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -f "$out/splitkv_tune.json" "$out/splitkv_decode.json"  # no stale figures in the summary
t_start=$SECONDS
section() { printf '\n===== %s (t=%ds)\n' "$*" $((SECONDS - t_start)) >> "$log"; }
bin=$build/bin/fa_gpu_tests
[ -x "$bin" ] || { say "splitkv: $bin not found (build the tree first)"; exit 2; }
export FA_LIB=${FA_LIB:-$build/lib/libfa.so}
quick=${FA_SPLITKV_QUICK:-0}
git -C "$root" rev-parse --short=12 HEAD >> "$log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv,noheader >> "$log" 2>&1

# ---- 1. correctness (a-c side by side) ---------------------------------------------------
f08='*/08_split_kv*:*.08_split_kv*'
(
  FA_RANDOM_SECONDS=30 FA_DECODE_PROBLEMS=60 timeout 300 "$bin" --gtest_filter="$f08" \
    --gtest_brief=1 > "$tmp/t08.log" 2>&1
  echo $? > "$tmp/t08.rc"
) &
(
  FA_NUM_SPLITS=3 FA_RANDOM_SECONDS=15 FA_DECODE_PROBLEMS=20 timeout 300 "$bin" \
    --gtest_filter="$f08" --gtest_brief=1 > "$tmp/split3.log" 2>&1
  echo $? > "$tmp/split3.rc"
  FA_NUM_SPLITS=0 timeout 60 "$build/bin/08_split_kv" --seqlen-q 1 --seqlen-k 4096 --no-ceilings \
    --warmup 0 --repeats 1 > "$tmp/split0.log" 2>&1
  grep -q "FA_NUM_SPLITS=0: expected a whole number" "$tmp/split0.log"
  echo $? > "$tmp/split0.rc"
) &
if [ "${FA_SPLITKV_SANITIZE:-1}" != 0 ]; then
  (
    decode="Decode/DecodeConformance.*/@STEP@_fp16_d128_causal_q1_gqa4:"
    decode+="Decode/DecodeConformance.*/@STEP@_bf16_d64_causal_q16_gqa8:"
    decode+="Decode/DecodeConformance.*/@STEP@_fp16_d64_causal_q13_short:"
    decode+="Decode/DecodeConformance.*/@STEP@_bf16_d128_causal_q16_gt_k_mqa:"
    decode+="Decode/DecodeConformance.*/@STEP@_fp16_d128_full_q7_mha:"
    slice=""
    for shape in odd_mqa q_lt_k_gqa q_gt_k; do slice+="Steps/ForwardConformance.*/@STEP@_fp16_*_${shape}:"; done
    slice+="Steps/EdgeCases.*/@STEP@:Random/RandomConformance.*/@STEP@_fwd:"
    FA_BUILD_DIR=$build FA_SANITIZE_STEPS=08_split_kv FA_SANITIZE_BUDGET=${FA_SPLITKV_SANITIZE_BUDGET:-90} \
      FA_DECODE_PROBLEMS=2 FA_DECODE_MAX_SEQLEN_K=8192 \
      FA_SANITIZE_FILTER="${slice}${decode}-*LargestGrid*:*LongSequences*" \
      bash common/scripts/sanitize.sh "$tmp/sanitize" > "$tmp/sanitize.out" 2>&1
    echo $? > "$tmp/sanitize.rc"
  ) &
else
  echo skipped > "$tmp/sanitize.rc"
fi
wait

section "1a. GPU tests of 08_split_kv (rc $(cat "$tmp/t08.rc"))"
grep -E "^\[  (PASSED|FAILED) |^\[ (random|decode) |Failure|FAILED  \]|expected|reproduce|out of bounds" \
  "$tmp/t08.log" | head -60 >> "$log"
tail -3 "$tmp/t08.log" >> "$log"
section "1b. the same with FA_NUM_SPLITS=3 (rc $(cat "$tmp/split3.rc")); FA_NUM_SPLITS=0 refused (rc $(cat "$tmp/split0.rc"))"
grep -E "^\[  (PASSED|FAILED) |^\[ (random|decode) |Failure|FAILED  \]|expected|reproduce" \
  "$tmp/split3.log" | head -40 >> "$log"
head -3 "$tmp/split0.log" >> "$log"
section "1c. compute-sanitizer on 08 (rc $(cat "$tmp/sanitize.rc"))"
cat "$tmp/sanitize/summary.txt" >> "$log" 2>/dev/null || tail -20 "$tmp/sanitize.out" >> "$log" 2>/dev/null
for f in "$tmp"/sanitize/*_08_split_kv*.log; do  # the tests' own output: which test failed, how
  case $f in *.sanitizer.log) continue ;; esac
  [ -f "$f" ] && grep -q "^\[  FAILED  \]" "$f" &&
    { echo "--- $(basename "$f")"; grep -E -A4 "Failure$" "$f" | head -20
      grep "^\[  FAILED  \]" "$f" | cut -c1-160 | head -10; } >> "$log"
done
for f in "$tmp"/sanitize/*_08_split_kv.sanitizer.log; do
  [ -f "$f" ] && grep -q "ERROR SUMMARY: [1-9]\|RACECHECK SUMMARY.*[1-9][0-9]* error" "$f" &&
    { echo "--- $f"; grep -m20 "=========" "$f"; } >> "$log"
done

# ---- 2. measurements (nothing else on the GPU) --------------------------------------------
if [ "${FA_SPLITKV_TUNE:-0}" = 1 ]; then
  section "2a. splitkv_tune.py: 08, 06, FLASH interleaved, kernel breakdown, training shapes"
  qflag=""
  [ "$quick" = 1 ] && qflag=--quick
  timeout 170 python3 common/scripts/gpu/splitkv_tune.py $qflag --out "$out/splitkv_tune.json" \
    > "$tmp/tune.out" 2> "$tmp/tune.err"
  echo "rc $?" >> "$log"
  cat "$tmp/tune.out" >> "$log"
  grep -iE "error|Traceback|abort" "$tmp/tune.err" | head -10 >> "$log"
fi
section "2b. compare.py --decode (README's command): 08, 06, FLASH; seqlen_q 1, heads 32/8, d 128"
dec_args=(--seqlens-q 1 --heads-kv 8)
[ "$quick" = 1 ] && dec_args+=(--batches "1,16" --seqlens-k "4096,32768")
timeout 120 python3 common/python/compare.py --decode --steps 06_causal_skip,08_split_kv \
  --backends flash "${dec_args[@]}" --warmup 2 --repeats 8 \
  --out "$out/splitkv_decode.json" > "$tmp/decode.out" 2> "$tmp/decode.err"
echo "rc $?" >> "$log"
cat "$tmp/decode.out" >> "$log"
grep -iE "error|abort|ceiling" "$tmp/decode.err" | head -5 >> "$log"

# ---- summary ------------------------------------------------------------------------------
section "summary"
python3 - "$out/splitkv_decode.json" "$out/splitkv_tune.json" "$tmp" <<'PY' | tee -a "$log"
import json, os, sys
dec, tune, tmp = sys.argv[1:4]
def rc(name):
    try:
        return open(os.path.join(tmp, name)).read().strip()
    except OSError:
        return "?"
print("correctness: 08 suite %s; FA_NUM_SPLITS=3 suite %s; FA_NUM_SPLITS=0 refused %s; "
      "sanitizers %s" % (rc("t08.rc"), rc("split3.rc"), rc("split0.rc"), rc("sanitize.rc")))
def load(path):
    if not os.path.exists(path):
        return None
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        print("cannot read %s: %s" % (os.path.basename(path), e))
        return None
t = load(tune)
if t:
    s = t.get("sections", {})
    c = s.get("ceilings", {})
    print("ceilings: copy %.0f GB/s, read-only %.0f GB/s" % (c.get("copy_gbps", 0),
                                                          c.get("read_gbps", 0)))
    print("splitkv_tune (interleaved, same tensors), must-show grid Nq 1, H 32/8, d 128:")
    print("%-22s %6s %8s %8s %8s %8s %8s" % ("08 entry", "<FLASH", "min xFL", "gm xFL",
                                             "min x06", "b1 x06", "min %cp"))
    for m in s.get("must_show", []):
        if m["worst_x_flash"] > 1e9:
            print("%-22s  nothing measured" % m["impl"]); continue
        print("%-22s %6d %8.3f %8.3f %8.2f %8.2f %8.1f" % (
            m["impl"], len(m["below_flash"]), m["worst_x_flash"], m["geomean_x_flash_16k"],
            m["worst_x_06"], m["b1_worst_x_06"], m["min_pct_copy"]))
    tr = {}
    for r in s.get("train", []):
        if "median_ms" in r:
            tr.setdefault((r["head_dim"], r["causal"], r["seqlen_q"]), {})[r["impl"]] = r
    ratios = [g["06"]["median_ms"] / g["08"]["median_ms"] for g in tr.values()
              if "06" in g and "08" in g]
    noise = [abs(1 - g["06 again"]["median_ms"] / g["06"]["median_ms"]) for g in tr.values()
             if "06" in g and "06 again" in g]
    if ratios:
        print("training shapes (%d): 08/06 worst %.3f, best %.3f; 06 against itself: up to "
              "%.3f apart" % (len(ratios), min(ratios), max(ratios), max(noise or [0])))
d = load(dec)
if d:
    rows = {}
    for r in d["results"]:
        if not r.get("error"):
            rows.setdefault((r["batch"], r["seqlen_k"]), {})[r["impl"]] = r
    bad = []
    for (b, nk), g in sorted(rows.items()):
        s8, s6, fl = g.get("08_split_kv"), g.get("06_causal_skip"), g.get("sdpa_flash")
        if not (s8 and s6 and fl):
            bad.append("%d/%d missing" % (b, nk)); continue
        vf, v6 = fl["median_ms"] / s8["median_ms"], s6["median_ms"] / s8["median_ms"]
        if vf < 1.0: bad.append("%d/%dK %.3fx FLASH" % (b, nk // 1024, vf))
        if v6 < 0.97: bad.append("%d/%dK %.2fx 06" % (b, nk // 1024, v6))
        if b == 1 and nk >= 16384 and v6 < 2.5: bad.append("%d/%dK <2.5x 06" % (b, nk // 1024))
        if nk >= 32768 and b >= 4 and s8.get("pct_copy", 0) < 80: bad.append("%d/%dK <80%%" % (b, nk // 1024))
        if not (s8.get("checked") and s8.get("passed")): bad.append("%d/%dK check" % (b, nk // 1024))
    print("compare.py --decode (08 as built, copy %.0f GB/s): %d shapes, %d misses: %s"
          % (d.get("ceilings", {}).get("copy_gbps", 0), len(rows), len(bad), "; ".join(bad[:8])))
PY
say "splitkv: done in $((SECONDS - t_start)) s; log $log"
