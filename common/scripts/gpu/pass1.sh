#!/usr/bin/env bash
# Coordinator's first pass over a merged tree (run through all.sh with FA_GPU_AREAS=pass1):
# every GPU test once, issue 17's seed, then the figures every area needs from one run:
# compare.py over every step beside PyTorch FLASH and cuDNN (forward and backward), the decode
# sweep, and the autograd tests. Logs and JSON under $OUT; a summary last.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
build=${FA_BUILD_DIR:-build-gpu}
bin=$build/bin
out=${OUT:-gpu-logs}
mkdir -p "$out"
t() { echo "[$(date +%T)] $*"; }

t "ctest -L gpu (gpu.lab aside), once"
(cd "$build" && ctest -L gpu -E '^gpu\.lab$' -j4 --timeout 240 --output-on-failure) \
  > "$out/ctest_gpu.log" 2>&1
echo "ctest rc=$?"; grep -E "tests passed|tests failed|Failed|Timeout|\*\*\*Exception" "$out/ctest_gpu.log" | head -20

t "issue 17 seed"
FA_RANDOM_SEED=258115526 FA_RANDOM_PROBLEMS=1 "$bin/fa_gpu_tests" \
  --gtest_filter='Random/RandomConformance.Problems/01_naive_bwd' > "$out/seed.log" 2>&1
echo "seed rc=$?"

t "compare.py: every step, FLASH, cuDNN; fwd+bwd; N 1024..16384"
timeout 300 python3 common/python/compare.py --backends flash,cudnn \
  --seqlens 1024,2048,4096,8192,16384 --warmup 2 --repeats 8 \
  --out "$out/compare_all.json" > "$out/compare_all.log" 2>&1
echo "compare rc=$?"; tail -5 "$out/compare_all.log"

t "compare.py --decode: 08, 06, FLASH"
timeout 120 python3 common/python/compare.py --decode --steps 06_causal_skip,08_split_kv \
  --backends flash --seqlens-q 1 --heads-kv 8 --warmup 2 --repeats 8 \
  --out "$out/compare_decode.json" > "$out/compare_decode.log" 2>&1
echo "decode rc=$?"; tail -3 "$out/compare_decode.log"

t "autograd tests"
FA_LIB=$build/lib/libfa.so PYTHONPATH=common/python timeout 120 python3 -m pytest -q -x \
  common/python/tests/test_attention_gpu.py > "$out/pytest_gpu.log" 2>&1
echo "pytest rc=$?"; tail -3 "$out/pytest_gpu.log"
t "done"
