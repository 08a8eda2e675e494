"""Host tests of compare.py's pure parts and of results.py (no torch, no GPU).

results.py must give the same files from the same JSON, byte for byte; the plot is tested
only where matplotlib is installed.
"""

import hashlib
import json
import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import compare  # noqa: E402
import results  # noqa: E402


def fake_doc(steps=("01_naive", "05_split_q", "07_backward")):
    """A compare.py JSON with made-up numbers: every step forward, 07 backward, the three
    backends, two head dims, causal off/on, four seqlens, one error and one failed check."""
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for i, n in enumerate((1024, 2048, 4096, 16384)):
                shape = dict(dtype="fp16", batch=16384 // n, heads=2048 // d,
                             heads_kv=2048 // d, seqlen_q=n, seqlen_k=n, head_dim=d,
                             causal=causal, seed=7)
                impls = [(s, "step") for s in steps] + [(b, "pytorch") for b, _ in
                                                        results.BACKENDS]
                for j, (impl, kind) in enumerate(impls):
                    for direction in ("fwd", "bwd"):
                        if direction == "bwd" and kind == "step" and impl != "07_backward":
                            continue
                        tflops = 10.0 + 40 * j + 5 * i + (d == 128) * 3 - causal * 7
                        r = dict(shape, impl=impl, kind=kind, direction=direction,
                                 checked=True, passed=True, error="", median_ms=1.0 / tflops,
                                 min_ms=0.9 / tflops, max_ms=1.1 / tflops, repeats=20,
                                 spread_pct=20.0, tflops=tflops, max_abs=1e-3, rel_l2=2e-4,
                                 flops=1e12)
                        if impl != "sdpa_flash":
                            r["max_abs_vs_flash"] = 5e-4
                        if impl == "01_naive" and n == 16384 and d == 64:
                            r.update(error="OutOfMemory: needs 48.0 GiB", tflops=None,
                                     median_ms=None, checked=False, passed=False)
                        if impl == "sdpa_efficient" and n == 1024 and causal:
                            r.update(passed=False, max_abs=1.0)
                        rows.append(r)
    return {"gpu": {"name": "NVIDIA Test GPU", "sm_count": 100, "driver": "999.1",
                    "cuda_runtime_torch": "13.0", "torch": "2.11.0", "cudnn": "91900"},
            "run": {"commit": "0123456789abcdef0123", "dirty": False,
                    "date": "2026-11-30T00:00:00Z", "command": "python3 common/python/compare.py"},
            "settings": {"dtype": "fp16", "tokens": 16384, "hidden": 2048, "warmup": 5,
                         "repeats": 20, "checked": True},
            "complete": True, "results": rows}


def fake_bench():
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in (1024, 4096):
                for s, pct in (("01_naive", 5.0), ("05_split_q", 40.0), ("07_backward", 30.0)):
                    for direction in ("fwd", "bwd"):
                        if direction == "bwd" and s != "07_backward":
                            continue
                        rows.append(dict(step=s, direction=direction, dtype="fp16", batch=1,
                                         heads=16, heads_kv=16, seqlen_q=n, seqlen_k=n,
                                         head_dim=d, causal=causal, checked=True, passed=True,
                                         tflops=pct * 6.41, pct_mma=pct,
                                         pct_cublas=pct * 641 / 710, error=""))
    return {"gpu": {"name": "NVIDIA Test GPU"}, "ceilings": {"mma_sync_tflops": 641,
                                                           "cublas_gemm_tflops": 710},
            "run": {"commit": "abc", "date": "2026-11-30T00:00:00Z", "command": "bench"},
            "results": rows}


README = "# x\n\nintro\n\n<!-- results:begin -->\nNot measured yet.\n<!-- results:end -->\n\ntail\n"


@pytest.fixture
def files(tmp_path):
    j = tmp_path / "nvidia-test-gpu.json"
    j.write_text(json.dumps(fake_doc()))
    b = tmp_path / "bench.json"
    b.write_text(json.dumps(fake_bench()))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    return dict(json=str(j), bench=str(b), readme=str(readme), page=str(tmp_path / "results.md"),
                png=str(tmp_path / "plot.png"), cpng=str(tmp_path / "ceil.png"),
                dir=tmp_path)


def run_results(f, *extra):
    return results.main([f["json"], "--readme", f["readme"], "--page", f["page"], "--png",
                         f["png"], "--ceilings-png", f["cpng"], *extra])


def digest(paths):
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths
            if os.path.exists(p)}


def test_readme_table_and_page(files):
    assert run_results(files, "--bench", files["bench"], "--no-plot") == 0
    readme = open(files["readme"]).read()
    assert readme.startswith("# x\n\nintro\n\n<!-- results:begin -->\n")
    assert readme.endswith("<!-- results:end -->\n\ntail\n")
    assert "Not measured yet" not in readme
    assert "NVIDIA Test GPU" in readme and "`0123456789ab`" in readme
    assert "| forward | d=64 | d=64 causal | d=128 | d=128 causal |" in readme
    assert "| backward |" in readme
    # 05_split_q forward, d=64, no mask, seqlens 2048, 4096, 16384: tflops 10+40+5i for i=1..3
    hm = 3 / (1 / 55 + 1 / 60 + 1 / 65)
    flash = 3 / (1 / 135 + 1 / 140 + 1 / 145)
    assert "| [05_split_q](05_split_q/README.md) | %.1f (%.2fx) |" % (hm, hm / flash) in readme \
        or "| 05_split_q | %.1f (%.2fx) |" % (hm, hm / flash) in readme
    # 01_naive failed at 16384, d=64: marked
    naive = next(line for line in readme.splitlines() if line.startswith("| [01_naive]")
                 or line.startswith("| 01_naive"))
    assert naive.split(" | ")[1].startswith("17.1* (0.12x)"), naive
    text = open(files["page"]).read()
    assert text.startswith("# Results: every step beside PyTorch {#results_page}")
    assert "## Forward, head dim 128, causal" in text
    assert "OutOfMemory: needs 48.0 GiB" in text
    assert "(check failed)" in text
    assert "## Share of the two ceilings" in text and "40% / 36%" in text
    assert "## Agreement" in text


def test_same_json_same_files(files):
    assert run_results(files, "--bench", files["bench"], "--no-plot") == 0
    first = digest([files["readme"], files["page"]])
    assert run_results(files, "--bench", files["bench"], "--no-plot") == 0
    assert digest([files["readme"], files["page"]]) == first
    assert run_results(files, "--bench", files["bench"], "--check") == 0
    with open(files["page"], "a") as f:
        f.write("hand edit\n")
    assert run_results(files, "--bench", files["bench"], "--check") == 1


def test_plots_are_reproducible(files):
    pytest.importorskip("matplotlib")
    assert run_results(files, "--bench", files["bench"]) == 0
    first = digest([files["png"], files["cpng"]])
    assert len(first) == 2
    assert run_results(files, "--bench", files["bench"]) == 0
    assert digest([files["png"], files["cpng"]]) == first


def test_readme_markers_required(files):
    open(files["readme"], "w").write("# no markers\n")
    with pytest.raises(SystemExit, match="results:begin"):
        run_results(files, "--no-plot")


def test_bench_json_alone_is_accepted(files):
    files["json"] = files["bench"]
    assert run_results(files, "--no-plot") == 0
    assert "05_split_q" in open(files["page"]).read()


# --- compare.py without a GPU ---------------------------------------------------------------


def test_flop_counts_match_the_harness():
    assert compare.unmasked_pairs(4, 4, False) == 16
    assert compare.unmasked_pairs(4, 4, True) == 10
    assert compare.unmasked_pairs(2, 5, True) == 4 + 5      # bottom-right aligned
    assert compare.unmasked_pairs(5, 2, True) == 1 + 2      # three rows see no key
    for nq, nk in ((7, 7), (3, 9), (9, 3), (1, 1)):
        brute = sum(max(0, min(nk, i + nk - nq + 1)) for i in range(nq))
        assert compare.unmasked_pairs(nq, nk, True) == brute
    assert compare.flops("fwd", 2, 3, 5, 5, 8, False) == 4 * 2 * 3 * 25 * 8
    assert compare.flops("bwd", 2, 3, 5, 5, 8, False) == 2.5 * 4 * 2 * 3 * 25 * 8


def test_gpu_slug_and_tolerance():
    assert compare.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert compare.gpu_slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    assert compare.tolerance("fp16", "output") == (4 * 2 ** -10, 2 ** -10)
    assert compare.tolerance("bf16", "gradient") == (16 * 2 ** -7, 4 * 2 ** -7)


def test_compare_flags():
    a = compare.parse_args(["--quick"])
    assert a.seqlens == [1024, 4096] and a.repeats == 5 and a.warmup == 2
    a = compare.parse_args(["--seqlens", "4096", "--head-dims", "128", "--causal", "1",
                            "--backends", "flash", "--directions", "fwd"])
    assert a.seqlens == [4096] and a.head_dims == [128] and a.causal == [1]
    assert a.backends == ["sdpa_flash"] and a.directions == ["fwd"]
    for bad in (["--causal", "2"], ["--directions", "up"], ["--backends", "math"],
                ["--repeats", "0"], ["--merge", "x.json"]):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)


def test_merge(tmp_path):
    a, b = fake_doc(), fake_doc()
    a["results"] = [r for r in a["results"] if r["head_dim"] == 64]
    b["results"] = [r for r in b["results"] if r["head_dim"] == 128]
    b["run"]["commit"] = "fedcba"
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert compare.main(["--merge", str(pa), str(pb), "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert len(m["results"]) == len(fake_doc()["results"])
    assert [r["commit"] for r in m["runs"]] == ["0123456789abcdef0123", "fedcba"]
    c = fake_doc()
    c["gpu"]["name"] = "Other"
    pc = tmp_path / "c.json"
    pc.write_text(json.dumps(c))
    with pytest.raises(SystemExit, match="different GPUs"):
        compare.main(["--merge", str(pa), str(pc), "--out", str(out)])
