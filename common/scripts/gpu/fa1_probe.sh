#!/usr/bin/env bash
# Probe of the 02 decode failure of #13 (FA_TEST_SEED=111165598, problem seed 730520730) and
# proof of its fix. The cause: the rescale factor exp2(m_old c' - m_new c') was evaluated with
# one product rounded and the other kept exact by an FMA, so it was not exactly 1 when the max
# did not change, and O and l drifted once per K/V block. Builds, in build-probe, steps 01-08
# and, made with lab.py, x02_old, x05_old and x06_old: those steps with the old expression
# put back. Runs the seed's problem on each (FA_DECODE_SEED prints every step's error) and
# EdgeCases.TiedKeysFarApart, the named case made for this (the old ones must fail it, every
# step must pass it). Writes $OUT/probe.log.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"; log=$out/probe.log; : > "$log"
b=$PWD/build-probe; x=$PWD/build-probe-labs
rm -rf "$x"; mkdir -p "$x"
dirs=""
for s in 02_tiled_fa1 05_split_q 06_causal_skip; do
  v=x${s:0:2}_old
  python3 common/scripts/lab.py start $s --reference --name $v --dir "$x" --build "$b" --no-configure > /dev/null || exit 1
  python3 - "$x/$v/kernel.cu" <<'PY' || exit 1
import re, sys
p = sys.argv[1]; s = open(p).read()
s2, n = re.subn(r"m_new\[mi\]\[h\] == -INFINITY\s*\?\s*0\.f\s*:\s*fa::exp2_approx\(\(row_max\[mi\]\[h\] - m_new\[mi\]\[h\]\) \* scale_log2\)",
                "fa::exp2_approx(row_max[mi][h] * scale_log2 - ((m_new[mi][h] == -INFINITY) ? 0.f : m_new[mi][h] * scale_log2))", s)
assert n == 1, (p, n)
open(p, "w").write(s2)
PY
  dirs+="$x/$v;"
done
cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DFA_ONLY_STEPS="01_naive;02_tiled_fa1;03_loop_swap;04_deferred_rescale;05_split_q;06_causal_skip;07_backward;08_split_kv" \
  "-DFA_LAB_DIRS=${dirs%;}" > "$out/probe_configure.log" 2>&1 || { tail -20 "$out/probe_configure.log"; exit 1; }
cmake --build "$b" -j "$(nproc)" --target fa_gpu_tests > "$out/probe_build.log" 2>&1 || { grep -E "error" "$out/probe_build.log" | head; exit 1; }
FA_DECODE_SEED=730520730 "$b/bin/fa_gpu_tests" --gtest_filter='Decode/DecodeRandom.Problems/*' >> "$log" 2>&1
grep -A1 "^\[ decode   \].*seed 730520730" "$log" | grep -v "^--"
"$b/bin/fa_gpu_tests" --gtest_filter='Steps/EdgeCases.TiedKeysFarApart/*' > "$out/probe_tied.log" 2>&1
grep -E "^\[ +(OK|FAILED) +\]|v [0-9]+ seed" "$out/probe_tied.log" | sort -u | head -30
