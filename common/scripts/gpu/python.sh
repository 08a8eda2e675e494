#!/usr/bin/env bash
# GPU proof of issue #19 (flash_steps.attention, the training run). Assumes a tree built for
# this GPU in $FA_BUILD_DIR (default build-gpu) and PyTorch with CUDA; the pip install itself
# is checked by CI (this machine has no internet for scikit-build-core), so here the package is
# used from common/python with FA_LIB pointing at the built libfa.
#   1. the autograd function's tests: GPU (fp64 references, every step, GQA, layouts, dtypes),
#      CPU stand-ins and host tests, under pytest (or a minimal runner if pytest is missing);
#   2. train_gpt.py: the same GPT with SDPA (FLASH), with 06 forward + 07 backward, and with
#      01_naive (its own backward), same seed, data and steps; must end within 2% of SDPA.
# Writes $OUT/python.log, $OUT/python_tests.log, $OUT/train.json, $OUT/train.png.
# Expected: about 2 minutes.
. "$(dirname "$0")/setup.sh" python
export FA_LIB="$build/lib/libfa.so"
[ -f "$FA_LIB" ] || { say "python.sh: $FA_LIB not found (build the tree first)"; exit 1; }
say "== python.sh at $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name())" 2>&1 | tee -a "$log"

tests=(common/python/tests/test_attention_gpu.py common/python/tests/test_attention_cpu.py
       common/python/tests/test_attention_host.py)
t0=$(date +%s)
if python3 -c "import pytest" 2>/dev/null; then
  python3 -m pytest -q -rs -p no:cacheprovider "${tests[@]}" > "$out/python_tests.log" 2>&1
  tests_rc=$?
else
  say "pytest is not installed here: a minimal runner runs the same test functions"
  python3 common/scripts/gpu/minitest.py "${tests[@]}" > "$out/python_tests.log" 2>&1
  tests_rc=$?
fi
t_tests=$(( $(date +%s) - t0 ))
tail -25 "$out/python_tests.log" | tee -a "$log"
say "tests rc=$tests_rc (${t_tests}s)"

t0=$(date +%s)
timeout 300 python3 common/python/train_gpt.py \
  --runs sdpa:flash,06_causal_skip+07_backward,01_naive \
  --out-json "$out/train.json" --out-png "$out/train.png" >> "$log" 2>&1
train_rc=$?
t_train=$(( $(date +%s) - t0 ))
say "train_gpt.py rc=$train_rc (${t_train}s)"

table=$(sed -n '/^run .*tokens\/s/,/^final training loss/p' "$log")
say ""
say "== summary (python.sh)"
say "$(printf '%-46s %s' 'flash_steps.attention tests (GPU, CPU, host)' \
  "$(grep -E '[0-9]+ (passed|failed)' "$out/python_tests.log" | tail -1), rc=$tests_rc, ${t_tests}s")"
say "$(printf '%-46s %s' 'train_gpt.py (rc=0: within 2% of SDPA)' "rc=$train_rc, ${t_train}s")"
say "$table"
[ "$tests_rc" = 0 ] && [ "$train_rc" = 0 ]
