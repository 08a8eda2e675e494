#!/usr/bin/env bash
# GPU proof of issue 18 (step 08_split_kv, FlashDecoding). Assumes a tree built for the GPU in
# $FA_BUILD_DIR (default build-gpu: every step, fa_gpu_tests, bench, libfa) and PyTorch with
# CUDA for compare.py. Writes one plain log, $OUT/splitkv.log, and prints a summary table.
#
#   OUT=/tmp/out FA_BUILD_DIR=build-gpu bash common/scripts/gpu/splitkv.sh
#
# What it runs (expected wall time on an H200: about 4.5 minutes):
#   1. correctness, side by side (about 2.5-3 minutes, the sanitizers' budget sets it):
#      a. every GPU test of 08_split_kv: conformance matrix, edge cases, the random suite (its
#         seqlen_q 1..3 problems; stopped at 45 s), and the decode tests (matrix, 60 random
#         decode problems with seqlen_q 1..16 and seqlen_k up to 64K, two streams at once);
#      b. the decode tests for every other registered step (10 random problems each), 4 shards;
#      c. compute-sanitizer memcheck, racecheck, synccheck, initcheck on 08 (sanitize.sh's
#         per-step slice plus decode cases that split the keys), 150 s budget.
#   2. performance, alone on the GPU (about 1.5-2 minutes):
#      a. compare.py --decode: 08, 06 and PyTorch FLASH on the same tensors, fp16, seqlen_q 1,
#         heads 32 / heads_kv 8, d 128, batch 1/4/16/64, seqlen_k 1K..128K, with GB/s of K/V
#         against torch's measured copy ceiling; then seqlen_q 16 and heads_kv 32 on a few shapes;
#      b. compare.py at the paper's training shapes (16K tokens, hidden 2048, seqlen 2048 and
#         8192, d 64 and 128, causal off and on): 08 against 06 on the same tensors;
#      c. the bench's decode mode on one shape (the harness's own copy ceiling and GB/s).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
root=$PWD
build=${FA_BUILD_DIR:-build-gpu}
case $build in /*) ;; *) build=$root/$build ;; esac
out=${OUT:-$root/gpu-logs}
mkdir -p "$out"
log=$out/splitkv.log
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
: > "$log"
t_start=$SECONDS
say() { echo "$*" | tee -a "$log"; }
section() { printf '\n===== %s (t=%ds)\n' "$*" $((SECONDS - t_start)) >> "$log"; }
bin=$build/bin/fa_gpu_tests
[ -x "$bin" ] || { say "splitkv: $bin not found (build the tree first)"; exit 2; }
export FA_LIB=${FA_LIB:-$build/lib/libfa.so}
git -C "$root" rev-parse --short=12 HEAD >> "$log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader >> "$log" 2>&1

# ---- 1. correctness (a, b, c side by side) ----------------------------------------------
(
  FA_RANDOM_SECONDS=45 FA_DECODE_PROBLEMS=60 timeout 400 "$bin" \
    --gtest_filter='*/08_split_kv*:*.08_split_kv*' --gtest_brief=1 > "$tmp/t08.log" 2>&1
  echo $? > "$tmp/t08.rc"
) &
for i in 0 1 2 3; do
  (
    GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i FA_DECODE_PROBLEMS=10 timeout 400 "$bin" \
      --gtest_filter='Decode/*-*08_split_kv*' --gtest_brief=1 > "$tmp/tall$i.log" 2>&1
    echo $? > "$tmp/tall$i.rc"
  ) &
done
(
  decode="Decode/DecodeConformance.*/@STEP@_fp16_d128_causal_q1_gqa4:"
  decode+="Decode/DecodeConformance.*/@STEP@_bf16_d64_causal_q16_gqa8:"
  decode+="Decode/DecodeConformance.*/@STEP@_fp16_d64_causal_q13_short:"
  decode+="Decode/DecodeConformance.*/@STEP@_bf16_d128_causal_q16_gt_k_mqa:"
  decode+="Decode/DecodeConformance.*/@STEP@_fp16_d128_full_q7_mha:Decode/DecodeStreams.*/@STEP@:"
  slice=""
  for shape in odd_mqa q_lt_k_gqa q_gt_k; do slice+="Steps/ForwardConformance.*/@STEP@_fp16_*_${shape}:"; done
  slice+="Steps/EdgeCases.*/@STEP@:Steps/SafetyEdgeCases.*/@STEP@:Random/RandomConformance.*/@STEP@_fwd:"
  FA_BUILD_DIR=$build FA_SANITIZE_STEPS=08_split_kv FA_SANITIZE_BUDGET=150 FA_DECODE_PROBLEMS=2 \
    FA_DECODE_MAX_SEQLEN_K=8192 FA_SANITIZE_FILTER="${slice}${decode}-*LargestGrid*:*LongSequences*" \
    bash common/scripts/sanitize.sh "$tmp/sanitize" > "$tmp/sanitize.out" 2>&1
  echo $? > "$tmp/sanitize.rc"
) &
wait

section "1a. GPU tests of 08_split_kv (rc $(cat "$tmp/t08.rc"))"
grep -E "^\[  (PASSED|FAILED) |^\[ (random|decode) |Failure|FAILED  \]|expected|reproduce|out of bounds" \
  "$tmp/t08.log" | head -60 >> "$log"
tail -3 "$tmp/t08.log" >> "$log"
section "1b. decode tests, every other step"
for i in 0 1 2 3; do
  echo "shard $i rc $(cat "$tmp/tall$i.rc")" >> "$log"
  grep -E "^\[  (PASSED|FAILED) |^\[ decode |FAILED  \]|out of bounds" "$tmp/tall$i.log" | head -20 >> "$log"
done
section "1c. compute-sanitizer on 08 (rc $(cat "$tmp/sanitize.rc"))"
cat "$tmp/sanitize/summary.txt" >> "$log" 2>/dev/null || tail -20 "$tmp/sanitize.out" >> "$log"
for f in "$tmp"/sanitize/*_08_split_kv.sanitizer.log; do
  [ -f "$f" ] && grep -q "ERROR SUMMARY: [1-9]\|RACECHECK SUMMARY.*[1-9][0-9]* error" "$f" &&
    { echo "--- $f"; grep -m20 "=========" "$f"; } >> "$log"
done

# ---- 2. performance (nothing else on the GPU) --------------------------------------------
section "2a. compare.py --decode: 08 vs 06 vs PyTorch FLASH, seqlen_q 1, heads 32/8, d 128"
timeout 420 python3 common/python/compare.py --decode --steps 06_causal_skip,08_split_kv \
  --backends flash --seqlens-q 1 --heads-kv 8 --warmup 3 --repeats 15 \
  --out "$tmp/decode.json" > "$tmp/decode.out" 2> "$tmp/decode.err"
echo "rc $?" >> "$log"
cat "$tmp/decode.out" >> "$log"
grep -iE "error|abort" "$tmp/decode.err" | head -5 >> "$log"
section "2a'. compare.py --decode: seqlen_q 16 and heads_kv 32, a few shapes"
timeout 240 python3 common/python/compare.py --decode --steps 06_causal_skip,08_split_kv \
  --backends flash --seqlens-q 1,16 --heads-kv 8,32 --batches 1,16 --seqlens-k 4096,32768 \
  --warmup 2 --repeats 10 --out "$tmp/decode2.json" > "$tmp/decode2.out" 2> "$tmp/decode2.err"
echo "rc $?" >> "$log"
cat "$tmp/decode2.out" >> "$log"
section "2b. compare.py at training shapes: 08 vs 06 on the same tensors"
timeout 300 python3 common/python/compare.py --steps 06_causal_skip,08_split_kv --backends flash \
  --seqlens 2048,8192 --head-dims 64,128 --causal 0,1 --directions fwd --warmup 5 --repeats 20 \
  --out "$tmp/train.json" > "$tmp/train.out" 2> "$tmp/train.err"
echo "rc $?" >> "$log"
cat "$tmp/train.out" >> "$log"
section "2c. bench --decode (C++ harness: copy ceiling, GB/s columns)"
timeout 180 "$build/bin/bench" --decode --steps 06_causal_skip,08_split_kv --seqlens-q 1 \
  --heads-kv 8 --batches 4 --seqlens-k 32768 --repeats 10 >> "$log" 2> "$tmp/bench.err"
echo "rc $?" >> "$log"
cp "$tmp/decode.json" "$out/splitkv_decode.json" 2>/dev/null
cp "$tmp/train.json" "$out/splitkv_train.json" 2>/dev/null

# ---- summary ------------------------------------------------------------------------------
section "summary"
python3 - "$tmp/decode.json" "$tmp/train.json" "$tmp" <<'PY' | tee -a "$log"
import json, os, sys
dec, train, tmp = sys.argv[1:4]
def rc(name):
    try:
        return open(os.path.join(tmp, name)).read().strip()
    except OSError:
        return "?"
print("correctness: 08 tests rc %s; other steps' decode tests rc %s; sanitizers rc %s"
      % (rc("t08.rc"), ",".join(rc("tall%d.rc" % i) for i in range(4)), rc("sanitize.rc")))
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        print("cannot read %s: %s" % (path, e))
        return None
d = load(dec)
if d:
    copy = d.get("ceilings", {}).get("copy_gbps", 0)
    rows = {}
    for r in d["results"]:
        if r.get("error") or r["direction"] != "fwd":
            continue
        rows.setdefault((r["batch"], r["seqlen_k"]), {})[r["impl"]] = r
    print("decode, fp16, Nq 1, H 32/8, d 128; copy ceiling %.0f GB/s" % copy)
    print("%3s %7s %9s %9s %9s %8s %7s %7s %6s  %s" % ("B", "Nk", "08 us", "06 us", "FLASH us",
          "08/FLASH", "08/06", "08 GB/s", "%copy", "must-show"))
    bad = 0
    for (b, nk), g in sorted(rows.items()):
        s8, s6, fl = g.get("08_split_kv"), g.get("06_causal_skip"), g.get("sdpa_flash")
        if not (s8 and s6 and fl):
            print("%3d %7d  missing rows" % (b, nk)); bad += 1; continue
        vf, v6 = fl["median_ms"] / s8["median_ms"], s6["median_ms"] / s8["median_ms"]
        pc = s8.get("pct_copy", 0)
        fails = []
        if vf < 1.0: fails.append("<1.0x FLASH")
        if v6 < 0.97: fails.append("<0.97x 06")
        if b == 1 and nk >= 16384 and v6 < 2.5: fails.append("<2.5x 06")
        if nk >= 32768 and b >= 4 and pc < 80: fails.append("<80% copy")
        if not (s8.get("checked") and s8.get("passed")): fails.append("08 check FAILED")
        bad += bool(fails)
        print("%3d %7d %9.1f %9.1f %9.1f %7.2fx %6.2fx %7.0f %6.1f  %s" % (
            b, nk, 1e3 * s8["median_ms"], 1e3 * s6["median_ms"], 1e3 * fl["median_ms"], vf, v6,
            s8.get("gbps", 0), pc, ", ".join(fails) or "ok"))
    print("decode must-show: %d of %d shapes miss a bar" % (bad, len(rows)))
t = load(train)
if t:
    pairs = {}
    for r in t["results"]:
        if r.get("error"):
            continue
        pairs.setdefault((r["head_dim"], r["causal"], r["seqlen_q"]), {})[r["impl"]] = r
    print("training shapes, fwd, fp16: 08 / 06 speed (>= 0.97 wanted), TFLOP/s")
    worst = 9
    for k, g in sorted(pairs.items()):
        if "08_split_kv" in g and "06_causal_skip" in g:
            ratio = g["06_causal_skip"]["median_ms"] / g["08_split_kv"]["median_ms"]
            worst = min(worst, ratio)
            print("  d=%d %s N=%d: 06 %.1f, 08 %.1f, 08/06 %.3f" % (
                k[0], "causal" if k[1] else "full", k[2], g["06_causal_skip"]["tflops"],
                g["08_split_kv"]["tflops"], ratio))
    print("training shapes: worst 08/06 %.3f (%s)" % (worst, "ok" if worst >= 0.97 else "MISS"))
PY
say "splitkv: done in $((SECONDS - t_start)) s; log $log"
