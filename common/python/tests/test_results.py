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
STEP_README = ("# Step\n\n## Measured\n\n<!-- measured:begin -->\nTo be measured.\n"
               "<!-- measured:end -->\n\n## The diff\n")


@pytest.fixture
def files(tmp_path):
    j = tmp_path / "nvidia-test-gpu.json"
    j.write_text(json.dumps(fake_doc()))
    b = tmp_path / "bench.json"
    b.write_text(json.dumps(fake_bench()))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    # Step folders beside the README (the default --steps-dir): two opt in with the markers,
    # one does not, and one opts in but is not in the JSON.
    steps = {}
    for name, text in (("01_naive", STEP_README), ("05_split_q", STEP_README),
                       ("07_backward", STEP_README), ("06_causal_skip", "# no markers\n"),
                       ("03_loop_swap", STEP_README)):
        (tmp_path / name).mkdir()
        steps[name] = tmp_path / name / "README.md"
        steps[name].write_text(text)
    return dict(json=str(j), bench=str(b), readme=str(readme), page=str(tmp_path / "results.md"),
                png=str(tmp_path / "plot.png"), cpng=str(tmp_path / "ceil.png"),
                dir=tmp_path, steps={k: str(v) for k, v in steps.items()})


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
    outputs = [files["readme"], files["page"]] + sorted(files["steps"].values())
    assert run_results(files, "--bench", files["bench"], "--no-plot") == 0
    first = digest(outputs)
    assert len(first) == len(outputs)
    assert run_results(files, "--bench", files["bench"], "--no-plot") == 0
    assert digest(outputs) == first
    assert run_results(files, "--bench", files["bench"], "--check") == 0
    with open(files["page"], "a") as f:
        f.write("hand edit\n")
    assert run_results(files, "--bench", files["bench"], "--check") == 1
    assert run_results(files, "--bench", files["bench"], "--no-plot") == 0
    assert digest(outputs) == first
    # A hand edit inside a step's block is out of date too, and the next run undoes it.
    path = files["steps"]["05_split_q"]
    text = open(path).read()
    open(path, "w").write(text.replace("| 1024 |", "| 1024 (edited) |"))
    assert run_results(files, "--bench", files["bench"], "--check") == 1
    assert run_results(files, "--bench", files["bench"], "--no-plot") == 0
    assert digest(outputs) == first


def step_doc():
    """fake_doc with step 04 too, so that 05 has a previous step other than 01."""
    return fake_doc(steps=("01_naive", "04_deferred_rescale", "05_split_q", "07_backward"))


def test_step_readme_blocks(files):
    with open(files["json"], "w") as f:
        json.dump(step_doc(), f)
    assert run_results(files, "--no-plot") == 0
    steps = {name: open(path).read() for name, path in files["steps"].items()}
    # Outside the markers nothing changes; READMEs without markers, or of steps the run did
    # not measure, are left as they were.
    assert steps["06_causal_skip"] == "# no markers\n"
    assert steps["03_loop_swap"] == STEP_README
    for name in ("01_naive", "05_split_q", "07_backward"):
        text = steps[name]
        assert text.startswith("# Step\n\n## Measured\n\n<!-- measured:begin -->\nMeasured on ")
        assert text.endswith("\n<!-- measured:end -->\n\n## The diff\n")
        assert "To be measured" not in text
        assert ("Measured on **NVIDIA Test GPU**, 2026-11-30, commit `0123456789ab`, with "
                "`python3 common/python/compare.py`;") in text
        assert "`python3 common/python/results.py docs/results/nvidia-test-gpu.json`" in text
    # Step 05 (impl index j=2 of fake_doc: tflops 10 + 40j + 5i + 3(d=128) - 7 causal) against
    # 04 (j=1), 01 (j=0) and FLASH (j=4), seqlens 1024, 2048, 4096, 16384 (i = 0..3).
    s05 = steps["05_split_q"]
    assert ("**Forward**, TFLOP/s by sequence length; in brackets, on the same tensors in the "
            "same run: speed-up over `04_deferred_rescale` / speed-up over `01_naive` / ratio "
            "to PyTorch's FLASH backend (FlashAttention-2):") in s05
    assert "| seqlen | d=64 | d=64 causal | d=128 | d=128 causal |" in s05
    assert "**Backward**" not in s05
    assert ("| 1024 | %.1f (%.2fx / %.2fx / %.2fx) |" % (90, 90 / 50, 90 / 10, 90 / 170)) in s05
    row = next(line for line in s05.splitlines() if line.startswith("| 16384 |"))
    # 01 ran out of memory at 16384, d=64: no ratio there, but one at d=128 causal.
    assert row.split(" | ")[1] == "%.1f (%.2fx / - / %.2fx)" % (105, 105 / 65, 105 / 185)
    assert row.split(" | ")[4].rstrip(" |") == "%.1f (%.2fx / %.2fx / %.2fx)" % (
        101, 101 / 61, 101 / 21, 101 / 181)
    # 01: TFLOP/s alone, and the shape that did not run says so.
    s01 = steps["01_naive"]
    assert "**Forward**, TFLOP/s by sequence length:" in s01
    assert "| 16384 | error | error | 28.0 | 21.0 |" in s01
    assert "error: the step did not run at that shape" in s01
    # 07: forward against 05 (the step before it in this run), 01 and FLASH; backward against
    # FLASH only, since no other step of this JSON has a backward.
    s07 = steps["07_backward"]
    assert "speed-up over `05_split_q` / speed-up over `01_naive` / ratio to" in s07
    assert ("**Backward**, TFLOP/s by sequence length; in brackets, on the same tensors in the "
            "same run: ratio to PyTorch's FLASH backend (FlashAttention-2):") in s07
    bwd = s07.split("**Backward**")[1]
    assert "| 2048 | %.1f (%.2fx) |" % (135, 135 / 175) in bwd
    # Seqlens outside 1024..16384 are not shown.
    doc = step_doc()
    doc["results"] = [dict(r, seqlen_q=512, seqlen_k=512) for r in doc["results"]
                      if r["seqlen_q"] == 1024] + doc["results"]
    with open(files["json"], "w") as f:
        json.dump(doc, f)
    assert run_results(files, "--no-plot") == 0
    assert open(files["steps"]["05_split_q"]).read() == s05
    # --no-step-readmes and --no-readme leave them alone; --steps-dir points elsewhere.
    open(files["steps"]["05_split_q"], "w").write(STEP_README)
    assert run_results(files, "--no-plot", "--no-step-readmes") == 0
    assert run_results(files, "--no-plot", "--no-readme") == 0
    assert run_results(files, "--no-plot", "--steps-dir", str(files["dir"] / "none")) == 0
    assert open(files["steps"]["05_split_q"]).read() == STEP_README
    assert run_results(files, "--no-plot", "--steps-dir", str(files["dir"])) == 0
    assert open(files["steps"]["05_split_q"]).read() == s05


def test_step_readme_markers_must_be_whole(files):
    open(files["steps"]["05_split_q"], "w").write("# Step\n<!-- measured:begin -->\n")
    with pytest.raises(SystemExit, match="measured:end"):
        run_results(files, "--no-plot")
    open(files["steps"]["05_split_q"], "w").write(
        "<!-- measured:end -->\n<!-- measured:begin -->\n")
    with pytest.raises(SystemExit, match="05_split_q"):
        run_results(files, "--no-plot")


def test_step_readme_of_a_merged_run(files):
    doc = step_doc()
    doc["runs"] = [dict(doc["run"]), dict(doc["run"], commit="fedcba9876543210",
                                          date="2026-12-01T10:00:00Z", dirty=True)]
    doc["complete"] = False
    with open(files["json"], "w") as f:
        json.dump(doc, f)
    assert run_results(files, "--no-plot") == 0
    text = open(files["steps"]["05_split_q"]).read()
    assert ("Measured on **NVIDIA Test GPU**, 2026-11-30 to 2026-12-01, commits `0123456789ab`, "
            "`fedcba987654` (with local changes), with `python3 common/python/compare.py` "
            "(the last of 2 merged runs);") in text
    assert "**Incomplete run.**" in text


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
