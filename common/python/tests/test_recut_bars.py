"""Host test of recut_report.py's `bars` (issues 13 and 14's speed bars over several compare.py
runs): the median per cell, the runs under the bar, and a failed check counted as a miss."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts", "gpu"))

import recut_report  # noqa: E402


def run_file(tmp_path, name, ratio, passed=True, flash_error=False):
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
    path = tmp_path / name
    path.write_text(json.dumps({"results": rows}))
    return str(path)


def test_median_range_and_runs_under(tmp_path):
    # 06 causal at d = 64, N = 1024 reads 1.08, 1.12, 1.09 in three runs: median 1.09 < 1.10.
    causal64 = iter([1.08, 1.12, 1.09])
    paths = []
    for k in range(3):
        c = next(causal64)
        paths.append(run_file(tmp_path, "r%d.json" % k,
                              lambda d, causal, n, c=c: c if (d, causal, n) == (64, True, 1024)
                              else 1.2))
    lines, misses = recut_report.bar_table(paths)
    assert [m[:5] for m in misses] == [("06_causal_skip", "fwd", 64, True, 1024)]
    assert abs(misses[0][5] - 1.09) < 1e-9
    text = "\n".join(lines)
    assert "*1.090 [1.080-1.120] 2/3" in text
    assert "06_causal_skip fwd: 1 of 8 cells under the bar on the median" in text
    assert "07_backward bwd: 0 of 8 cells under the bar on the median" in text
    assert "N=512" not in text  # the bars start at N = 1024


def test_bars_differ_by_mask_and_direction(tmp_path):
    # 1.07x everywhere: over 06's 1.05 without the mask, under its 1.10 with it; 07's bar is
    # 1.05 under the mask too.
    path = run_file(tmp_path, "r.json", lambda d, causal, n: 1.07)
    _, misses = recut_report.bar_table([path])
    assert sorted({(m[0], m[3]) for m in misses}) == [("06_causal_skip", True)]
    assert len(misses) == 4


def test_failed_check_is_a_miss_and_missing_flash_is_left_out(tmp_path):
    fast_but_wrong = run_file(tmp_path, "wrong.json", lambda d, causal, n: 1.5, passed=False)
    _, misses = recut_report.bar_table([fast_but_wrong])
    assert len(misses) == 16 and all(m[5] == 0.0 for m in misses)
    no_flash = run_file(tmp_path, "noflash.json", lambda d, causal, n: 1.0, flash_error=True)
    good = run_file(tmp_path, "good.json", lambda d, causal, n: 1.2)
    lines, misses = recut_report.bar_table([no_flash, good])
    assert misses == []
    assert "1/1" not in "\n".join(lines) and "0/1" in "\n".join(lines)
