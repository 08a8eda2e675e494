#!/usr/bin/env bash
# Probe of the 02 decode failure of #13 (FA_TEST_SEED=111165598, problem seed 730520730):
# is it 02's alone, and which rounding makes it? Builds, in build-probe, the steps 01-06 and
# 08 and two variants of 02 made with lab.py (x02_fused: the rescale's exponent in one FMA;
# x02_exact: exp2f and IEEE division instead of ex2.approx and rcp), then runs that one problem
# on each (FA_DECODE_SEED prints every step's error). Writes $OUT/probe.log.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"; log=$out/probe.log
b=$PWD/build-probe; x=$PWD/build-probe-labs
rm -rf "$x"; mkdir -p "$x"
for v in x02_fused x02_exact; do
  python3 common/scripts/lab.py start 02_tiled_fa1 --reference --name $v --dir "$x" --build "$b" --no-configure > /dev/null || exit 1
done
for v in x04_bn64 x04_mask x04_bm32; do
  python3 common/scripts/lab.py start 04_deferred_rescale --reference --name $v --dir "$x" --build "$b" --no-configure > /dev/null || exit 1
done
sed -i 's/#define FA_FWD_BLOCK_N_D64 128/#define FA_FWD_BLOCK_N_D64 64/' "$x/x04_bn64/kernel.cu"
sed -i 's/const bool needs_mask = args.causal || kv_start + Tr::kBlockN > seqlen_k;/const bool needs_mask = true;/' "$x/x04_mask/kernel.cu"
sed -i 's/kBlockM = 64, kBlockN = FA_FWD_BLOCK_N_D64/kBlockM = 32, kBlockN = FA_FWD_BLOCK_N_D64/' "$x/x04_bm32/kernel.cu"
grep -c "N_D64 64" "$x/x04_bn64/kernel.cu" >> "$log"; grep -c "needs_mask = true" "$x/x04_mask/kernel.cu" >> "$log"; grep -c "kBlockM = 32, kBlockN = FA_FWD_BLOCK_N_D64" "$x/x04_bm32/kernel.cu" >> "$log"
sed -i 's/fa::exp2_approx(row_max\[mi\]\[h\] \* scale_log2 - m_scaled)/fa::exp2_approx(fmaf(row_max[mi][h], scale_log2, -m_scaled))/' "$x/x02_fused/kernel.cu"
sed -i 's/fa::exp2_approx(/exp2f(/g; s|1\.f / l_new|__fdiv_rn(1.f, l_new)|' "$x/x02_exact/kernel.cu"
grep -c "fmaf(row_max" "$x/x02_fused/kernel.cu" >> "$log"; grep -c "exp2f(\|__fdiv_rn" "$x/x02_exact/kernel.cu" >> "$log"
cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DFA_ONLY_STEPS="01_naive;02_tiled_fa1;03_loop_swap;04_deferred_rescale;05_split_q;06_causal_skip;08_split_kv" \
  "-DFA_LAB_DIRS=$x/x02_fused;$x/x02_exact;$x/x04_bn64;$x/x04_mask;$x/x04_bm32" > "$out/probe_configure.log" 2>&1 || { tail -20 "$out/probe_configure.log"; exit 1; }
cmake --build "$b" -j "$(nproc)" --target fa_gpu_tests > "$out/probe_build.log" 2>&1 || { grep -E "error" "$out/probe_build.log" | head; exit 1; }
FA_TEST_SEED=111165598 FA_DECODE_SEED=730520730 "$b/bin/fa_gpu_tests" --gtest_filter='Decode/DecodeRandom.Problems/*' >> "$log" 2>&1
grep -A6 "^\[ decode   \].*seed 730520730" "$log" | grep -v "^--"
