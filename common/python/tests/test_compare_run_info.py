"""compare.py without a GPU: the recorded command reproduces the run (environment included);
the decode sweep's rotation among copies of the inputs."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import compare  # noqa: E402


def test_command_names_the_shared_memory_limit(monkeypatch):
    script = os.path.join(compare.REPO, "common", "python", "compare.py")
    monkeypatch.setattr(sys, "argv", [script, "--quick"])
    monkeypatch.delenv("FA_SMEM_LIMIT", raising=False)
    monkeypatch.delenv("FA_NUM_SPLITS", raising=False)
    monkeypatch.delenv("FA_BWD_TAIL_SPLIT", raising=False)
    assert compare.run_info()["command"] == "python3 common/python/compare.py --quick"
    monkeypatch.setenv("FA_SMEM_LIMIT", "101376")
    assert (compare.run_info()["command"]
            == "FA_SMEM_LIMIT=101376 python3 common/python/compare.py --quick")


def test_command_names_the_split_count(monkeypatch):
    script = os.path.join(compare.REPO, "common", "python", "compare.py")
    monkeypatch.setattr(sys, "argv", [script, "--decode"])
    monkeypatch.delenv("FA_SMEM_LIMIT", raising=False)
    monkeypatch.setenv("FA_NUM_SPLITS", "4")
    monkeypatch.delenv("FA_BWD_TAIL_SPLIT", raising=False)
    assert (compare.run_info()["command"]
            == "FA_NUM_SPLITS=4 python3 common/python/compare.py --decode")
    monkeypatch.setenv("FA_BWD_TAIL_SPLIT", "0")  # 07_backward's split of the last wave
    assert (compare.run_info()["command"]
            == "FA_NUM_SPLITS=4 FA_BWD_TAIL_SPLIT=0 python3 common/python/compare.py --decode")


def test_decode_rotation_covers_four_l2_caches():
    l2 = 50 * 2 ** 20
    assert compare.rotation_sets(4 * 2 ** 20, l2) == 50  # 4 MiB of K/V: 50 copies
    assert compare.rotation_sets(2 ** 20, l2) == 64  # capped
    assert compare.rotation_sets(4 * l2, l2) == 1  # already 4x the cache
    assert compare.rotation_sets(2 ** 20, 0) == 1  # cache size unknown: no rotation
    calls = []
    turn = compare.in_turn([lambda: calls.append(0), lambda: calls.append(1)])
    for _ in range(5):
        turn()
    assert calls == [0, 1, 0, 1, 0]


def test_empty_lists_and_abbreviated_flags_are_refused():
    for argv in (["--seqlens", ","], ["--head-dims", ","], ["--decode", "--batches", ","]):
        with pytest.raises(SystemExit):
            compare.parse_args(argv)
    # --decode's defaults look for the flags spelled out; an abbreviation would be parsed and
    # then overwritten by them, so it is refused.
    with pytest.raises(SystemExit):
        compare.parse_args(["--decode", "--direction", "bwd"])
    a = compare.parse_args(["--decode", "--directions", "bwd", "--head-dims", "64"])
    assert a.directions == ["bwd"] and a.head_dims == [64]
    a = compare.parse_args(["--decode"])
    assert a.directions == ["fwd"] and a.head_dims == [128]


def test_kernel_env_is_the_harness_list():
    """compare.py and fa::run_info name the same variables in front of a run's command."""
    import re
    src = open(os.path.join(compare.REPO, "common", "src", "host", "report.cpp")).read()
    body = src[src.index("RunInfo run_info("):]
    body = body[:body.index("run.command +=")]
    assert tuple(re.findall(r'"(FA_[A-Z0-9_]+)"', body)) == compare.KERNEL_ENV


def test_warm_up_queues_its_calls_in_batches():
    # One call after another, each synchronized, left the GPU idle between calls (tens of us
    # from Python), so a 0.2 ms kernel warmed up at a lower power than it is timed at (back to
    # back). The warm-up now synchronizes once per batch of about WARMUP_BATCH_MS.
    import time
    calls, syncs = [], []

    def fn():
        calls.append(time.perf_counter())
        time.sleep(0.0002)  # a "kernel" of 0.2 ms

    made = compare.warm_up(fn, lambda: syncs.append(len(calls)), warmup=3, warmup_ms=40.0)
    assert made == len(calls) > 3 * len(syncs)  # many calls a synchronize
    assert syncs[0] == 3  # the first batch: the `warmup` calls, then one synchronize
    assert len(syncs) <= 12, syncs  # then batches of ~5 ms: not one synchronize per call
    assert syncs[-1] == len(calls)  # every call is waited for before the timing starts
    # Without a time budget: just the `warmup` calls, one batch.
    calls.clear(), syncs.clear()
    assert compare.warm_up(fn, lambda: syncs.append(len(calls)), warmup=3, warmup_ms=0) == 3
    assert syncs == [3]


def test_warmup_batch_is_the_harness_rule():
    assert compare.warmup_batch(0.2) == 25  # 5 ms of 0.2 ms calls
    assert compare.warmup_batch(0.18) == 28
    assert compare.warmup_batch(5.0) == 1 and compare.warmup_batch(60.0) == 1
    assert compare.warmup_batch(0.0) == compare.WARMUP_MAX_BATCH
    assert compare.warmup_batch(1e-6) == compare.WARMUP_MAX_BATCH
    # The same constants as fa::kWarmupBatchMs and fa::kWarmupMaxBatch (common/include/fa/harness.h).
    import re
    with open(os.path.join(compare.REPO, "common", "include", "fa", "harness.h")) as f:
        header = f.read()
    assert float(re.search(r"kWarmupBatchMs = ([0-9.]+);", header).group(1)) == compare.WARMUP_BATCH_MS
    assert int(re.search(r"kWarmupMaxBatch = ([0-9]+);", header).group(1)) == compare.WARMUP_MAX_BATCH
