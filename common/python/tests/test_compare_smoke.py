"""Smoke test of compare.py's whole loop on the CPU (skipped without torch).

The steps are stand-ins written in torch (libfa needs a GPU); PyTorch's SDPA runs on the CPU,
where backends that only exist on a GPU fail and must come out as rows with an error, not as
a crash. Checks the JSON compare.py writes and that results.py reads it.
"""

import json
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import compare  # noqa: E402
import flash_steps  # noqa: E402
import results  # noqa: E402


def attention(q, k, v, causal, scale):
    """fp32 attention on BSHD tensors: O, lse."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]  # GQA: each K/V head serves `group` query heads
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        s = s.masked_fill(j > i + nk - nq, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vf).transpose(1, 2), lse


class FakeSteps:
    """flash_steps with two stand-in steps; 'bad' returns a wrong answer."""

    def __init__(self, wrong=False):
        self.wrong = wrong

    def steps(self):
        return ["01_naive", "07_backward"]

    def has_backward(self, step):
        return step == "07_backward"

    def library_path(self):
        return "build/lib/libfa.so"

    def prepare_forward(self, step, q, k, v, o, lse, causal, scale):
        def launch():
            out, l = attention(q, k, v, causal, scale)
            o.copy_(out * (1.5 if self.wrong and step == "01_naive" else 1.0))
            lse.copy_(l)
        return launch

    def prepare_backward(self, step, q, k, v, o, lse, d_o, dq, dk, dv, causal, scale,
                         deterministic):
        def launch():
            leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
            out, _ = attention(*leaves, causal, scale)
            g = torch.autograd.grad(out, leaves, d_o.float())
            for dst, src in zip((dq, dk, dv), g):
                dst.copy_(src)
        return launch


@pytest.mark.parametrize("wrong", [False, True])
def test_compare_runs_on_cpu(tmp_path, monkeypatch, wrong):
    fake = FakeSteps(wrong)
    for name in ("steps", "has_backward", "library_path", "prepare_forward",
                 "prepare_backward"):
        monkeypatch.setattr(flash_steps, name, getattr(fake, name))
    out = tmp_path / "cpu.json"
    rc = compare.main(["--device", "cpu", "--seqlens", "64,128", "--head-dims", "64",
                       "--tokens", "256", "--hidden", "128", "--warmup", "1", "--repeats", "3",
                       "--dtype", "bf16", "--out", str(out), "--log-dir", str(tmp_path / "log"),
                       "--seed", "5"])
    doc = json.loads(out.read_text())
    assert doc["complete"] is True
    assert rc == (1 if wrong else 0)
    rows = doc["results"]
    impls = {(r["impl"], r["direction"]) for r in rows}
    assert ("01_naive", "fwd") in impls and ("07_backward", "bwd") in impls
    assert ("01_naive", "bwd") not in impls
    assert {("sdpa_flash", "fwd"), ("sdpa_cudnn", "bwd"), ("sdpa_efficient", "fwd")} <= impls
    assert len(rows) == 2 * 2 * (3 * 2 + 1 + 2)  # 2 causal x 2 seqlens x rows per shape
    for r in rows:
        if r["kind"] == "step":
            assert not r["error"], r
            assert r["checked"] and r["tflops"] > 0
            assert r["passed"] == (not (wrong and r["impl"] == "01_naive")), r
            assert set(r["errors"]) == ({"O", "lse"} if r["direction"] == "fwd"
                                        else {"dQ", "dK", "dV"})
        b, n = r["batch"], r["seqlen_q"]
        assert b == 256 // n and r["heads"] == 2
        assert math.isclose(r["flops"], compare.flops(r["direction"], b, 2, n, n, 64,
                                                      r["causal"]))
    for r in rows:  # the default two rounds: every timed cell has both rounds' medians
        assert not r["error"] or r["error"].startswith("RuntimeError: No viable backend"), r
        if not r["error"]:
            assert r["repeats"] == 2 * 3 and len(r["round_ms"]) == 2, r
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and "samples" not in r
    flash = [r for r in rows if r["impl"] == "sdpa_flash" and not r["error"]]
    if flash:  # the CPU build of SDPA has a FLASH kernel: steps are compared with it
        assert any("max_abs_vs_flash" in r for r in rows if r["kind"] == "step")
    assert (tmp_path / "log" / "cpu.json").exists()
    assert "07_backward" in (tmp_path / "log" / "compare.log").read_text()
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:begin -->\n<!-- results:end -->\n")
    assert results.main([str(out), "--readme", str(readme), "--page", str(tmp_path / "r.md"),
                         "--no-plot"]) == 0


def test_compare_rounds_alternate_the_order(tmp_path, monkeypatch):
    """--rounds 3: every cell is timed three times, the second round in reverse order, and its
    figure is the median of all its runs."""
    fake = FakeSteps()
    for name in ("steps", "has_backward", "library_path", "prepare_backward"):
        monkeypatch.setattr(flash_steps, name, getattr(fake, name))
    calls = []

    def prepare_forward(step, q, k, v, o, lse, causal, scale):
        inner = fake.prepare_forward(step, q, k, v, o, lse, causal, scale)
        return lambda: (calls.append(step), inner())

    def sdpa_call(torch_, backend, q, k, v, causal, scale):  # SDPA on the CPU, recorded
        calls.append(backend)
        return attention(q, k, v, causal, scale)[0].to(q.dtype)

    monkeypatch.setattr(flash_steps, "prepare_forward", prepare_forward)
    monkeypatch.setattr(compare, "sdpa_call", sdpa_call)
    out = tmp_path / "rounds.json"
    rc = compare.main(["--device", "cpu", "--seqlens", "64", "--head-dims", "64", "--causal",
                       "0", "--directions", "fwd", "--tokens", "64", "--hidden", "128",
                       "--warmup", "0", "--repeats", "2", "--rounds", "3", "--backends",
                       "flash,cudnn", "--no-check", "--out", str(out), "--seed", "5"])
    assert rc == 0
    # Per cell: one call before the timing (to check it), then 2 timed runs in each of the 3
    # rounds; round 2 goes backwards, rounds 1 and 3 forwards. Each cell keeps its own
    # function: FLASH's cell calls FLASH in every round, not the backend timed last.
    fl, cu, a, b = "FLASH_ATTENTION", "CUDNN_ATTENTION", "01_naive", "07_backward"
    assert calls == [fl] * 3 + [cu] * 3 + [a] * 3 + [b] * 3 + \
        [b] * 2 + [a] * 2 + [cu] * 2 + [fl] * 2 + [fl] * 2 + [cu] * 2 + [a] * 2 + [b] * 2, calls
    rows = json.loads(out.read_text())["results"]
    for r in rows:
        if r["kind"] == "step":
            assert r["repeats"] == 6 and len(r["round_ms"]) == 3, r
    with pytest.raises(SystemExit):
        compare.parse_args(["--rounds", "0"])


def test_compare_decode_sweep_on_cpu(tmp_path, monkeypatch):
    fake = FakeSteps()
    for name in ("steps", "has_backward", "library_path", "prepare_forward",
                 "prepare_backward"):
        monkeypatch.setattr(flash_steps, name, getattr(fake, name))
    out = tmp_path / "decode.json"
    rc = compare.main(["--device", "cpu", "--decode", "--seqlens-q", "1,3", "--seqlens-k",
                       "64,100", "--batches", "2", "--heads", "4", "--heads-kv", "2,4,3",
                       "--causal", "0,1", "--head-dims", "64", "--warmup", "1", "--repeats",
                       "2", "--backends", "flash", "--out", str(out), "--seed", "3"])
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["complete"] is True
    assert doc["ceilings"]["copy_gbps"] > 0 and doc["settings"]["decode"] is True
    rows = doc["results"]
    # 2 causal x 2 heads_kv (3 does not divide 4) x 2 seqlen_q x 2 seqlen_k, forward only:
    # FLASH and the step 01_naive (07_backward's forward too).
    assert len(rows) == 2 * 2 * 2 * 2 * 3
    for r in rows:
        assert r["direction"] == "fwd" and r["head_dim"] == 64 and r["batch"] == 2
        assert r["seqlen_k"] in (64, 100) and r["seqlen_q"] in (1, 3) and r["heads"] == 4
        assert r["kv_bytes"] == compare.kv_bytes(2, r["heads_kv"], r["seqlen_k"], 64)
        if r["kind"] == "step":
            assert r["checked"] and r["passed"], r
            assert r["gbps"] > 0 and r["pct_copy"] > 0
            assert math.isclose(r["flops"], compare.flops("fwd", 2, 4, r["seqlen_q"],
                                                          r["seqlen_k"], 64, r["causal"]))
    table = compare.decode_table(rows, doc["ceilings"]["copy_gbps"])
    assert "copy ceiling" in table and "%copy" in table


def test_compare_refuses_an_empty_sweep(tmp_path, monkeypatch, capsys):
    fake = FakeSteps()
    for name in ("steps", "has_backward", "library_path", "prepare_forward",
                 "prepare_backward"):
        monkeypatch.setattr(flash_steps, name, getattr(fake, name))
    out = tmp_path / "decode.json"
    # No --heads-kv value divides --heads: no shape, a non-zero status and no file.
    assert compare.main(["--device", "cpu", "--decode", "--heads", "4", "--heads-kv", "3",
                         "--out", str(out)]) == 2
    assert "no decode shape to run" in capsys.readouterr().err and not out.exists()


def test_compare_aborts_cleanly_when_the_gpu_state_is_lost(tmp_path, monkeypatch):
    fake = FakeSteps()
    for name in ("steps", "has_backward", "library_path", "prepare_forward",
                 "prepare_backward"):
        monkeypatch.setattr(flash_steps, name, getattr(fake, name))

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(compare, "Reference", broken)
    out = tmp_path / "cpu.json"
    assert compare.main(["--device", "cpu", "--seqlens", "64", "--head-dims", "64", "--tokens",
                         "128", "--hidden", "128", "--repeats", "1", "--out", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and "illegal memory access" in doc["aborted"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_uniform_inputs_are_rounded_once_as_the_harness_rounds(dtype):
    # The harness (fa/inputs.h) rounds m * u + o to the dtype once, so a value's last mantissa
    # bit is set half the time; drawn in fp16 arithmetic (rand * 2 - 1 + 0.5 in fp16) it was
    # set in 8-12% of the values. A chunk smaller than the tensor checks the chunked draw.
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(7)
    for offset in (0.0, compare.V_OFFSET):
        x = compare.draw_input(torch, gen, (4, 100, 3, 64), dt, "cpu", "uniform", offset,
                               chunk=10_000)
        assert x.shape == (4, 100, 3, 64) and x.dtype == dt
        f = x.float()
        assert offset - 1 <= f.min() and f.max() <= offset + 1
        assert abs(f.mean().item() - offset) < 0.02
        last_bit = (x.view(torch.int16) & 1).float().mean().item()
        assert 0.45 < last_bit < 0.55, last_bit
    # The same seed draws the same tensor.
    a, b = (compare.draw_input(torch, torch.Generator().manual_seed(3), (1000,), dt, "cpu",
                               chunk=300) for _ in range(2))
    assert torch.equal(a, b)
