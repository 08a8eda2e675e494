"""train_gpt.py without a GPU: its flags, its schedule, and a tiny run on the CPU.

The tiny runs need torch (skipped without it): two SDPA runs, then an SDPA run beside a
flash_steps run whose kernels are the CPU stand-ins of attention_reference. They check the
JSON (same seed and batches -> same curves for the same attention), the exit status against
--tolerance, and the plot when matplotlib is there. The real run is the GPU script's.
"""

import json
import math
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import train_gpt  # noqa: E402

TINY = ["--device", "cpu", "--steps", "6", "--batch", "2", "--context", "32", "--layers", "1",
        "--d-model", "64", "--eval-every", "3", "--eval-batches", "1",
        "--warmup-steps-untimed", "1", "--warmup", "2"]


def test_parse_run():
    assert train_gpt.parse_run("sdpa") == {"kind": "sdpa", "name": "sdpa", "backend": None}
    assert train_gpt.parse_run(" sdpa:flash ")["backend"] == "flash"
    assert train_gpt.parse_run("06_causal_skip+07_backward") == {
        "kind": "steps", "name": "06_causal_skip+07_backward", "step": "06_causal_skip",
        "backward_step": "07_backward"}
    assert train_gpt.parse_run("05_split_q")["backward_step"] is None
    with pytest.raises(SystemExit, match="unknown SDPA backend 'fast'"):
        train_gpt.parse_run("sdpa:fast")


def test_default_runs_compare_sdpa_flash_with_06_and_07():
    args = train_gpt.parse_args([])
    assert [r["name"] for r in args.runs] == ["sdpa:flash", "06_causal_skip+07_backward"]
    assert args.d_model // args.head_dim >= 4 and args.head_dim == 64 and args.tolerance == 0.02


@pytest.mark.parametrize("argv", [["--runs", ""], ["--d-model", "100"], ["--steps", "0"]])
def test_bad_flags(argv, capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_learning_rate_schedule():
    args = train_gpt.parse_args(["--steps", "100", "--warmup", "10", "--lr", "1e-3",
                                 "--min-lr", "1e-4"])
    lrs = [train_gpt.lr_at(s, args) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[99] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def run(tmp_path, runs, extra=()):
    out_json, out_png = tmp_path / "train.json", tmp_path / "train.png"
    rc = train_gpt.main(TINY + ["--runs", runs, "--out-json", str(out_json),
                                "--out-png", str(out_png)] + list(extra))
    return rc, json.loads(out_json.read_text()), out_png


def test_tiny_run_on_the_cpu(tmp_path, capsys):
    pytest.importorskip("torch")
    rc, doc, png = run(tmp_path, "sdpa,sdpa:math")
    assert rc == 0 and doc["passed"]
    a, b = doc["runs"]
    assert len(a["train_loss"]) == 6 and [s for s, _ in a["val"]] == [3, 6]
    assert all(math.isfinite(x) for x in a["train_loss"])
    # Same seed, same batches, same attention (up to the backend): the same curve.
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
    assert a["tokens_per_s"] > 0 and b["rel_diff"] == pytest.approx(0, abs=1e-3)
    assert doc["params"] > 0 and doc["config"]["steps"] == 6
    out = capsys.readouterr()
    assert "within 2% of sdpa's: yes" in out.out and "[sdpa] |" in out.err
    try:
        import matplotlib  # noqa: F401
        assert png.stat().st_size > 10000
    except ImportError:
        assert not png.exists()


def test_tiny_run_through_flash_steps_stand_ins(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from attention_reference import install_stand_in

    stand_in = install_stand_in(monkeypatch)
    rc, doc, _ = run(tmp_path, "sdpa,06_causal_skip+07_backward")
    assert rc == 0, doc
    a, b = doc["runs"]
    assert b["attention"].startswith("flash_steps.attention: forward 06_causal_skip, "
                                      "backward 07_backward")
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=2e-2)
    kinds = [c[0] for c in stand_in.calls]
    assert kinds.count("backward") == 6  # one layer, six steps
    assert kinds.count("forward") == 6 + 2  # and two evaluations without a backward


def test_tolerance_decides_the_exit_status(tmp_path):
    pytest.importorskip("torch")
    rc, doc, _ = run(tmp_path, "sdpa,sdpa:math", ["--tolerance", "-1"])
    assert rc == 1 and not doc["passed"]
