"""compare.py --energy on the CPU (skipped without torch): NVML's energy counter replaced by
fakes whose readings are known, so that the energy per call and the power compare.py computes
can be checked against them; a counter that is missing or fails must cost one warning and null
figures, never the sweep; without --energy the rows must be as they were before the flag.
"""

import json
import math
import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import compare  # noqa: E402
import flash_steps  # noqa: E402
import results  # noqa: E402
from test_compare_smoke import FakeSteps  # noqa: E402

ENERGY_KEYS = {"energy_mj_per_call", "power_w", "energy_calls", "round_energy_mj"}
WATTS = 300.0  # the fake GPU's constant power
SLEEP_S = 0.002  # each stand-in step call takes at least this long


class ClockNvml:
    """A fake NVML counter at constant power: WATTS x the time since it was opened, in mJ."""

    matched = "a fake"

    def __init__(self, torch_, device):
        self.t0 = time.perf_counter()
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return WATTS * 1e3 * (time.perf_counter() - self.t0)  # W x ms = mJ


def slow_steps(monkeypatch):
    """The smoke test's stand-in steps, each call also sleeping SLEEP_S."""
    fake = FakeSteps()
    for name in ("steps", "has_backward", "library_path"):
        monkeypatch.setattr(flash_steps, name, getattr(fake, name))

    def slow(prepare):
        def prepared(*args):
            inner = prepare(*args)
            return lambda: (time.sleep(SLEEP_S), inner())
        return prepared

    monkeypatch.setattr(flash_steps, "prepare_forward", slow(fake.prepare_forward))
    monkeypatch.setattr(flash_steps, "prepare_backward", slow(fake.prepare_backward))


def run(tmp_path, *extra):
    out = tmp_path / "energy.json"
    rc = compare.main(["--device", "cpu", "--seqlens", "64", "--head-dims", "64", "--causal",
                       "0", "--tokens", "128", "--hidden", "128", "--warmup", "1", "--repeats",
                       "3", "--backends", "flash", "--out", str(out), "--seed", "5"]
                      + list(extra))
    return rc, json.loads(out.read_text())


def test_energy_per_call_and_power_from_the_counter(tmp_path, monkeypatch, capsys):
    slow_steps(monkeypatch)
    monkeypatch.setattr(compare, "NvmlEnergy", ClockNvml)
    rc, doc = run(tmp_path, "--energy", "--energy-ms", "30")
    assert rc == 0 and doc["complete"] is True
    assert doc["settings"]["energy"]["energy_ms"] == 30.0
    assert "a fake" in doc["settings"]["energy"]["counter"]
    assert "error" not in doc["settings"]["energy"]
    rows = [r for r in doc["results"] if not r["error"]]
    steps = [r for r in rows if r["kind"] == "step"]
    assert len(steps) == 3  # 01_naive fwd, 07_backward fwd and bwd
    for r in rows:
        # Both rounds measured, each for at least 30 ms: more calls than the timed 3 a round.
        assert len(r["round_energy_mj"]) == 2 and None not in r["round_energy_mj"], r
        assert r["energy_mj_per_call"] == pytest.approx(
            0.5 * sum(r["round_energy_mj"]), rel=1e-9)  # median of two rounds
        assert r["energy_calls"] >= 2 * 3, r
        if 3 * max(r["round_ms"]) < 0.5 * 30:  # 3 timed calls far short of 30 ms: more calls ran
            assert r["energy_calls"] > 2 * 3, r
        assert math.isclose(r["power_w"], WATTS, rel_tol=0.02), r
    for r in steps:
        # A call spends at least the power times its own time; the gaps between calls (on a
        # loaded machine, much longer than the calls) only add to it. The energy is counted over
        # other calls than the timed ones, and on a loaded machine one call can take several
        # times another (the median of the timed ones was above the energy calls' mean, once,
        # beside the sanitizers): so the bound is the fastest timed call, not their median.
        assert r["energy_mj_per_call"] >= 0.99 * WATTS * 1e3 * SLEEP_S, r
        assert r["energy_mj_per_call"] >= 0.8 * WATTS * r["min_ms"], r
    text = capsys.readouterr()
    assert "mJ/call" in text.out and "warning" not in text.err
    readme = tmp_path / "README.md"  # results.py takes the new keys in its stride
    readme.write_text("<!-- results:begin -->\n<!-- results:end -->\n")
    assert results.main([str(tmp_path / "energy.json"), "--readme", str(readme), "--page",
                         str(tmp_path / "r.md"), "--no-plot"]) == 0


def test_one_round_has_no_round_list(tmp_path, monkeypatch):
    slow_steps(monkeypatch)
    monkeypatch.setattr(compare, "NvmlEnergy", ClockNvml)
    rc, doc = run(tmp_path, "--energy", "--energy-ms", "10", "--rounds", "1",
                  "--directions", "fwd")
    assert rc == 0
    for r in doc["results"]:
        if not r["error"]:
            assert "round_ms" not in r and "round_energy_mj" not in r
            assert r["energy_calls"] >= 3 and math.isclose(r["power_w"], WATTS, rel_tol=0.02)


class Broken:
    def __init__(self, torch_, device):
        raise compare.NvmlError("nvmlInit_v2: Driver Not Loaded (NVML status 9)")


class FailsLater(ClockNvml):
    """Works for the first few reads, then the driver goes away."""

    def __call__(self):
        if self.reads >= 2:
            raise compare.NvmlError("nvmlDeviceGetTotalEnergyConsumption: GPU is lost")
        return super().__call__()


@pytest.mark.parametrize("reader", [Broken, FailsLater, None])
def test_a_missing_or_failing_counter_warns_once_and_gives_null(tmp_path, monkeypatch, capsys,
                                                                 reader):
    slow_steps(monkeypatch)
    if reader is not None:  # None: the real NvmlEnergy, which refuses --device cpu
        monkeypatch.setattr(compare, "NvmlEnergy", reader)
    rc, doc = run(tmp_path, "--energy", "--energy-ms", "5")
    assert rc == 0 and doc["complete"] is True
    err = capsys.readouterr().err
    assert err.count("warning: --energy") == 1, err
    assert doc["settings"]["energy"]["error"]
    rows = [r for r in doc["results"] if not r["error"]]
    assert sum(r["kind"] == "step" for r in rows) == 3  # the sweep went on, every cell timed
    for r in rows:
        assert ENERGY_KEYS <= set(r) and r["repeats"] == 2 * 3
    # Rows measured after the failure have null (json's None); FailsLater's first cell's first
    # round still has its figure (reads 1 and 2), and so that row keeps its median.
    nulls = [r for r in rows if r["energy_mj_per_call"] is None]
    assert nulls and all(r["power_w"] is None and r["energy_calls"] == 0 for r in nulls)
    if reader is FailsLater:
        first = rows[0]
        assert first["round_energy_mj"][0] is not None and first["round_energy_mj"][1] is None
        assert first["energy_mj_per_call"] == first["round_energy_mj"][0]
        assert len(nulls) == len(rows) - 1
    else:
        assert len(nulls) == len(rows)


def test_without_energy_the_rows_are_as_before(tmp_path, monkeypatch, capsys):
    slow_steps(monkeypatch)
    opened = []
    monkeypatch.setattr(compare, "NvmlEnergy", lambda *a: opened.append(a))
    rc, doc = run(tmp_path)
    assert rc == 0 and not opened
    assert "energy" not in doc["settings"]
    for r in doc["results"]:
        assert not ENERGY_KEYS & set(r), r
    assert "mJ/call" not in capsys.readouterr().out


def test_time_calls_counts_only_the_calls_of_the_interval():
    """A counter that moves 5 mJ per call and not with time: whatever the number of calls run
    for --energy-ms, the energy per call is exactly 5 and the warm-up is not in it."""
    calls = []

    class PerCall:
        def __call__(self):
            return 5.0 * len(calls)

    meter = compare.EnergyMeter.__new__(compare.EnergyMeter)
    meter.reader, meter.error = PerCall(), ""

    def fn():
        calls.append(1)
        time.sleep(0.001)

    t = compare.time_calls(torch, fn, 4, 3, "cpu", 0.0, meter, 25.0)
    assert t["repeats"] == 3 and len(t["samples"]) == 3  # the timing is of the timed calls
    assert t["energy_mj_per_call"] == 5.0
    assert t["energy_calls"] == len(calls) - 4 and t["energy_calls"] >= 10
    assert t["power_w"] > 0
    del calls[:]
    t = compare.time_calls(torch, fn, 0, 3, "cpu", 0.0, meter, 0.0)
    assert t["energy_calls"] == 3 and t["energy_mj_per_call"] == 5.0
    t = compare.time_calls(torch, fn, 0, 3, "cpu")
    assert not ENERGY_KEYS & set(t)


def test_pool_rounds_takes_the_median_of_the_rounds_with_a_figure():
    def rnd(ms, mj, w, n):
        t = compare.timing_of([ms])
        t.update(energy_mj_per_call=mj, power_w=w, energy_calls=n)
        return t

    p = compare.pool_rounds([rnd(1.0, 2.0, 100.0, 10), rnd(1.0, None, None, 0),
                             rnd(1.0, 4.0, 300.0, 20)])
    assert p["energy_mj_per_call"] == 3.0 and p["power_w"] == 200.0
    assert p["energy_calls"] == 30 and p["round_energy_mj"] == [2.0, None, 4.0]
    p = compare.pool_rounds([rnd(1.0, None, None, 0)] * 2)
    assert p["energy_mj_per_call"] is None and p["power_w"] is None
    assert not ENERGY_KEYS & set(compare.pool_rounds([compare.timing_of([1.0])] * 2))


def test_energy_ms_must_not_be_negative():
    with pytest.raises(SystemExit):
        compare.parse_args(["--energy-ms", "-1"])
    assert compare.parse_args([]).energy is False
