#!/usr/bin/env bash
# GPU proof for issue #15 (course labs that grade). Runs ctest gpu.lab in an already built tree
# ($FA_BUILD_DIR, default build-gpu, configured for this GPU): it builds one tree of its own
# with every step and, for every lab (02-07, and any later step that has a lab), the lab left
# unchanged, the reference copied in and every planted bug (-j nproc), then grades them all in
# one `lab.py grade` (quick correctness, then the speed check: 3 interleaved rounds). Must
# show: every unchanged lab FAILS, every reference PASSES, every planted bug FAILS naming its
# quantity (or the missing gain). Expected: about 3 minutes on the H200 (build ~1 min, grade
# ~1.5 min). Writes $OUT/labs.log; prints the table (lab, variant, expected, got).
set -uo pipefail
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
build=${FA_BUILD_DIR:-build-gpu}
log="$out/labs.log"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader > "$log"
ctest --test-dir "$build" -R '^gpu\.lab$' -V --timeout 1500 >> "$log" 2>&1
rc=$?
t1=$(date +%s)
echo "gpu.lab rc=$rc in $((t1 - t0)) s" | tee -a "$log"
# The grade's summary table, then the test's table (ctest -V prefixes lines with "N: ").
sed 's/^[0-9]*: //' "$log" > "$log.plain"
sed -n '/^lab  *step  *correct/,/^=*$/p' "$log.plain" | head -60
grep -E "^LAB TABLE|^lab +step +variant|\[(ok|WRONG)\]$" "$log.plain" | head -80
grep -E "^(FAIL|ERROR):|Error|Traceback" "$log.plain" | head -10
rm -f "$log.plain"
exit $rc
