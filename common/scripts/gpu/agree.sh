#!/usr/bin/env bash
# Why the bench and compare.py disagree on the same step and shape (issue 13: within 5%).
# Times the same few steps at the shapes where they disagreed most, with both tools, A B A B:
#   compare.py with N(0, 1) inputs, compare.py with its default, the harness's inputs
#   (U(-1, 1), v and dO + 0.5), the bench; twice each, in turn, so that a drift of the GPU's
#   clocks over the run shows as a difference between the two passes of one tool, not between
#   the tools.
# nvidia-smi dmon logs power, temperature, clocks and throttle counters once a second beside
# it (dmon.txt), and every progress line gets a wall-clock stamp, so a slow row can be matched
# with the clocks it ran at.
#   FA_AGREE_STEPS   steps (default 05_split_q,06_causal_skip,10_hopper_pingpong)
#   FA_AGREE_ARGS    shape flags common to both tools (default d = 128, 8K and 16K; no mask)
# Assumes a tree built for the GPU in $FA_BUILD_DIR (default build-gpu). About 2 minutes.
. "$(dirname "$0")/setup.sh" agree
steps=${FA_AGREE_STEPS:-05_split_q,06_causal_skip,10_hopper_pingpong}
cshape=${FA_AGREE_ARGS:---head-dims 128 --seqlens 8192,16384}
stamp() { while IFS= read -r l; do printf '%s %s\n' "$(date +%T)" "$l"; done; }
nvidia-smi dmon -s pcv -d 1 -o T > "$out/dmon.txt" 2>&1 &
dmon=$!
for pass in 1 2; do
  for inputs in normal uniform; do
    say "$(date +%T) compare.py --inputs $inputs, pass $pass"
    FA_BUILD_DIR=$build python3 common/python/compare.py --steps "$steps" --backends flash \
      --directions fwd $cshape --causal 0 --warmup 3 --repeats 10 --inputs $inputs \
      --out "$out/agree_${inputs}_$pass.json" 2>&1 | stamp >> "$out/agree_progress.txt"
  done
  say "$(date +%T) bench, pass $pass"
  "$bin/bench" --steps "$steps" --direction fwd $cshape --causal off --warmup 3 --repeats 10 \
    --out "$out/agree_bench_$pass.json" 2>&1 | tr '\r' '\n' | stamp >> "$out/agree_progress.txt"
done
kill $dmon 2> /dev/null
python3 - "$out" <<'EOF' | tee -a "$log"
import glob, json, os, sys
out = sys.argv[1]
table = {}
for path in sorted(glob.glob(os.path.join(out, "agree_*_[12].json"))):
    run = os.path.basename(path)[len("agree_"):-len(".json")]
    doc = json.load(open(path))
    for r in doc.get("results", doc.get("rows", [])):
        impl = r.get("impl", r.get("step"))
        ms = r.get("median_ms", r.get("ms"))
        if impl is None or ms is None or r.get("direction", "fwd") != "fwd":
            continue
        key = (impl, r.get("head_dim"), r.get("seqlen_q", r.get("seqlen")))
        table.setdefault(key, {})[run] = ms
runs = sorted({run for v in table.values() for run in v})
print("median ms per run, in the order they ran: pass 1 (normal, uniform, bench), pass 2 alike")
print("%-20s %4s %6s " % ("impl", "d", "N") + " ".join("%13s" % r for r in runs))
for key in sorted(table, key=str):
    v = table[key]
    print("%-20s %4s %6s " % key + " ".join("%13s" % ("%.3f" % v[r] if r in v else "-") for r in runs))
EOF
