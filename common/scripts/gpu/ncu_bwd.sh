#!/usr/bin/env bash
# Nsight Compute, full set, of 07's main backward kernel beside PyTorch FLASH's
# (flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel) on the same tensors: one compare.py run per
# shape, the first two launches of each kernel (the checked call and the timed one).
# Writes ncu_d<d>_N<N>.txt (every section, both kernels) under $OUT; the report files are
# removed (the device tool brings back few files).
#   FA_NCU_SHAPES="64:4096 128:4096"   head dim : seqlen, non-causal, 16K tokens, hidden 2048
# Assumes a tree built for the GPU in $FA_BUILD_DIR (default build-gpu). About 45 s a shape.
. "$(dirname "$0")/setup.sh" ncu_bwd
command -v ncu > /dev/null || { say "no ncu on this machine"; exit 2; }
for spec in ${FA_NCU_SHAPES:-64:4096 128:4096}; do
  d=${spec%:*} n=${spec#*:} name=ncu_d${spec%:*}_N${spec#*:}
  FA_BUILD_DIR=$build timeout 300 ncu --clock-control none --set full -f -o "$out/$name" \
    -k regex:'bwd_dk_dv_kernel|flash_bwd_dq_dk_dv' -c 4 \
    python3 common/python/compare.py --steps 07_backward --backends flash --directions bwd \
    --seqlens "$n" --head-dims "$d" --causal 0 --warmup 0 --repeats 1 --no-check \
    --out "$out/$name.json" > "$out/$name.log" 2>&1
  say "$name: rc=$? $(grep -c '==PROF==' "$out/$name.log") profiler lines"
  ncu -i "$out/$name.ncu-rep" --print-details all > "$out/$name.txt" 2>&1
  ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_sass.csv" 2>&1 &&
    gzip -f "$out/${name}_sass.csv"
  rm -f "$out/$name.ncu-rep" "$out/$name.json"
  grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Shared Memory|Warp Cycles Per Issued|No Eligible" "$out/$name.txt" | head -40 | tee -a "$log"
done
