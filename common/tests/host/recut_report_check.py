#!/usr/bin/env python3
"""Host check of common/scripts/gpu/recut_report.py's `bars` (issues 13 and 14's speed bars
over several compare.py runs): the median per cell, the runs under the bar, the bars by mask
and direction, and a failed check counted as a miss. Python 3 standard library only; exits 1
on the first failed check."""

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts", "gpu"))

import recut_report  # noqa: E402


def run_file(folder, name, ratio, passed=True, flash_error=False, timing=None):
    """One compare.py JSON: 06 forward and 07 backward at ratio(d, causal, N) x FLASH, N 512
    (below the bars' range) to 4096."""
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in (512, 1024, 4096):
                shape = dict(head_dim=d, causal=causal, seqlen_q=n, seqlen_k=n)
                for direction, step in (("fwd", "06_causal_skip"), ("bwd", "07_backward")):
                    rows.append(dict(shape, impl="sdpa_flash", direction=direction, tflops=100.0,
                                     error="flash failed" if flash_error else "", passed=True))
                    rows.append(dict(shape, impl=step, direction=direction, error="",
                                     tflops=100.0 * ratio(d, causal, n), passed=passed))
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump({"results": rows, "settings": {"timing": timing} if timing else {}}, f)
    return path


def check_median_range_and_runs_under(folder):
    # 06 causal at d = 64, N = 1024 reads 1.08, 1.12, 1.09 in three runs: median 1.09 < 1.10.
    paths = [run_file(folder, "r%d.json" % k,
                      lambda d, causal, n, c=c: c if (d, causal, n) == (64, True, 1024) else 1.2)
             for k, c in enumerate((1.08, 1.12, 1.09))]
    lines, misses = recut_report.bar_table(paths)
    assert [m[:5] for m in misses] == [("06_causal_skip", "fwd", 64, True, 1024)], misses
    assert abs(misses[0][5] - 1.09) < 1e-9, misses
    text = "\n".join(lines)
    assert "*1.090 [1.080-1.120] 2/3" in text, text
    assert "06_causal_skip fwd: 1 of 8 cells under the bar on the median" in text, text
    assert "07_backward bwd: 0 of 8 cells under the bar on the median" in text, text
    assert "N=512" not in text, text  # the bars start at N = 1024


def check_bars_differ_by_mask_and_direction(folder):
    # 1.07x everywhere: over 06's 1.05 without the mask, under its 1.10 with it; 07's bar is
    # 1.05 under the mask too.
    _, misses = recut_report.bar_table([run_file(folder, "r.json", lambda d, causal, n: 1.07)])
    assert sorted({(m[0], m[3]) for m in misses}) == [("06_causal_skip", True)], misses
    assert len(misses) == 4, misses


def check_failed_check_is_a_miss_and_missing_flash_is_left_out(folder):
    wrong = run_file(folder, "wrong.json", lambda d, causal, n: 1.5, passed=False)
    _, misses = recut_report.bar_table([wrong])
    assert len(misses) == 16 and all(m[5] == 0.0 for m in misses), misses
    no_flash = run_file(folder, "noflash.json", lambda d, causal, n: 1.0, flash_error=True)
    good = run_file(folder, "good.json", lambda d, causal, n: 1.2)
    lines, misses = recut_report.bar_table([no_flash, good])
    assert misses == [], misses
    assert "/2" not in "\n".join(lines) and "0/1" in "\n".join(lines), lines


def check_mixed_warm_ups_are_named(folder):
    # Runs from before cd5a5c4 (no batches in their timing setting) and after it: one warning
    # line that counts each kind; runs of one kind alone: none.
    batched = "median of the repeats after the warm-up (queued in batches of ~5 ms)"
    old = [run_file(folder, "o%d.json" % k, lambda d, causal, n: 1.2) for k in range(2)]
    new = [run_file(folder, "n.json", lambda d, causal, n: 1.2, timing=batched)]
    lines, _ = recut_report.bar_table(old + new)
    assert lines[0].startswith("warning: these runs mix the warm-ups (1 batched, 2 one by one)"), lines
    for paths in (old, new):
        lines, _ = recut_report.bar_table(paths)
        assert not any(line.startswith("warning") for line in lines), lines


def main():
    checks = [check_median_range_and_runs_under, check_bars_differ_by_mask_and_direction,
              check_failed_check_is_a_miss_and_missing_flash_is_left_out,
              check_mixed_warm_ups_are_named]
    for check in checks:
        with tempfile.TemporaryDirectory() as folder:
            try:
                check(folder)
            except AssertionError as e:
                print("recut_report_check: %s FAILED: %s" % (check.__name__, e))
                return 1
    print("recut_report_check: %d checks passed" % len(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
