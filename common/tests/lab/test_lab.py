#!/usr/bin/env python3
"""Tests of the course-lab path (common/scripts/lab.py). Standard library only.

    python3 common/tests/lab/test_lab.py LabHostTests -v   # no GPU needed (ctest host.lab)
    python3 common/tests/lab/test_lab.py LabGpuTests -v    # needs a GPU (ctest gpu.lab)

LabHostTests: `start` (copies, names, registration), the planted bugs still apply to the
reference code, every step has a lab, the speed check's arithmetic, the report's parsing, the
docs filter and a course pack's contents. LabGpuTests grades, in one build and one `grade`
run, every lab three ways: left unchanged (it must fail: the idea is missing), the reference
copied in (it must pass) and every planted bug (it must fail, naming the expected quantity).

Every lab and build folder lives in a temporary directory; the repository's labs/ and build/
are not touched. Under ctest, FA_LAB_TEST_WORKDIR (build/common/tests/gpu_lab) keeps the GPU
test's labs and build between runs instead, so that a second run rebuilds only what changed. FA_LAB_TEST_CUDA_ARCH (e.g. 90) is the CUDA architecture the GPU test builds
for (default: CMake's choice for this machine); FA_LAB_TEST_KEEP=1 keeps its folder;
FA_LAB_TEST_STEPS (e.g. "03,04") grades the labs of those steps only (default, or "all": every
lab whose step and starting step are in the tree).
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LAB = ROOT / "common" / "scripts" / "lab.py"
IS_PACK = (ROOT / "common" / "labs" / "pack.json").exists()


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cmake_args(only="01_naive"):
    args = [f"-DFA_ONLY_STEPS={only}", "-DFA_BUILD_DOCS=OFF"]
    arch = os.environ.get("FA_LAB_TEST_CUDA_ARCH")
    if arch:
        args.append(f"-DCMAKE_CUDA_ARCHITECTURES={arch}")
    return args


def lab(*args, cwd=None, script=LAB):
    """Runs lab.py; returns (status, stdout + stderr)."""
    proc = subprocess.run([sys.executable, str(script), *[str(a) for a in args]], cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout


def gpu_present():
    if not shutil.which("nvidia-smi"):
        return False
    proc = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True)
    return proc.returncode == 0 and "GPU " in proc.stdout


def sync_tree(src, dst):
    """Makes dst hold exactly src's files, rewriting only those whose bytes differ (with a new
    modification time, so that the build sees them change); unchanged files keep theirs."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(exist_ok=True)
        elif not target.is_file() or target.read_bytes() != path.read_bytes():
            shutil.copyfile(path, target)
    for path in sorted(dst.rglob("*"), reverse=True):  # what src no longer has
        if not (src / path.relative_to(dst)).exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()


class LabHostTests(unittest.TestCase):
    """lab.py start, its checks, bugs, the speed arithmetic, packs; builds nothing."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = Path(tempfile.mkdtemp(prefix="fa_lab_host_"))
        cls.labs = cls.tmp / "labs"
        cls.build = cls.tmp / "build"
        cls.m = load_module(LAB, "lab")

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
        meta = json.loads((lab_dir / "lab.json").read_text())
        self.assertEqual((meta["source"], meta["variant"]), ("01_naive", "student"))
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
            (("02", "--bug", "no_such_bug"), "no planted bug"),
            (("02", "--reference", "--bug", "x"), "exclude each other"),
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

    def test_4b_grade_refuses_fewer_random_problems_than_coverage_classes(self):
        # Before any build or GPU work: the suite would refuse them and fail every lab alike.
        status, out = lab("grade", "lab_02_tiled_fa1", "--build", self.build, "--problems", "8")
        self.assertEqual(status, 2, out)
        self.assertEqual(len(out.strip().splitlines()), 1, out)
        self.assertIn("at least 10", out)

    def test_5_report_points_at_the_error(self):
        m = self.m
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
        self.assertEqual(m.failing_quantities(failures), {"O": 1, "lse": 1, "dQ": 1})
        self.assertEqual(m.test_filter("x"), "*/x:*/x_fp16_*:*/x_bf16_*:*/x_fwd:*/x_bwd")
        self.assertEqual(m.test_filter("x", quick=True),
                         "*/x:*/x_fp16_*:*/x_fwd:*/x_bwd-*LongSequences*:*LargestGrid*")

    def test_6_every_step_has_a_lab_and_the_parents_branch(self):
        m = self.m
        defs = m.lab_defs()
        steps = m.known_steps()
        for step in steps[1:]:
            if not m.step_present(step) and not IS_PACK:
                continue
            self.assertIn(step, defs, f"{step} has no lab: write common/labs/{step}.json")
            self.assertTrue((ROOT / "docs" / f"lab_{step[:2]}.md").exists(),
                            f"{step} has no handout docs/lab_{step[:2]}.md")
        for step, d in defs.items():
            speed = d["speed"]
            self.assertIn(speed.get("direction", "fwd"), ("fwd", "bwd"), step)
            self.assertTrue(speed["shapes"] and speed.get("why"), step)
            for s in speed["shapes"]:
                shape = m.parse_shape(s)
                self.assertTrue(shape["heads"] % shape["heads_kv"] == 0, (step, s))
            self.assertIn(speed.get("baseline") or m.parent_of(step, steps), steps, step)
            if not IS_PACK:  # the instructor folder is not in a pack
                self.assertTrue(m.load_bugs(step), f"{step}: no planted bugs in "
                                f"common/labs/instructor/bugs/{step}.json")
        fake = ["01_naive", "02_a", "05_b", "06_causal_skip", "07_backward", "08_split_kv",
                "09_hopper_wgmma", "10_hopper_pingpong"]
        self.assertEqual([m.parent_of(s, fake) for s in fake[1:]],
                         ["01_naive", "02_a", "05_b", "06_causal_skip", "06_causal_skip",
                          "06_causal_skip", "09_hopper_wgmma"])

    def test_7_planted_bugs_apply_to_the_reference_code(self):
        if IS_PACK:
            self.skipTest("course pack: no instructor folder")
        self.assertEqual(self.m.check_bugs(), [],
                         "a planted bug's anchor is gone from its reference step (re-cut?): "
                         "update common/labs/instructor/bugs/<step>.json")
        for path in sorted((ROOT / "common" / "labs" / "instructor" / "bugs").glob("*.json")):
            for bug in self.m.load_bugs(path.stem):
                self.assertRegex(bug["expect"], r"^(speed|(O|lse|dQ|dK|dV)(\|(O|lse|dQ|dK|dV))*)$")
                self.assertTrue(bug["why"], bug["name"])
        with self.assertRaisesRegex(self.m.LabError, "occurs 2 times"):
            self.m.plant("a a", {"name": "x", "edits": [{"find": "a", "replace": "b"}]})
        with self.assertRaisesRegex(self.m.LabError, "occurs 0 times"):
            self.m.plant("a", {"name": "x", "edits": [{"find": "c", "replace": "b"}]})

    def test_8_start_reference_and_bug(self):
        if IS_PACK:
            self.skipTest("course pack: no reference steps for its labs")
        status, out = lab("start", "06", "--reference", "--no-configure", "--dir", self.labs,
                          "--build", self.build)
        self.assertEqual(status, 0, out)
        self.assertEqual((self.labs / "ref_06_causal_skip" / "kernel.cu").read_bytes(),
                         (ROOT / "06_causal_skip" / "kernel.cu").read_bytes())
        bug = self.m.load_bugs("06_causal_skip")[0]
        status, out = lab("start", "06", "--bug", bug["name"], "--no-configure", "--dir",
                          self.labs, "--build", self.build)
        self.assertEqual(status, 0, out)
        text = (self.labs / f"bug_06_{bug['name']}" / "kernel.cu").read_text()
        self.assertIn(bug["edits"][0]["replace"], text)
        self.assertNotIn(bug["edits"][0]["find"], text)
        meta = json.loads((self.labs / f"bug_06_{bug['name']}" / "lab.json").read_text())
        self.assertEqual(meta["variant"], f"bug:{bug['name']}")
        # A Hopper lab gets its step's SASS check (HGMMA, no HMMA) under the lab's name; a
        # step without one gives its lab none.
        status, out = lab("start", "09", "--name", "lab_09_sass", "--no-configure", "--dir",
                          self.labs, "--build", self.build)
        self.assertEqual(status, 0, out)
        cmake = (self.labs / "lab_09_sass" / "CMakeLists.txt").read_text()
        self.assertIn("fa_add_step(lab_09_sass ARCH 90a)", cmake)
        self.assertIn("fa_add_sass_check(lab_09_sass REQUIRE HGMMA", cmake)
        self.assertIn("FORBID HMMA)", cmake)
        # 10's check carries its order rule (quoted arguments with spaces) word for word.
        status, out = lab("start", "10", "--name", "lab_10_sass", "--no-configure", "--dir",
                          self.labs, "--build", self.build)
        self.assertEqual(status, 0, out)
        cmake = (self.labs / "lab_10_sass" / "CMakeLists.txt").read_text()
        self.assertIn('fa_add_sass_check(lab_10_sass REQUIRE HGMMA UTMALDG UTMASTG SYNCS FORBID HMMA '
                      'BETWEEN "WARPGROUP.DEPBAR.LE gsb0, 0x1" "WARPGROUP.DEPBAR.LE gsb0, 0x0" '
                      'MUFU.EX2 64)', cmake)
        self.assertNotIn("fa_add_sass_check", (self.labs / "ref_06_causal_skip" /
                                               "CMakeLists.txt").read_text())

    def test_9_speed_check(self):
        m = self.m
        shapes = ["4,32,32,4096,4096,64,1", "4,16,16,4096,4096,128,1"]
        keys = [m.shape_key(m.parse_shape(s)) for s in shapes]

        def table(base, lab, ref, wrong=False):
            return {k: {"base": {"ms": base, "error": "", "wrong": False},
                        "lab": {"ms": lab, "error": "", "wrong": wrong},
                        "ref": {"ms": ref, "error": "", "wrong": False}} for k in keys}

        v = m.speed_verdict(table(2.0, 2.0, 1.0), "lab", "base", "ref", shapes)  # unchanged
        self.assertTrue(v["graded"])
        self.assertFalse(v["passed"])
        self.assertAlmostEqual(v["mark"], 2 ** 0.5)
        v = m.speed_verdict(table(2.0, 1.02, 1.0), "lab", "base", "ref", shapes)  # the reference
        self.assertTrue(v["passed"])
        v = m.speed_verdict(table(2.0, 1.35, 1.0), "lab", "base", "ref", shapes)  # nearer ref
        self.assertTrue(v["passed"])
        v = m.speed_verdict(table(2.0, 1.5, 1.0), "lab", "base", "ref", shapes)  # nearer base
        self.assertFalse(v["passed"])
        v = m.speed_verdict(table(2.0, 0.5, 1.0, wrong=True), "lab", "base", "ref", shapes)
        self.assertFalse(v["passed"])
        self.assertIn("wrong at the timing shape", v["note"])
        v = m.speed_verdict(table(1.0, 1.0, 0.97), "lab", "base", "ref", shapes)  # no signal
        self.assertFalse(v["graded"])
        self.assertIn("cannot tell", v["note"])
        t = table(2.0, 1.0, 0)  # no reference in this build: the recorded figure stands in
        v = m.speed_verdict(t, "lab", "base", "ref", shapes, recorded=(2.0, "NVIDIA H200"))
        self.assertTrue(v["passed"])
        self.assertIn("H200", v["ref_source"])
        v = m.speed_verdict(t, "lab", "base", "ref", shapes)
        self.assertFalse(v["graded"])

        rows = []
        for rnd, (a, b) in enumerate([(2.0, 1.0), (2.2, 1.1), (1.9, 0.9)]):
            for step, ms in (("base", a), ("lab", b)):
                rows.append({"step": step, "batch": 4, "heads": 32, "heads_kv": 32,
                             "seqlen_q": 4096, "seqlen_k": 4096, "head_dim": 64, "causal": True,
                             "median_ms": ms, "checked": rnd == 0, "passed": True, "error": ""})
        agg = m.aggregate_timing(rows)
        self.assertEqual(agg[keys[0]]["base"]["ms"], 2.0)
        self.assertEqual(agg[keys[0]]["lab"]["ms"], 1.0)
        # The recorded figures of the reference GPU (docs/results) cover every lab's shapes
        # from 02 to 07, so that a course pack can grade without the reference.
        if not IS_PACK:
            for step in ("02_tiled_fa1", "03_loop_swap", "04_deferred_rescale", "05_split_q",
                         "06_causal_skip", "07_backward"):
                d = m.lab_defs().get(step)
                if d is None:
                    continue
                speed = d["speed"]
                base = speed.get("baseline") or m.parent_of(step, m.known_steps())
                got = m.recorded_gain(base, step, speed.get("direction", "fwd"), speed["shapes"])
                self.assertIsNotNone(got, f"{step}: no recorded figure at its shapes")
                self.assertGreater(got[0], 1.10, step)

    def test_recorded_gain_goes_stale_when_a_step_changes(self):
        """A gain recorded on the reference GPU stands in for a reference a pack leaves out, but
        only while the code of neither step's kernel.cu changed after the commit that measured
        it (a comment edit, or the same code wrapped otherwise, keeps it)."""
        m = self.m
        root = self.tmp / "stale_repo"
        (root / "docs" / "results").mkdir(parents=True)
        env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
                   GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")

        def git(*args):
            return subprocess.run(["git", "-C", str(root), *args], env=env, check=True,
                                  stdout=subprocess.PIPE, text=True).stdout.strip()

        git("init", "-q")
        for step in ("01_a", "02_b"):
            (root / step).mkdir()
            (root / step / "kernel.cu").write_text("// v1\nint f(int a, int b) { return a + b; }\n")
        git("add", "-A")
        git("commit", "-q", "-m", "v1")
        measured = git("rev-parse", "--short=12", "HEAD")
        shape = "4,32,32,4096,4096,64,0"
        rows = [dict(m.parse_shape(shape), step=s, direction="fwd", dtype="fp16", median_ms=ms)
                for s, ms in (("01_a", 2.0), ("02_b", 1.0))]
        (root / "docs" / "results" / "gpu_bench.json").write_text(json.dumps(
            {"gpu": {"name": "Fake GPU"}, "run": {"commit": measured}, "results": rows}))
        got = m.recorded_gain("01_a", "02_b", "fwd", [shape], root)
        self.assertAlmostEqual(got[0], 2.0)
        self.assertEqual(m.recorded_is_stale("01_a", "02_b", "fwd", [shape], root), "")
        (root / "README.md").write_text("other files may change\n")
        git("add", "-A")
        git("commit", "-q", "-m", "docs")
        self.assertEqual(m.recorded_is_stale("01_a", "02_b", "fwd", [shape], root), "")
        (root / "02_b" / "kernel.cu").write_text(
            "/// v1, explained\n/* at length */ int f(int a,\n      int b) {  // wrapped\n"
            "  return a + b;\n}\n")
        git("commit", "-q", "-am", "comments and wrapping")
        self.assertEqual(m.recorded_is_stale("01_a", "02_b", "fwd", [shape], root), "")
        (root / "02_b" / "kernel.cu").write_text("// v2\nint f(int a, int b) { return a - b; }\n")
        git("commit", "-q", "-am", "v2")
        self.assertIn("code of 01_a or 02_b changed after",
                      m.recorded_is_stale("01_a", "02_b", "fwd", [shape], root))
        doc = json.loads((root / "docs" / "results" / "gpu_bench.json").read_text())
        doc["run"]["commit"] = "0123456789ab"
        (root / "docs" / "results" / "gpu_bench.json").write_text(json.dumps(doc))
        self.assertIn("not in this history",
                      m.recorded_is_stale("01_a", "02_b", "fwd", [shape], root))

    def test_recorded_gain_reads_the_current_bench_run_first(self):
        """A run kept beside the current one (an older pair, a variant probe) may sort first by
        name; the current `<gpu>_bench.json` is still the one read."""
        m = self.m
        root = self.tmp / "kept_runs"
        (root / "docs" / "results").mkdir(parents=True)
        shape = "4,32,32,4096,4096,64,0"

        def write(name, ms_b, commit):
            rows = [dict(m.parse_shape(shape), step=s, direction="fwd", dtype="fp16", median_ms=ms)
                    for s, ms in (("01_a", 2.0), ("02_b", ms_b))]
            (root / "docs" / "results" / name).write_text(json.dumps(
                {"gpu": {"name": "Fake GPU"}, "run": {"commit": commit}, "results": rows}))

        write("gpu_2old_bench.json", 2.0, "aaaa")  # sorts before gpu_bench.json
        write("gpu_bench.json", 0.5, "bbbb")
        write("gpu_x_variant.json", 4.0, "cccc")
        got = m.recorded_gain("01_a", "02_b", "fwd", [shape], root)
        self.assertAlmostEqual(got[0], 4.0)
        self.assertEqual(got[2], "bbbb")
        (root / "docs" / "results" / "gpu_bench.json").unlink()  # no current run: the kept ones
        self.assertEqual(m.recorded_gain("01_a", "02_b", "fwd", [shape], root)[2], "aaaa")

    def test_figures_page_quotes_the_bench_report_read_first(self):
        """The instructor's figures.md quotes the bench report that the recorded gains come
        from (bench_reports' first), not the one that sorts first by name."""
        m = self.m
        page = m.ROOT / "common" / "labs" / "instructor" / "figures.md"
        reports = m.bench_reports()
        if not page.exists() or not reports:
            self.skipTest("no figures page or no bench report here")
        first = reports[0][0].relative_to(m.ROOT).as_posix()
        header = page.read_text().split("\n")[2]
        self.assertIn(f"from `{first}`", header)

    def test_grade_flow_with_fake_tools(self):
        """lab.py grade from end to end on stand-ins for nvidia-smi, cmake, the GPU test
        program and the timer: an unchanged lab fails the speed check, the reference passes,
        a bug fails naming its quantity, a fast and correct lab whose machine code fails its
        step's host.sass check fails naming it, and the summary JSON says so."""
        tmp = self.tmp / "fake"
        bindir, build = tmp / "path", tmp / "build"
        (build / "bin").mkdir(parents=True)
        bindir.mkdir()

        def tool(path, body):
            path.write_text(f"#!{sys.executable}\nimport json, sys\nargs = sys.argv[1:]\n{body}")
            path.chmod(0o755)

        tool(bindir / "nvidia-smi", "print('GPU 0: Fake GPU (UUID: x)')\n")
        tool(bindir / "cmake", "sys.exit(0)\n")
        # host.sass.<lab>: r06 has a check that passes, s06 one that fails, b06 one that cannot
        # run (no cuobjdump: not counted), u06 none.
        tool(bindir / "ctest", """
name = args[args.index('-R') + 1].split('sass\\\\.')[1].rstrip('$')
if name not in ('r06', 's06', 'b06'):  # as ctest: a failure only when asked to make it one
    print('No tests were found!!!')
    sys.exit(8 if '--no-tests=error' in args else 0)
if name == 'b06':
    print('CMake Error at CheckSass.cmake:11 (message):')
    print('  cuobjdump not found: it ships in the CUDA toolkit')
    sys.exit(8)
if name == 's06':
    print('CMake Error at CheckSass.cmake:61 (message):')
    print("  libfa_step_s06.a: 2 MUFU.EX2 from 'WARPGROUP.DEPBAR.LE gsb0,")
    print("  0x1' to 'X' (at least 64)")
    print('')
    print('CMake Error at CheckSass.cmake:73 (message):')
    print('  SASS check failed')
    sys.exit(8)
""")
        m = self.m
        defs = m.lab_defs()  # a forward lab of this tree (a pack has fewer)
        target = [s for s in sorted(defs) if defs[s]["speed"].get("direction", "fwd") == "fwd"][-1]
        base = m.lab_defs()[target]["speed"].get("baseline") or m.parent_of(target,
                                                                             m.known_steps())
        steps = [base, target, "u06", "r06", "b06", "s06"]
        failure = ("B=1 H=3/1 Nq=257 Nk=257 d=64 fp16 causal seed 4: FAIL (O out of bounds: "
                   "max|out-ref| 3.1e-01 (bound 3.9e-03)  rel_l2 2.0e-01 (bound 9.8e-04) at "
                   "O[batch 0, head 2, row 256, col 7] = 0.12 (expected 0.43))")
        tool(build / "bin" / "fa_gpu_tests", f"""
flt = [a for a in args if a.startswith('--gtest_filter=')][0]
if '--gtest_list_tests' in args:
    if 'EdgeCases' in flt:
        print('Steps/EdgeCases.')
        for s in {steps!r}:
            print('  SeqlenKOne/' + s)
    sys.exit(0)
out = [a for a in args if a.startswith('--gtest_output=json:')][0].split(':', 1)[1]
name = flt.split('=')[1].split(':')[0][2:]
case = {{'name': 'MatchesOracleOnAllRows/' + name + '_fp16_d64_causal_odd_mqa', 'result': 'COMPLETED'}}
if name.startswith('b'):
    case['failures'] = [{{'failure': {failure!r}}}]
json.dump({{'testsuites': [{{'name': 'Steps/ForwardConformance', 'testsuite': [case]}}]}},
          open(out, 'w'))
""")
        tool(build / "bin" / "fa_lab_timing", f"ms = {{{base!r}: 2.0, {target!r}: 1.0}}\n" + """
ms.update({'u06': 2.02, 'r06': 0.99, 's06': 0.99})
val = lambda f: args[args.index(f) + 1]
shapes = [args[i + 1] for i, a in enumerate(args) if a == '--shape']
rows = []
for s in shapes:
    b, h, hkv, nq, nk, d, c = (int(v) for v in s.split(','))
    for rnd in range(int(val('--rounds'))):
        for step in val('--steps').split(','):
            rows.append({'step': step, 'direction': val('--direction'), 'batch': b, 'heads': h,
                         'heads_kv': hkv, 'seqlen_q': nq, 'seqlen_k': nk, 'head_dim': d,
                         'causal': bool(c), 'median_ms': ms[step] * (1 + 0.01 * rnd),
                         'checked': rnd == 0, 'passed': True, 'error': ''})
json.dump({'gpu': {'name': 'Fake GPU'}, 'results': rows}, open(val('--out'), 'w'))
""")
        dirs = []
        for name, variant in (("u06", "student"), ("r06", "reference"), ("b06", "bug:x"),
                              ("s06", "student")):
            d = tmp / "labs" / name
            d.mkdir(parents=True)
            (d / "CMakeLists.txt").write_text(f"fa_add_step({name})\n")
            (d / "lab.json").write_text(json.dumps({"name": name, "target": target,
                                                    "source": base, "variant": variant}))
            dirs.append(str(d))
        (build / "CMakeCache.txt").write_text(f"FA_LAB_DIRS:STRING={';'.join(dirs)}\n")
        env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
        summary = tmp / "grades.json"
        proc = subprocess.run([sys.executable, str(LAB), "grade", "u06", "r06", "b06", "s06", "--build",
                               str(build), "--out", str(tmp / "out"), "--json", str(summary)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if os.environ.get("FA_LAB_TEST_VERBOSE"):
            print(proc.stdout)
        self.assertEqual(proc.returncode, 1, proc.stdout)
        got = {e["name"]: e for e in json.loads(summary.read_text())}
        self.assertEqual({n: e["result"] for n, e in got.items()},
                         {"u06": "FAIL", "r06": "PASS", "b06": "FAIL", "s06": "FAIL"},
                         proc.stdout)
        self.assertTrue(got["u06"]["correct"])
        self.assertFalse(got["u06"]["speed"]["passed"])
        self.assertAlmostEqual(got["u06"]["speed"]["ref_gain"], 2.0, places=2)
        self.assertTrue(got["r06"]["speed"]["passed"])
        self.assertEqual(got["b06"]["first_failure"]["quantity"], "O")
        self.assertEqual(got["b06"]["quantities"], {"O": 1})
        self.assertIn("the idea is missing", proc.stdout)
        self.assertIn("where:   O[batch 0, head 2, row 256, col 7]", proc.stdout)
        self.assertIn("Speed: not measured: correctness first", proc.stdout)
        self.assertTrue(got["s06"]["correct"])
        self.assertTrue(got["s06"]["speed"]["passed"])
        self.assertEqual(got["s06"]["sass"]["passed"], False)
        self.assertEqual(got["s06"]["sass"]["why"], "libfa_step_s06.a: 2 MUFU.EX2 from "
                         "'WARPGROUP.DEPBAR.LE gsb0, 0x1' to 'X' (at least 64)")
        self.assertIn("Machine code (host.sass.s06", proc.stdout)
        self.assertIn("the machine code lacks the step's idea", proc.stdout)
        self.assertEqual(got["r06"]["sass"], {"passed": True, "why": ""})
        self.assertIsNone(got["u06"]["sass"])
        self.assertIsNone(got["b06"]["sass"]["passed"])
        self.assertIn("not checked: cuobjdump is not installed", proc.stdout)

    def test_docs_filter(self):
        flt = load_module(ROOT / "docs" / "doc_filter.py", "doc_filter")
        root = self.tmp / "tree"
        for d in ("01_naive", "docs"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "01_naive" / "README.md").write_text("# x\n")
        (root / "docs" / "lab_02.md").write_text("# y\n")
        page = root / "README.md"
        text = ("| step | x |\n|---|---|\n"
                "| [01_naive](01_naive/README.md) | a |\n"
                "| [02_tiled_fa1](02_tiled_fa1/README.md) | b |\n"
                "| 03_loop_swap | c |\n"
                "| @ref lab_02 | d |\n| @ref lab_03 | e |\n"
                "See @ref step01 and @ref step05, [the lab](docs/lab_04.md), "
                "[a page](https://example.com/x.md), ![plot](docs/missing.png)\n"
                "```\n[02](02_tiled_fa1/README.md)\n```\n")
        out = flt.filter_markdown(text, page, root)
        self.assertIn("| [01_naive](01_naive/README.md) | a |", out)
        self.assertNotIn("| [02_tiled_fa1]", out)
        self.assertNotIn("03_loop_swap", out)
        self.assertIn("| @ref lab_02 | d |", out)
        self.assertNotIn("lab_03", out)
        self.assertIn("See @ref step01 and step 05, the lab, [a page](https://example.com/x.md), \n",
                      out)
        self.assertIn("```\n[02](02_tiled_fa1/README.md)\n```", out, "code blocks are left alone")
        self.assertEqual(flt.filter_markdown(text.replace("02_tiled_fa1", "01_naive"), page,
                                             root).count("01_naive/README.md"), 3)

    def test_pack(self):
        if IS_PACK:
            self.skipTest("course pack: packs are made from the full repository")
        m = self.m
        target = "05_split_q"
        if not m.step_present(target):
            self.skipTest(f"{target} is not in this tree")
        out = self.tmp / "pack"
        status, text = lab("pack", "--upto", "05", "--out", out)
        self.assertEqual(status, 0, text)
        for step in m.known_steps():
            self.assertEqual((out / step).exists(), step < target and m.step_present(step), step)
        for n in range(2, 11):
            self.assertEqual((out / "docs" / f"lab_{n:02d}.md").exists(),
                             n <= 5 and (ROOT / "docs" / f"lab_{n:02d}.md").exists(), n)
        self.assertFalse((out / "common" / "labs" / "instructor").exists())
        self.assertFalse((out / "common" / "labs" / "06_causal_skip.json").exists())
        self.assertTrue((out / "common" / "labs" / "05_split_q.json").exists())
        self.assertTrue((out / "common" / "labs" / "pack.json").exists())
        pack_meta = json.loads((out / "common" / "labs" / "pack.json").read_text())
        self.assertIsInstance(pack_meta["stale_recorded"], dict)
        self.assertLessEqual(set(pack_meta["stale_recorded"]), set(pack_meta["labs"]))
        self.assertEqual(m.fa_steps(out), [s for s in m.fa_steps() if s < target])
        readme = (out / "README.md").read_text()
        self.assertIn("Course pack", readme)
        link = re.compile(r"\]\(([^)\s]+)\)")
        for page in out.rglob("*.md"):  # every link and ref of the pages resolves in the pack
            if "build" in page.relative_to(out).parts:
                continue
            text = page.read_text()
            for target in link.findall(text):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue
                self.assertTrue((page.parent / target.split("#")[0]).exists(), (page, target))
            for n in range(5, 11):
                self.assertNotRegex(text, rf"[@\\]ref step{n:02d}\b", page)
                if n > 5:
                    self.assertNotRegex(text, rf"[@\\]ref lab_{n:02d}\b", page)
        self.assertTrue((out / ".git").exists(), "the pack is a git repository")
        # In the pack, the lab starts from 04 and knows its target; the packs' own lab.py
        # refuses to make packs.
        pack_lab = out / "common" / "scripts" / "lab.py"
        status, text = lab("start", "05", "--no-configure", "--dir", self.tmp / "pack_labs",
                           "--build", self.tmp / "pack_build", script=pack_lab)
        self.assertEqual(status, 0, text)
        self.assertEqual((self.tmp / "pack_labs" / "lab_05_split_q" / "kernel.cu").read_bytes(),
                         (ROOT / "04_deferred_rescale" / "kernel.cu").read_bytes())
        status, text = lab("start", "06", "--no-configure", "--dir", self.tmp / "pack_labs",
                           "--build", self.tmp / "pack_build", script=pack_lab)
        self.assertEqual(status, 2, text)
        self.assertIn("unknown step", text)
        status, text = lab("pack", "--upto", "all", "--out", self.tmp / "x", script=pack_lab)
        self.assertEqual(status, 0, text)
        self.assertIn("this is a course pack", text)


class LabGpuTests(unittest.TestCase):
    """Every lab graded three ways in one build: unchanged (fails), the reference (passes),
    every planted bug (fails, naming the quantity, or for a bug that only costs speed, the
    missing gain)."""

    def setUp(self):
        if not gpu_present():
            self.skipTest("No CUDA device (nvidia-smi lists none)")
        self.tmp = Path(tempfile.mkdtemp(prefix="fa_lab_gpu_"))

    def tearDown(self):
        if os.environ.get("FA_LAB_TEST_KEEP"):
            print(f"kept {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def test_unchanged_fails_reference_passes_bugs_fail(self):
        m = load_module(LAB, "lab")
        labs, build = self.tmp / "labs", self.tmp / "build"
        # FA_LAB_TEST_WORKDIR (ctest sets it under the build tree): the labs and their build
        # persist there, so a second run recompiles only the labs whose code changed.
        work = os.environ.get("FA_LAB_TEST_WORKDIR")
        stage = self.tmp / "stage" if work else labs
        steps = m.known_steps()
        expected = {}  # lab name -> (target, variant, expectation)
        t0 = time.time()
        only = [s.strip() for s in os.environ.get("FA_LAB_TEST_STEPS", "").split(",")
                if s.strip() and s.strip() != "all"]
        for target in m.lab_defs():
            if not (m.step_present(target) and m.step_present(m.parent_of(target, steps))):
                continue
            if only and not any(target.startswith(s) for s in only):
                continue
            variants = [(f"u{target[:2]}", [], "FAIL: the idea is missing"),
                        (f"r{target[:2]}", ["--reference"], "PASS")]
            variants += [(f"b{target[:2]}_{b['name']}", ["--bug", b["name"]], b["expect"])
                         for b in m.load_bugs(target)]
            for name, flags, expect in variants:
                status, out = lab("start", target, "--name", name, *flags, "--no-configure",
                                  "--dir", stage, "--build", self.tmp / "build" if work else build)
                self.assertEqual(status, 0, out)
                expected[name] = (target, "unchanged" if not flags else flags[-1].lstrip("-")
                                  if flags[0] == "--reference" else f"bug {flags[-1]}", expect)
        self.assertTrue(expected, "no lab to grade")
        if work:
            labs, build = Path(work) / "labs", Path(work) / "build"
            sync_tree(stage, labs)
        # The steps the grade times (the starting steps, baselines and references); all of
        # them unless FA_LAB_TEST_STEPS picks some labs.
        needed = set()
        for target, _, _ in expected.values():
            speed = m.lab_defs()[target]["speed"]
            needed |= {target, m.parent_of(target, steps), speed.get("baseline", target)}

        # One build holds every step and every lab; only what grade runs is built (the GPU
        # test program and the timer, which link every step and lab), not the runners.
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        dirs = ";".join(str(labs / n) for n in expected)
        args = cmake_args(only=";".join(sorted(needed)) if only else "")
        for cmd in (["cmake", "-S", ROOT, "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release",
                     f"-DFA_LAB_DIRS={dirs}", *args],
                    ["cmake", "--build", build, "--target", "fa_gpu_tests", "fa_lab_timing"]):
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
        t_build = time.time() - t0

        # One grade: quick correctness (fp16 matrix, edge cases, a few random problems, each
        # lab stopping at its first failure), then the speed check with 3 rounds.
        summary = self.tmp / "grades.json"
        status, out = lab("grade", *expected, "--build", build, "--quick", "--problems", "10",
                          "--fail-fast", "--jobs", "8", "--rounds", "3", "--repeats", "3",
                          "--warmup", "1", "--out", self.tmp / "grades", "--json", summary)
        print(out)
        self.assertTrue(summary.exists(), f"lab.py grade wrote no results (status {status})")
        results = {e["name"]: e for e in json.loads(summary.read_text())}
        t_grade = time.time() - t0 - t_build

        rows, problems = [], []
        for name, (target, variant, expect) in expected.items():
            e = results[name]
            s = e["speed"]
            speed = (f"{s['lab_gain']:.2f}x of {s['ref_gain']:.2f}x (mark {s['mark']:.2f}x)"
                     if s.get("mark") else s.get("note", "")[:40] or "-")
            if e["correct"]:
                got = f"{e['result']}: correct, speed {speed}"
            else:
                q = e["first_failure"].get("quantity") or (
                    "no backward" if e["missing_backward"] else
                    (e["first_failure"].get("error") or e.get("tests_error") or "?")[:60])
                got = f"{e['result']}: {q} wrong" + (
                    f" at {e['first_failure'].get('shape', '')}" if e["first_failure"] else "")
            if expect == "PASS":
                ok = e["result"] == "PASS" and s.get("graded") and s.get("passed")
            elif expect.startswith("FAIL"):  # unchanged: correct but slow, or no backward
                ok = e["result"] == "FAIL" and (
                    (e["correct"] and s.get("graded") and s.get("passed") is False)
                    or e["missing_backward"])
            elif expect == "speed":
                ok = (e["result"] == "FAIL" and e["correct"] and s.get("graded")
                      and s.get("passed") is False)
            else:
                ok = (e["result"] == "FAIL" and not e["correct"]
                      and re.fullmatch(expect, e["first_failure"].get("quantity", "")) is not None)
            rows.append((name, target, variant, expect, got, "ok" if ok else "WRONG"))
            if not ok:
                problems.append(name)
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        print(f"\nLAB TABLE (build {t_build:.0f} s, grade {t_grade:.0f} s)")
        print(f"{'lab':{w[0]}s}  {'step':{w[1]}s}  {'variant':{w[2]}s}  {'expected':{w[3]}s}  got")
        for r in rows:
            print(f"{r[0]:{w[0]}s}  {r[1]:{w[1]}s}  {r[2]:{w[2]}s}  {r[3]:{w[3]}s}  {r[4]}  [{r[5]}]")
        counts = {v: sum(1 for r in rows if r[2].split()[0] == v) for v in ("unchanged",
                                                                            "reference", "bug")}
        print(f"LAB VERDICT: {'PASS' if not problems else 'FAIL'}: {len(rows) - len(problems)} of "
              f"{len(rows)} graded as expected ({counts['unchanged']} unchanged labs must fail, "
              f"{counts['reference']} references pass, {counts['bug']} planted bugs fail)"
              + (f"; not as expected: {', '.join(problems)}" if problems else ""))
        self.assertEqual(problems, [], "labs graded against expectation (table above)")


if __name__ == "__main__":
    unittest.main()
