#!/usr/bin/env bash
# Nsight Compute, full set, of one step's kernel beside PyTorch FLASH's (and cuDNN's) on the
# same tensors: one compare.py run per shape (no warm-up, no heat phase, one round), the first
# two launches of each kernel (two of each in this setting). Writes
# ncu_<dir>_d<d>_N<N>[_c].txt (every section, both kernels) and the per-instruction source
# page (_sass.csv.gz) under $OUT, packed at the end into one ncu_<dir>.tgz (the device tool
# brings back only a few files a call); the report files are removed.
#   FA_NCU_DIRECTION=bwd     bwd: 07's main backward kernel beside
#                            flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel (07_backward/NOTES.md,
#                            change 9); fwd: a forward step's kernel beside flash_fwd_kernel
#   FA_NCU_STEP              the step (07_backward for bwd, 06_causal_skip for fwd)
#   FA_NCU_BACKENDS=flash,cudnn   the PyTorch backends beside it (default flash); cuDNN's
#                            kernels are matched by name (sdpa|fmha|cudnn)
#   FA_NCU_SHAPES="64:4096 128:4096"   head dim : seqlen [: causal 0/1, default 0]; 16K tokens,
#                            hidden 2048
#   FA_NCU_PIPES=1           instead of the full set: each pipe's utilization, issue slots, L2
#                            hit rate, device-memory bytes and the main stall reasons per
#                            issued instruction (a few seconds a shape; 06_causal_skip/NOTES.md,
#                            thirteenth session), printed here
# Assumes a tree built for the GPU in $FA_BUILD_DIR (default build-gpu). About 45 s a shape.
. "$(dirname "$0")/setup.sh" ncu
command -v ncu > /dev/null || { say "no ncu on this machine"; exit 2; }
dir=${FA_NCU_DIRECTION:-bwd}
case $dir in
  bwd) step=${FA_NCU_STEP:-07_backward} kernels='bwd_dk_dv_kernel|flash_bwd_dq_dk_dv' ;;
  fwd) step=${FA_NCU_STEP:-06_causal_skip} kernels='flash_forward_kernel|flash_fwd_kernel' ;;
  *) say "FA_NCU_DIRECTION is fwd or bwd, not '$dir'"; exit 2 ;;
esac
backends=${FA_NCU_BACKENDS:-flash}
kernels_profiled=1  # the step's
for b in ${backends//,/ }; do
  case $b in
    flash) ;;  # flash_fwd_kernel / the bwd loop kernel: in $kernels already
    cudnn) kernels="$kernels|sdpa|fmha|cudnn" ;;
    *) say "FA_NCU_BACKENDS takes flash and cudnn, not '$b'"; exit 2 ;;
  esac
  kernels_profiled=$((kernels_profiled + 1))
done
launches=$((2 * kernels_profiled))  # two of each kernel
stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' wait \
  math_pipe_throttle short_scoreboard long_scoreboard mio_throttle barrier)
pipes="sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,\
sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,\
sm__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,sm__inst_executed.sum,\
lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,\
${stalls%,}"
for spec in ${FA_NCU_SHAPES:-64:4096 128:4096}; do
  IFS=: read -r d n causal <<< "$spec"
  causal=${causal:-0}
  name=ncu_${dir}_d${d}_N${n}$([ "$causal" = 1 ] && echo _c)
  cmp=(python3 common/python/compare.py --steps "$step" --backends "$backends" --directions "$dir"
    --seqlens "$n" --head-dims "$d" --causal "$causal" --warmup 0 --warmup-ms 0 --heat-ms 0
    --rounds 1 --repeats 1 --no-check
    --out "$out/$name.json")
  if [ "${FA_NCU_PIPES:-0}" = 1 ]; then
    FA_BUILD_DIR=$build timeout 300 ncu --clock-control none --metrics "$pipes" \
      -k regex:"$kernels" -c "$launches" "${cmp[@]}" > "$out/$name.txt" 2>&1
    say "$name (pipes): rc=$?"
    grep -E "^  [a-zA-Z_(].*(kernel|sdpa|fmha|cudnn)|duration|inst_executed.sum|issue_active|pipe_(xu|fma|alu)\.avg|tensor_cycles|hit_rate|dram__bytes|ratio" \
      "$out/$name.txt" | sed -E 's/  +/ /g' | cut -c1-150 | tee -a "$log"
    rm -f "$out/$name.json"
    continue
  fi
  FA_BUILD_DIR=$build timeout 300 ncu --clock-control none --set full -f -o "$out/$name" \
    -k regex:"$kernels" -c "$launches" "${cmp[@]}" > "$out/$name.log" 2>&1
  say "$name: rc=$? $(grep -c '==PROF==' "$out/$name.log") profiler lines"
  ncu -i "$out/$name.ncu-rep" --print-details all > "$out/$name.txt" 2>&1
  ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_sass.csv" 2>&1 &&
    gzip -f "$out/${name}_sass.csv"
  rm -f "$out/$name.ncu-rep" "$out/$name.json"
  grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Shared Memory|Warp Cycles Per Issued|No Eligible" "$out/$name.txt" | head -40 | tee -a "$log"
done
cd "$out" && tar czf "ncu_${dir}.tgz" ncu_"${dir}"_* && rm -f ncu_"${dir}"_* && say "packed into $out/ncu_${dir}.tgz"
