#!/usr/bin/env bash
# One device call for the whole team: configure and build every step once for the GPU at
# hand (-j nproc), then run the per-area proof scripts next to this one
# (common/scripts/gpu/<area>.sh) in turn, each under its own time limit, and pack every log
# into one archive under $OUT (the device tool brings back at most 8 files).
#
#   FA_GPU_AREAS="robust recut"   which scripts, in this order (default: the area proofs,
#                                 backward determ hopper labs python recut robust splitkv;
#                                 README.md here lists every script)
#   FA_GPU_LIMIT_<area>=240       seconds for that area (default FA_GPU_LIMIT, 300)
#   FA_GPU_DEADLINE=540           stop starting new areas after this many seconds in all
#
# Each area script reads FA_BUILD_DIR (the build tree) and writes its log under $OUT; it
# prints a short summary last, which this script repeats at the very end.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
root=$PWD
final_out=${OUT:-$root/gpu-out}
logs=$final_out/logs
mkdir -p "$logs"
export FA_BUILD_DIR=${FA_BUILD_DIR:-$root/build-gpu}
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv > "$logs/gpu.txt" 2>&1
# FA_GIT_COMMIT first, as queue.sh and compare.py: a copied tree's .git may name an old commit.
echo "${FA_GIT_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}" > "$logs/commit.txt"
cmake -S . -B "$FA_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFA_BUILD_DOCS=OFF \
  > "$logs/configure.log" 2>&1 || { tail -30 "$logs/configure.log"; exit 1; }
if ! cmake --build "$FA_BUILD_DIR" -j "$(nproc)" > "$logs/build.log" 2>&1; then
  grep -E "error|Error" "$logs/build.log" | head -40
  tar czf "$final_out/logs.tgz" -C "$final_out" logs && rm -rf "$logs"
  exit 1
fi
echo "build: $(elapsed) s"
grep -E "spill|stack frame" "$logs/build.log" | grep -v " 0 bytes spill" | sort -u | head -20

here=common/scripts/gpu
areas=${FA_GPU_AREAS:-backward determ hopper labs python recut robust splitkv}
summary=""
for area in $areas; do
  if [ "$(elapsed)" -ge "${FA_GPU_DEADLINE:-540}" ]; then
    summary+=$'\n'"== $area: NOT RUN (deadline)"
    continue
  fi
  var=FA_GPU_LIMIT_$area
  limit=${!var:-${FA_GPU_LIMIT:-300}}
  t0=$(date +%s)
  OUT=$logs timeout -k 10 "$limit" bash "$here/$area.sh" > "$logs/$area.out" 2>&1
  rc=$?
  summary+=$'\n'"== $area: rc=$rc, $(( $(date +%s) - t0 )) s"$'\n'"$(tail -25 "$logs/$area.out")"
done
echo "total: $(elapsed) s"
tar czf "$final_out/logs.tgz" -C "$final_out" logs && rm -rf "$logs"
echo "$summary"
