#!/usr/bin/env bash
# GPU proof for issue #15 (course labs that grade). Runs ctest gpu.lab in an already built tree
# ($FA_BUILD_DIR, default build-gpu, configured for this GPU): the test builds a tree of its own
# with the steps the labs need and, for every lab of FA_LAB_TEST_STEPS (here 02-07 by default,
# the issue's labs; "all" adds 08-10), the lab left unchanged, the reference copied in and every
# planted bug (only fa_gpu_tests and fa_lab_timing, -j nproc), then grades them all in one
# `lab.py grade` (quick correctness, stopping at each lab's first failure, then the speed
# check: 3 interleaved rounds).
# Must show: every unchanged lab FAILS (02-06: correct but the idea's gain is missing; 07: no
# backward pass), every reference PASSES, every planted bug FAILS naming its quantity (or, for
# a bug that only costs speed, the missing gain).
# Expected on the H200: about 3 minutes for 02-07 (29 labs: build ~1.5 min on 16 cores, grade
# ~1.5 min); about 4-5 minutes with FA_LAB_TEST_STEPS=all (42 labs).
# Writes $OUT/labs.log; prints the table (lab, step, variant, expected, got) and a verdict.
set -uo pipefail
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
build=${FA_BUILD_DIR:-build-gpu}
log="$out/labs.log"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader > "$log"
FA_LAB_TEST_STEPS=${FA_LAB_TEST_STEPS:-02,03,04,05,06,07} \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  ctest --test-dir "$build" -R '^gpu\.lab$' -V --timeout 1500 >> "$log" 2>&1
rc=$?
t1=$(date +%s)
# ctest -V prefixes the test's lines with "N: ".
plain=$(sed 's/^[0-9]*: //' "$log")
echo "== grade summary (lab, step, correct, speed: yours / reference / pass mark, result)"
sed -n '/^lab  *step  *correct/,/^=*$/p' <<< "$plain" | head -60
echo "== expected against got"
grep -E "^LAB TABLE|^lab +step +variant|\[(ok|WRONG)\]$" <<< "$plain" | head -80
grep -E "^(FAIL|ERROR):|Traceback|error:" <<< "$plain" | head -10
verdict=$(grep -E "^LAB VERDICT" <<< "$plain" | tail -1)
echo "${verdict:-LAB VERDICT: none (the test did not get to grading; see $log)}"
echo "gpu.lab rc=$rc in $((t1 - t0)) s" | tee -a "$log"
exit $rc
