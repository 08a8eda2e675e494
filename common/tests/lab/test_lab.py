#!/usr/bin/env python3
"""Tests of the course-lab path (common/scripts/lab.py). Standard library only.

    python3 common/tests/lab/test_lab.py LabHostTests -v   # no GPU needed (ctest host.lab)
    python3 common/tests/lab/test_lab.py LabGpuTests -v    # needs a GPU (ctest gpu.lab)

Every lab and build folder lives in a temporary directory; the repository's labs/ and build/
are not touched. FA_LAB_TEST_CUDA_ARCH (e.g. 80) is the CUDA architecture the test builds for
(default: CMake's choice for this machine).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LAB = ROOT / "common" / "scripts" / "lab.py"

# The planted bug: 01_naive's softmax forgets to subtract the row maximum in the row sum, so
# P is off by exp(-row_max) and L by row_max (the "missing rescale" of the standard softmax).
BUG_FILE = "kernel.cu"
BUG_FROM = "row_sum += __expf(s_row[j] - row_max);"
BUG_TO = "row_sum += __expf(s_row[j]);"


def load_lab_module():
    spec = importlib.util.spec_from_file_location("lab", LAB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cmake_args():
    args = ["-DFA_ONLY_STEPS=01_naive", "-DFA_BUILD_DOCS=OFF"]
    arch = os.environ.get("FA_LAB_TEST_CUDA_ARCH")
    if arch:
        args.append(f"-DCMAKE_CUDA_ARCHITECTURES={arch}")
    return args


def lab(*args, cwd=None):
    """Runs lab.py; returns (status, stdout + stderr)."""
    proc = subprocess.run([sys.executable, str(LAB), *[str(a) for a in args]], cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout


def gpu_present():
    if not shutil.which("nvidia-smi"):
        return False
    proc = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True)
    return proc.returncode == 0 and "GPU " in proc.stdout


class LabHostTests(unittest.TestCase):
    """lab.py start, its checks, and the report's parsing; configures but builds nothing."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = Path(tempfile.mkdtemp(prefix="fa_lab_host_"))
        cls.labs = cls.tmp / "labs"
        cls.build = cls.tmp / "build"

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def start(self, *args):
        return lab("start", *args, "--dir", self.labs, "--build", self.build, "--",
                   *cmake_args(), "-DFA_BUILD_TESTS=OFF")

    def test_1_start_copies_the_previous_step_and_configures(self):
        status, out = self.start("02_tiled_fa1")
        self.assertEqual(status, 0, out)
        lab_dir = self.labs / "lab_02_tiled_fa1"
        # The kernel is the previous step's, byte for byte: the step's name comes from CMake.
        self.assertEqual((lab_dir / "kernel.cu").read_bytes(),
                         (ROOT / "01_naive" / "kernel.cu").read_bytes())
        self.assertIn("fa_add_step(lab_02_tiled_fa1)", (lab_dir / "CMakeLists.txt").read_text())
        self.assertEqual(json.loads((lab_dir / "lab.json").read_text())["source"], "01_naive")
        self.assertFalse(list(lab_dir.glob("*.md")), "the lesson (README) is not copied")
        cache = (self.build / "CMakeCache.txt").read_text()
        self.assertRegex(cache, r"FA_LAB_DIRS:STRING=.*lab_02_tiled_fa1")
        registry = (self.build / "generated" / "fa_registry.cpp").read_text()
        self.assertIn("&fa_step_01_naive,\n    &fa_step_lab_02_tiled_fa1,", registry,
                      "the lab is registered after the real steps")
        self.assertIn("Next:", out)
        self.assertIn("lab.py grade lab_02_tiled_fa1", out)

    def test_2_a_second_lab_keeps_the_first(self):
        status, out = self.start("02", "--name", "second")
        self.assertEqual(status, 0, out)
        cache = (self.build / "CMakeCache.txt").read_text()
        self.assertRegex(cache, r"FA_LAB_DIRS:STRING=.*lab_02_tiled_fa1;.*second")
        status, out = lab("list", "--build", self.build)
        self.assertIn("lab_02_tiled_fa1", out)
        self.assertIn("second", out)

    def test_3_mistakes_get_one_clear_line(self):
        cases = [
            (("01_naive",), "first step"),
            (("99_nope",), "unknown step"),
            (("02", "--name", "9lives"), "not valid"),
            (("02", "--name", "my-lab"), "not valid"),
            (("02", "--name", "bench"), "taken"),
            (("02", "--name", "fa_mine"), "taken"),
            (("02", "--name", "lab_02_tiled_fa1"), "already exists"),
            (("02", "--name", "second_try"), "prefix"),
        ]
        for args, needle in cases:
            status, out = self.start(*args)
            self.assertEqual(status, 2, f"{args}: {out}")
            self.assertIn(needle, out, args)
            self.assertEqual(len(out.strip().splitlines()), 1, out)

    def test_4_grade_without_a_gpu_says_so_in_one_line(self):
        if gpu_present():
            self.skipTest("a GPU is present (LabGpuTests grades for real)")
        status, out = lab("grade", "lab_02_tiled_fa1", "--build", self.build)
        self.assertNotEqual(status, 0)
        self.assertEqual(len(out.strip().splitlines()), 1, out)
        self.assertIn("no CUDA GPU", out)

    def test_5_report_points_at_the_error(self):
        m = load_lab_module()
        failure = ("/src/common/tests/gpu/test_conformance.cpp:95\nValue of: r.ok\n  Actual: false\n"
                   "Expected: true\nB=1 H=3/1 Nq=257 Nk=257 d=64 fp16 causal seed 42: FAIL  O max|err| "
                   "3.1e-01 rel 2.0e-01  lse max|err| 1.2e+00 rel 3.0e-01  (O out of bounds: "
                   "max|out-ref| 3.1e-01 (bound 3.9e-03)  rel_l2 2.0e-01 (bound 9.8e-04) at "
                   "O[batch 0, head 2, row 256, col 7] = 0.12 (expected 0.43); lse out of bounds: "
                   "max|out-ref| 1.2e+00 (bound 1.0e-04)  rel_l2 3.0e-01 (bound 1.0e-04) at "
                   "lse[batch 0, head 0, row 3] = 2.1 (expected 0.9))")
        info = m.explain_failure(failure)
        self.assertEqual(info["shape"], "B=1 H=3/1 Nq=257 Nk=257 d=64 fp16 causal")
        self.assertEqual(info["seed"], "42")
        self.assertEqual(info["quantity"], "O")
        self.assertTrue(info["error"].startswith("max|out-ref| 3.1e-01 (bound 3.9e-03)"), info)
        self.assertEqual(info["where"], "O[batch 0, head 2, row 256, col 7] = 0.12 (expected 0.43)")

        random_failure = (
            "/src/common/tests/gpu/test_random.cpp:330\nFailed\nx forward, problem 3 of 200, seed 77:\n"
            "  B=2 H=4/2 Nq=65 Nk=4093 d=128 bf16 causal scale=0.0883883 magnitude=1 layout=padded"
            " rows=all\n  dQ out of bounds: max|out-ref| 1.0e+00 (bound 1.2e-01)  rel_l2 9.0e-01 "
            "(bound 3.1e-02) at dQ[batch 1, head 3, row 64, col 0] = nan (expected 0.25)\n"
            "  all: FAIL ...\n  reproduce: FA_RANDOM_SEED=77 FA_RANDOM_PROBLEMS=1 ./build/bin/"
            "fa_gpu_tests --gtest_filter='Random/RandomConformance.Problems/x_bwd'")
        info = m.explain_failure(random_failure)
        self.assertEqual(info["quantity"], "dQ")
        self.assertEqual(info["seed"], "77")
        self.assertIn("dQ[batch 1, head 3, row 64, col 0] = nan", info["where"])
        self.assertIn("FA_RANDOM_SEED=77", info["reproduce"])
        self.assertIn("Nq=65 Nk=4093", info["shape"])

        report = {"testsuites": [
            {"name": "Steps/ForwardConformance", "testsuite": [
                {"name": "MatchesOracleOnAllRows/x_fp16_d64_full_even", "result": "COMPLETED"},
                {"name": "MatchesOracleOnAllRows/x_fp16_d64_causal_odd_mqa", "result": "COMPLETED",
                 "failures": [{"failure": failure}]}]},
            {"name": "Steps/EdgeCases", "testsuite": [
                {"name": "SeqlenKOne/x", "result": "COMPLETED"}]},
            {"name": "Random/RandomConformance", "testsuite": [
                {"name": "Problems/x_fwd", "result": "COMPLETED", "problems": "200",
                 "failed": "1", "first_seed": "5", "failures": [{"failure": random_failure}]}]}]}
        groups, failures, random_rows = m.summarize_tests(report)
        self.assertEqual(groups["forward matrix"], [1, 1, 0])
        self.assertEqual(groups["edge cases"], [1, 0, 0])
        self.assertEqual(random_rows, [("random forward", 200, 1, "5", 0)])
        self.assertEqual(failures[0][0],
                         "Steps/ForwardConformance.MatchesOracleOnAllRows/x_fp16_d64_causal_odd_mqa")
        self.assertEqual(m.test_filter("x"), "*/x:*/x_fp16_*:*/x_bf16_*:*/x_fwd:*/x_bwd")
        self.assertEqual(m.test_filter("x", quick=True),
                         "*/x:*/x_fp16_*:*/x_fwd:*/x_bwd-*LongSequences*:*LargestGrid*")


class LabGpuTests(unittest.TestCase):
    """A lab left unchanged passes as its source step; a planted bug fails, pointing at it."""

    def setUp(self):
        if not gpu_present():
            self.skipTest("No CUDA device (nvidia-smi lists none)")
        self.tmp = Path(tempfile.mkdtemp(prefix="fa_lab_gpu_"))

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_unchanged_lab_passes_and_planted_bug_fails(self):
        labs, build = self.tmp / "labs", self.tmp / "build"
        for name in ("labcopy", "labbug"):
            status, out = lab("start", "02", "--name", name, "--dir", labs, "--build", build,
                              "--", *cmake_args())
            self.assertEqual(status, 0, out)
        kernel = labs / "labbug" / BUG_FILE
        text = kernel.read_text()
        self.assertEqual(text.count(BUG_FROM), 1,
                         f"the planted bug's line is gone from 01_naive/{BUG_FILE}: update BUG_FROM")
        kernel.write_text(text.replace(BUG_FROM, BUG_TO))

        # Unchanged: passes (with a small bench, to run the whole path once).
        status, out = lab("grade", "labcopy", "--build", build, "--reference", "01_naive",
                          "--problems", "12", "--quick", "--seqlens", "512", "--head-dims", "64",
                          "--repeats", "3")
        print(out)
        self.assertEqual(status, 0, out)
        self.assertIn("Result: PASS", out)
        self.assertRegex(out, r"labcopy is \d+\.\d+x the speed of 01_naive")

        # Planted bug: fails, and the report names the quantity and where its largest error is.
        status, out = lab("grade", "labbug", "--build", build, "--reference", "01_naive",
                          "--problems", "12", "--quick", "--no-bench")
        print(out)
        self.assertNotEqual(status, 0, out)
        self.assertIn("Result: FAIL", out)
        self.assertIn("First failure:", out)
        self.assertRegex(out, r"largest error: (O|lse|dQ|dK|dV): max\|out-ref\|")
        self.assertRegex(out, r"where: +(O|lse|dQ|dK|dV)\[batch \d+, head \d+, row \d+")


if __name__ == "__main__":
    unittest.main()
