#!/usr/bin/env bash
# Variants of a step, as extra step folders (FA_LAB_DIRS), proven and timed beside it in one
# call (a NOTES.md entry's "Measured"):
#   1. one tree (sm_90) with the steps of FA_VARIANT_BESIDE and the variant folders;
#   2. side by side: every variant's GPU suite on the large shapes, under every FA_SMEM_LIMIT its
#      CMakeLists names, and again under each FA_VARIANT_ENV setting; compute-sanitizer's four
#      tools on the variants (sanitize.sh, within FA_SANITIZE_BUDGET seconds);
#   3. compare.py: the variants beside FA_VARIANT_BESIDE and PyTorch FLASH on the same tensors,
#      in two rounds (--rounds 2), fp16, 16K tokens, hidden 2048, N = 1024..16384, d 64/128,
#      causal off/on; FA_VARIANT_DET=1 adds the deterministic backward of the same steps.
#   FA_VARIANTS="labs/x07_m128 labs/x07_tail"   the folders (relative to the repository)
#   FA_VARIANT_BESIDE=07_backward                the steps they are compared with (commas)
#   FA_VARIANT_DIRECTIONS=bwd                    compare.py --directions
#   FA_VARIANT_ENV="x07_tail:FA_BWD_TAIL_SPLIT=4"   extra suite and sanitizer runs of a variant
#   FA_VARIANT_LIMIT=570                         seconds for the whole script (compare.py is cut
#                                                to fit, its partial JSON kept)
# Logs and JSON under $OUT; the summary (suite and sanitizer lines, compare.py's table) last.
. "$(dirname "$0")/setup.sh" variants
build=${FA_BUILD_DIR:-$root/build-variants}
t0=$SECONDS
dirs="" names=""
for d in ${FA_VARIANTS:?name the variant folders}; do
  [ -f "$root/$d/kernel.cu" ] || { say "no $d/kernel.cu"; exit 2; }
  dirs+="$root/$d;" names+="$(basename "$d") "
done
beside=${FA_VARIANT_BESIDE:-07_backward}
say "== variants.sh: ${names}beside $beside, commit ${FA_GIT_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null)}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-Xptxas=-v -DFA_ONLY_STEPS="${beside//,/;}" \
  -DFA_LAB_DIRS="${dirs%;}" > "$out/variants_build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target fa fa_gpu_tests >> "$out/variants_build.log" 2>&1 ||
  { grep -E "error" "$out/variants_build.log" | head -20; say "build failed"; exit 2; }
say "-- ptxas lines with spills: $(grep -cE '[1-9][0-9]* bytes spill' "$out/variants_build.log")"
say "-- built in $((SECONDS - t0)) s"

suite() {  # name, then VAR=value settings: the variant's GPU suite under them
  local n=$1 tag=$1
  shift
  for kv in "$@"; do tag+="_${kv//[^A-Za-z0-9]/}"; done
  env "$@" FA_RANDOM_PROBLEMS=${FA_RANDOM_PROBLEMS:-40} "$build/bin/fa_gpu_tests" \
    --gtest_filter="*/${n}*:*.${n}*" --gtest_brief=1 > "$out/suite_$tag.log" 2>&1
  echo "suite $tag: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/suite_$tag.log" | tr '\n' ' ')"
}
san_steps=""
for n in $names; do
  (suite "$n"; suite "$n" FA_SMEM_LIMIT=101376) > "$out/suite_$n.txt" &
  san_steps+="$n,$n@101376,"
  for e in ${FA_VARIANT_ENV:-}; do
    [ "${e%%:*}" = "$n" ] || continue
    (suite "$n" "${e#*:}"; suite "$n" "${e#*:}" FA_SMEM_LIMIT=101376) > "$out/suite_${n}_env.txt" &
  done
done
(FA_BUILD_DIR=$build FA_SANITIZE_STEPS=${san_steps%,} FA_SANITIZE_BUDGET=${FA_SANITIZE_BUDGET:-200} \
  FA_SANITIZE_JOBS=8 FA_SANITIZE_SHARDS=${FA_SANITIZE_SHARDS:-"*:racecheck=4"} \
  bash common/scripts/sanitize.sh "$out/sanitize" > "$out/sanitize.txt" 2>&1) &
wait
cat "$out"/suite_*.txt | tee -a "$log"
grep -hE "^\[  FAILED  \]|Failure" -A3 "$out"/suite_*.log | head -30 | tee -a "$log"
grep -E "^sanitize:" "$out/sanitize.txt" | tail -12 | tee -a "$log"
say "-- proven in $((SECONDS - t0)) s"

steps="$beside,$(echo $names | tr ' ' ',')"
cmp="python3 common/python/compare.py --steps $steps --backends flash \
  --directions ${FA_VARIANT_DIRECTIONS:-bwd} --seqlens 1024,2048,4096,8192,16384 --warmup 3 \
  --repeats 10 --rounds 2"
left=$(( ${FA_VARIANT_LIMIT:-570} - (SECONDS - t0) - 15 ))  # the summary still prints
FA_LIB=$build/lib timeout $((left > 30 ? left : 30)) $cmp --out "$out/variants_compare.json" \
  > "$out/variants_compare.txt" 2>&1
say "-- compare.py: rc=$? ($((SECONDS - t0)) s)"
if [ "${FA_VARIANT_DET:-0}" = 1 ]; then
  FA_LIB=$build/lib $cmp --deterministic --out "$out/variants_compare_det.json" \
    > "$out/variants_compare_det.txt" 2>&1
  say "-- compare.py --deterministic: rc=$? ($((SECONDS - t0)) s)"
fi
python3 - "$out" "$steps" <<'EOF' | tee -a "$log"
import json, os, sys
out, steps = sys.argv[1], sys.argv[2].split(",")
for name in ("variants_compare.json", "variants_compare_det.json"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        continue
    rows = [r for r in json.load(open(path))["results"] if not r.get("error")]
    t = {(r["impl"], r["direction"], r["head_dim"], r["causal"], r["seqlen_q"]): r for r in rows}
    print("%s: ms of %s over ms of each step (in brackets: TFLOP/s over FLASH's), 2 rounds"
          % (name, steps[0]))
    print("dir d   causal N      " + " ".join("%-20s" % s[:20] for s in steps))
    for key in sorted({k[1:] for k in t if k[0] == steps[0]}):
        base, flash = t[(steps[0],) + key], t.get(("sdpa_flash",) + key)
        cells = []
        for s in steps:
            r = t.get((s,) + key)
            if r is None:
                cells.append("%-20s" % "-")
                continue
            text = "%.3f" % (base["median_ms"] / r["median_ms"])
            if flash:
                text += " (%.3f)" % (r["tflops"] / flash["tflops"])
            cells.append("%-20s" % (text + ("" if r.get("passed") else " FAIL")))
        print("%-3s %-3d %-6d %-6d " % key + " ".join(cells))
EOF
say "-- total $((SECONDS - t0)) s"
