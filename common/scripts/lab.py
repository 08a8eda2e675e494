#!/usr/bin/env python3
"""Course labs: start a step from a copy of the one before it, grade it, hand out a course pack.

    lab.py start 05_split_q [--name NAME] [--dir labs] [--build build] [-- CMAKE_ARGS...]
    lab.py grade NAME [NAME...] [--quick] [--problems 200] [--no-speed] [--jobs N]
    lab.py pack --upto 05_split_q --out DIR [--check]      (or --upto all)
    lab.py bugs                    (instructors: the planted bugs, checked against the steps)
    lab.py list | remove NAME [--delete]

`start` copies the step the lab starts from (04_deferred_rescale for 05_split_q; the steps after
07 branch: 08 and 09 start from 06, 10 from 09) into a folder outside the tracked tree (default
labs/<name>, git-ignored), writes its two-line CMakeLists.txt (`fa_add_step(<name>)`), and adds
the folder to the build's FA_LAB_DIRS: the lab gets a runner, its own entries in the
conformance suite, and a name the bench and the lab timer accept. Instructors also start a lab
from the reference step itself (`--reference`, it must pass) or from the reference with a
planted bug (`--bug NAME`, it must fail; the bugs live in the instructor folder).

`grade` builds the labs, runs the GPU conformance suite and the random problems on each, then
checks that the step's idea is there: the lab, the step it started from and the reference are
timed in one run, on the same inputs, at the shapes where the idea matters (the lab's
definition, common/labs/<step>.json), in interleaved rounds; the lab passes when it earns at
least half of the reference's gain on a log scale. It prints, per lab, what passed, the first
failure (quantity, shape, row) and the speed, and exits 0 only if every lab passed.

`pack` writes a student repository that stops before a chosen step: that step and the later
ones, their handouts and the instructor folder are left out, the FA_STEPS list and the pages
that link them are adjusted. `--check` builds it, runs its host tests and its docs.

Python 3 standard library only. See docs/labs.md.
"""

import argparse
import concurrent.futures
import datetime
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAB_DEFS = ROOT / "common" / "labs"  # one lab definition per step: <step>.json
INSTRUCTOR = LAB_DEFS / "instructor"  # answer keys and planted bugs; never in a pack
META = "lab.json"
PACK_META = LAB_DEFS / "pack.json"  # written into a course pack


def _load(name, path):
    """A module of this repository by its path (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


diff_report = _load("diff_report", ROOT / "common" / "scripts" / "diff_report.py")
# CMake targets a lab must not shadow (its name becomes a target and a runner program).
RESERVED = {"all", "bench", "clean", "docs", "fa", "help", "install", "test", "labs"}
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,47}$")
# Which step each lab starts from: common/scripts/diff_budget.txt, the one place that says which
# step each step's lesson starts from (08 and 09 branch from 06, 10 from 09).
PARENTS = diff_report.parents()
# The speed check: the lab must earn this share of the reference's gain over the step it
# started from, on a log scale (0.5: gain_lab >= sqrt(gain_ref), i.e. the lab's time is nearer
# the reference's than the starting step's). A reference that gains less than MIN_REF_GAIN on
# this GPU cannot tell a lab with the idea from one without: the check is then not graded. At
# 1.05x the mark is 1.025x, 2.5% from either side, against a spread of the timer's medians of
# about 1%. It was 1.10x until the twelfth session, when lab 10's reference (1.12x-1.13x on the
# H200 before) gained 1.0995x in one run of the README command (the unchanged lab 1.00x): lab
# 10 went ungraded and gpu.lab failed.
SHARE = 0.5
MIN_REF_GAIN = 1.05


class LabError(Exception):
    """A mistake the user can fix; printed as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------
# The repository: steps, lab definitions, planted bugs


def fa_steps(root=ROOT):
    """The top-level FA_STEPS list, in the paper's order."""
    text = (root / "CMakeLists.txt").read_text()
    m = re.search(r"set\(FA_STEPS\s+([^)]*)\)", text)
    if not m:
        raise LabError(f"cannot find the FA_STEPS list in {root / 'CMakeLists.txt'}")
    return m.group(1).split()


def lab_defs(root=ROOT):
    """{step: definition} of every lab defined in common/labs/<step>.json."""
    defs = {}
    for path in sorted((root / "common" / "labs").glob("*.json")):
        if path.name == PACK_META.name:
            continue
        try:
            d = json.loads(path.read_text())
        except ValueError as e:
            raise LabError(f"{path}: not valid JSON ({e})")
        defs[path.stem] = d
    return defs


def known_steps(root=ROOT):
    """Every step the repository knows: FA_STEPS and the steps a lab is defined for (a course
    pack lists only the steps it holds, but knows the labs it hands out), sorted by number."""
    return sorted(set(fa_steps(root)) | set(lab_defs(root)))


def resolve_step(text, steps):
    """'05_split_q', '05' or '5' -> '05_split_q'."""
    if text in steps:
        return text
    if text.isdigit():
        prefix = f"{int(text):02d}_"
        matches = [s for s in steps if s.startswith(prefix)]
        if len(matches) == 1:
            return matches[0]
    raise LabError(f"unknown step '{text}' (steps: {', '.join(steps)})")


def parent_of(step, steps):
    """The step a lab for `step` starts from: its parent in diff_budget.txt where that step is
    known here, else the one before it."""
    parent = PARENTS.get(step)
    if parent in steps:
        return parent
    index = steps.index(step)
    if index == 0:
        raise LabError(f"{step} is the first step: there is no step before it to start from")
    return steps[index - 1]


def step_present(step, root=ROOT):
    return (root / step / "kernel.cu").exists()


def step_arch(step, root=ROOT):
    """The ARCH of a step's fa_add_step() call (e.g. '90a' for the Hopper steps), or None: a
    lab for that step is built for the same architecture."""
    path = root / step / "CMakeLists.txt"
    if not path.exists():
        return None
    m = re.search(r"fa_add_step\(\s*\S+\s+ARCH\s+(\w+)", path.read_text())
    return m.group(1) if m else None


def step_sass_checks(step, name, root=ROOT):
    """The step's fa_add_sass_check() lines with the step renamed to `name` (e.g. 09's: its
    machine code must use HGMMA and no HMMA), so that a lab gets the same host.sass test."""
    path = root / step / "CMakeLists.txt"
    if not path.exists():
        return []
    return [re.sub(r"fa_add_sass_check\(\s*" + re.escape(step) + r"\b", f"fa_add_sass_check({name}",
                   line) for line in path.read_text().splitlines()
            if re.match(r"\s*fa_add_sass_check\(\s*" + re.escape(step) + r"\b", line)]


def load_bugs(step, root=ROOT):
    """The planted bugs of the lab for `step` (instructor folder), [] if it has none."""
    path = root / "common" / "labs" / "instructor" / "bugs" / f"{step}.json"
    if not path.exists():
        return []
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise LabError(f"{path}: not valid JSON ({e})")


def plant(text, bug, where="kernel.cu"):
    """`text` with `bug`'s edits applied. Each edit's `find` must occur exactly once: a
    reference that changed under a bug makes this fail loudly instead of planting nothing."""
    for edit in bug["edits"]:
        find = edit["find"]
        count = text.count(find)
        if count != 1:
            raise LabError(f"planted bug '{bug['name']}': the text to replace occurs {count} times "
                           f"in {where} (must be exactly once): {find.strip()[:80]!r}")
        text = text.replace(find, edit["replace"])
    return text


# ---------------------------------------------------------------------------------------------
# The build


def read_cache(build):
    """The build's CMakeCache.txt as {name: value}, or {} if it does not exist."""
    cache = {}
    path = build / "CMakeCache.txt"
    if not path.exists():
        return cache
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+):[A-Z]+=(.*)$", line)
        if m:
            cache[m.group(1)] = m.group(2)
    return cache


def lab_dirs(build):
    """The folders in the build's FA_LAB_DIRS, as absolute paths."""
    value = read_cache(build).get("FA_LAB_DIRS", "")
    return [Path(p) if os.path.isabs(p) else (ROOT / p) for p in value.split(";") if p]


def read_meta(lab_dir):
    try:
        return json.loads((lab_dir / META).read_text())
    except (OSError, ValueError):
        return {}


def run(cmd, log=None, env=None, check=False, cwd=None):
    """Runs a command; output to `log` (a Path) or captured. Returns (status, output)."""
    proc = subprocess.run(
        [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, errors="replace", cwd=cwd)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout)
    if check and proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        raise LabError(f"{' '.join(str(c) for c in cmd)} failed:\n{tail}")
    return proc.returncode, proc.stdout


def configure(build, dirs, extra, source=ROOT):
    """(Re)configures `build` with FA_LAB_DIRS = dirs (fresh builds: Ninja, Release)."""
    cmd = ["cmake", "-S", source, "-B", build, "-DFA_LAB_DIRS=" + ";".join(str(d) for d in dirs)]
    if not (build / "CMakeCache.txt").exists():
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        cmd += ["-DCMAKE_BUILD_TYPE=Release"]
    cmd += extra
    status, out = run(cmd)
    if status != 0:
        tail = "\n".join(out.splitlines()[-25:])
        raise LabError(f"configuring {build} failed:\n{tail}")


def gpu_present():
    """(True, name) if nvidia-smi lists a GPU, else (False, why)."""
    if not shutil.which("nvidia-smi"):
        return False, "nvidia-smi not found"
    status, out = run(["nvidia-smi", "-L"])
    gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
    if status != 0 or not gpus:
        return False, (out.strip().splitlines() or ["no GPU listed"])[0]
    return True, gpus[0]


def rel(path):
    """`path` relative to the current directory when that is shorter."""
    try:
        r = os.path.relpath(path)
        return r if len(r) < len(str(path)) else str(path)
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# start


def cmd_start(args):
    steps = known_steps()
    target = resolve_step(args.step, steps)
    source = parent_of(target, steps)
    if args.reference and args.bug:
        raise LabError("--reference and --bug exclude each other")
    variant = "reference" if args.reference else f"bug:{args.bug}" if args.bug else "student"
    bug = None
    if args.bug:
        bugs = {b["name"]: b for b in load_bugs(target)}
        if args.bug not in bugs:
            raise LabError(f"no planted bug '{args.bug}' for {target} (bugs: "
                           f"{', '.join(bugs) or 'none; they live in the instructor folder'})")
        bug = bugs[args.bug]
    copied = target if variant != "student" else source
    copied_dir = ROOT / copied
    if not (copied_dir / "kernel.cu").exists():
        what = ("the reference" if copied == target
                else f"the lab for {target} starts from {copied}, which")
        raise LabError(f"{what} is not in this repository ({rel(copied_dir / 'kernel.cu')} is "
                       "missing)")
    default = {"student": f"lab_{target}", "reference": f"ref_{target}"}.get(
        variant, f"bug_{target[:2]}_{args.bug}")
    name = args.name or default
    if not NAME_RE.match(name):
        raise LabError(f"lab name '{name}' is not valid: use a letter, then letters, digits or "
                       "'_' (at most 48); it becomes a C symbol, a CMake target and a test name")
    if name in RESERVED or name.startswith("fa_") or name in steps:
        raise LabError(f"lab name '{name}' is taken by the build; choose another")

    build = Path(args.build).resolve() if args.build else ROOT / "build"
    base = Path(args.dir) if args.dir else ROOT / "labs"
    lab_dir = base.resolve() / name
    dirs = [d for d in lab_dirs(build)]
    for d in dirs:
        other = d.name
        if other == name and d != lab_dir:
            raise LabError(f"a lab named {name} is already registered at {rel(d)}")
        if other != name and (other.startswith(name + "_") or name.startswith(other + "_")):
            raise LabError(f"lab name '{name}' and the registered lab '{other}' would select "
                           "each other's tests (one is a prefix of the other); choose another")
    if lab_dir.exists():
        raise LabError(f"{rel(lab_dir)} already exists: grade it (lab.py grade {name}), or "
                       "remove the folder first")

    # The copy: everything of the step but its lesson (README, NOTES) and its CMakeLists.
    lab_dir.mkdir(parents=True)
    for item in sorted(copied_dir.iterdir()):
        if item.name == "CMakeLists.txt" or item.suffix == ".md":
            continue
        if item.is_dir():
            shutil.copytree(item, lab_dir / item.name)
        else:
            shutil.copy2(item, lab_dir / item.name)
    if bug is not None:
        kernel = lab_dir / bug.get("file", "kernel.cu")
        kernel.write_text(plant(kernel.read_text(), bug, f"{target}/{kernel.name}"))
    handout = f"docs/lab_{target[:2]}.md"
    arch = step_arch(target)
    what = {"student": f"your {target}, started from a copy of {source}",
            "reference": f"a copy of the reference {target} (instructor check: it must pass)"}.get(
        variant, f"the reference {target} with the planted bug '{args.bug}' (it must fail)")
    (lab_dir / "CMakeLists.txt").write_text(
        f"# Course lab {name}: {what}.\n"
        f"# Created by common/scripts/lab.py (handout: {handout}); registered like a step.\n"
        f"fa_add_step({name}{' ARCH ' + arch if arch else ''})\n"
        + "".join(line + "\n" for line in step_sass_checks(target, name)))
    meta = {"name": name, "target": target, "source": source, "variant": variant,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "repository": str(ROOT)}
    (lab_dir / META).write_text(json.dumps(meta, indent=2) + "\n")

    # Register it: FA_LAB_DIRS keeps the other labs (those whose folder still exists).
    kept = []
    for d in dirs:
        if d == lab_dir or d in kept:
            continue
        if (d / "CMakeLists.txt").exists():
            kept.append(d)
        else:
            print(f"lab: dropping {d} from FA_LAB_DIRS (the folder is gone)")
    kept.append(lab_dir)
    if args.no_configure:
        print(f"lab: not configured; run:\n  cmake -S {rel(ROOT)} -B {rel(build)} "
              f"-DFA_LAB_DIRS=\"{';'.join(str(d) for d in kept)}\"")
    else:
        configure(build, kept, args.cmake_args)

    b, k = rel(build), rel(lab_dir / "kernel.cu")
    script = rel(Path(__file__).resolve())
    where = f"not yet registered in {b}" if args.no_configure else f"registered in {b}"
    print(f"Lab {name} created in {rel(lab_dir)}: {what}, {where}.")
    print(f"Goal: turn it into {target}. Handout: {handout}\n")
    steps_next = [
        (f"$EDITOR {k}", "write the step"),
        (f"diff -u {rel(ROOT / source / 'kernel.cu')} {k}", "your change so far"),
        (f"cmake --build {b} --target {name}", "compile it and its runner"),
        (f"{b}/bin/{name} --seqlen 1024 --head-dim 64", "one run, checked against the oracle"),
        (f"python3 {script} grade {name}" + (f" --build {b}" if args.build else ""),
         "the grade: tests, random problems, speed (GPU)"),
    ]
    width = min(max(len(c) for c, _ in steps_next), 72)
    print("Next:")
    for command, why in steps_next:
        print(f"  {command:{width}s}  # {why}")
    return 0


# ---------------------------------------------------------------------------------------------
# grade: correctness


def find_lab(name, build):
    for d in lab_dirs(build):
        if d.name == name:
            return d
    labs = ", ".join(d.name for d in lab_dirs(build)) or "none"
    raise LabError(f"no lab named {name} is registered in {rel(build)} (labs: {labs}); "
                   "start one with: lab.py start <step>")


def registered_steps(test_bin):
    """The steps compiled into the build (parameters of the named edge cases)."""
    _, out = run([test_bin, "--gtest_list_tests", "--gtest_filter=Steps/EdgeCases.*"])
    steps = []
    for line in out.splitlines():
        m = re.match(r"^  \w+/(\w+)", line)
        if m and m.group(1) not in steps:
            steps.append(m.group(1))
    return steps


def has_backward_tests(test_bin, step):
    _, out = run([test_bin, "--gtest_list_tests",
                  f"--gtest_filter=Steps/BackwardConformance.*/{step}_*"])
    return step in out


def test_filter(name, quick=False):
    """Every GPU test of one step and nothing of another (labs share no prefix, see start).
    quick: fp16 only, and not the two largest edge cases."""
    parts = [f"*/{name}", f"*/{name}_fp16_*"] + ([] if quick else [f"*/{name}_bf16_*"])
    parts += [f"*/{name}_fwd", f"*/{name}_bwd"]
    return ":".join(parts) + ("-*LongSequences*:*LargestGrid*" if quick else "")


SHAPE_RE = re.compile(r"B=\d+ H=\d+/\d+ Nq=\d+ Nk=\d+ d=\d+ \w+(?: scale=\S+)?(?: causal)?"
                      r"(?: scale=\S+ magnitude=\S+ layout=\S+)?")
OOB_RE = re.compile(r"(\w+) out of bounds: (.*?)(?: at (\w+\[[^\]]*\] = \S+ \(expected [^)]*\)))?"
                    r"(?=;|\)\s*$|\n|$)", re.M)
QUANTITY_RE = re.compile(r"\b(O|lse|dQ|dK|dV) out of bounds")


def explain_failure(text):
    """The useful part of a gtest failure message: shape, seed, first quantity out of bounds."""
    lines = [l for l in text.splitlines() if l.strip() and not re.match(
        r"^(/.*:\d+$|Value of:|  Actual:|Expected:|Failed$|.*\.cpp:\d+: Failure)", l)]
    shape = SHAPE_RE.search(text)
    seed = re.search(r"seed (\d+)", text)
    oob = OOB_RE.search(text)
    error = re.search(r"error: (.*)", text)
    out = {"shape": shape.group(0) if shape else "", "seed": seed.group(1) if seed else "",
           "text": "\n".join(lines[:6])}
    if oob:
        out["quantity"] = oob.group(1)
        out["error"] = oob.group(2).strip()
        out["where"] = oob.group(3) or ""
    elif error:
        out["error"] = error.group(1).strip()
    repro = re.search(r"reproduce: (.*)", text)
    if repro:
        out["reproduce"] = repro.group(1).strip()
    return out


def summarize_tests(report):
    """Counts per group and the failures, from gtest's JSON output."""
    groups = {}  # group -> [passed, failed, skipped]
    failures = []
    random_rows = []
    for suite in report.get("testsuites", []):
        for case in suite.get("testsuite", []):
            sname = suite["name"]
            full = f"{sname}.{case['name']}"
            if "ForwardConformance" in sname:
                group = "forward matrix"
            elif "BackwardConformance" in sname:
                group = "backward matrix"
            elif sname.startswith("Decode/"):
                group = "decode"
            elif "RandomConformance" in sname:
                group = "random " + ("backward" if case["name"].endswith("_bwd") else "forward")
            else:
                group = "edge cases"
            g = groups.setdefault(group, [0, 0, 0])
            failed = bool(case.get("failures"))
            skipped = case.get("result") == "SKIPPED"
            g[1 if failed else 2 if skipped else 0] += 1
            if "problems" in case:
                random_rows.append((group, int(case["problems"]), int(case.get("failed", 0)),
                                    case.get("first_seed", ""),
                                    int(case.get("stopped_by_time", 0))))
            if failed:
                failures.append((full, [f["failure"] for f in case["failures"]]))
    return groups, failures, random_rows


def failing_quantities(failures):
    """{quantity: number of failing tests where it is out of bounds}, in the order O, lse, dQ,
    dK, dV: which output is wrong, over every failure and not only the first."""
    counts = {}
    for _, messages in failures:
        for q in sorted(set(QUANTITY_RE.findall("\n".join(messages))),
                        key=["O", "lse", "dQ", "dK", "dV"].index):
            counts[q] = counts.get(q, 0) + 1
    return {q: counts[q] for q in ["O", "lse", "dQ", "dK", "dV"] if q in counts}


def run_correctness(lab, test_bin, args):
    """Runs the lab's GPU tests; fills lab['tests']."""
    env = dict(os.environ)
    env["FA_RANDOM_PROBLEMS"] = str(args.problems)
    json_path = lab["out"] / "tests.json"
    if json_path.exists():
        json_path.unlink()
    cmd = [test_bin, f"--gtest_filter={test_filter(lab['name'], args.quick)}",
           f"--gtest_output=json:{json_path}"]
    if args.fail_fast:
        cmd.append("--gtest_fail_fast")
    status, out = run(cmd, log=lab["out"] / "tests.log", env=env)
    t = {"ran": False}
    if "No CUDA device" in out:
        t["error"] = next(l for l in out.splitlines() if "No CUDA device" in l).strip()
    else:
        try:
            report = json.loads(json_path.read_text())
            groups, failures, random_rows = summarize_tests(report)
            t = {"ran": True, "groups": groups, "failures": failures, "random": random_rows,
                 "quantities": failing_quantities(failures)}
        except (OSError, ValueError):
            tail = "\n  ".join(out.splitlines()[-15:])
            t["error"] = (f"the test program did not finish (status {status}); last lines of "
                          f"{rel(lab['out'] / 'tests.log')}:\n  {tail}")
    missing_bwd = t["ran"] and lab["needs_backward"] and "backward matrix" not in t["groups"]
    t["missing_backward"] = missing_bwd
    t["passed"] = (t["ran"] and not t["failures"] and not missing_bwd
                   and sum(g[0] for g in t["groups"].values()) > 0)
    lab["tests"] = t


# ---------------------------------------------------------------------------------------------
# grade: the speed check


def shape_arg(shape):
    """The timer's --shape text of a lab definition's shape."""
    return shape if isinstance(shape, str) else ",".join(str(int(v)) for v in shape)


def parse_shape(text):
    """'B,H,Hkv,Nq,Nk,d,causal' -> dict."""
    b, h, hkv, nq, nk, d, causal = (int(v) for v in shape_arg(text).split(","))
    return {"batch": b, "heads": h, "heads_kv": hkv, "seqlen_q": nq, "seqlen_k": nk,
            "head_dim": d, "causal": bool(causal)}


def shape_key(row):
    return (row["batch"], row["heads"], row["heads_kv"], row["seqlen_q"], row["seqlen_k"],
            row["head_dim"], bool(row["causal"]))


def describe_shape(key):
    b, h, hkv, nq, nk, d, causal = key
    heads = f"H={h}" if hkv == h else f"H={h}/{hkv}"
    n = f"N={nq}" if nq == nk else f"Nq={nq} Nk={nk}"
    return f"B={b} {heads} {n} d={d}" + (" causal" if causal else "")


def aggregate_timing(rows):
    """{shape key: {step: {"ms": median over rounds, "rounds": [...], "error", "wrong"}}} from
    the timer's rows (one per shape, step and round)."""
    table = {}
    for r in rows:
        name = r.get("step") or r.get("impl")
        cell = table.setdefault(shape_key(r), {}).setdefault(
            name, {"rounds": [], "error": "", "wrong": False})
        if r.get("error"):
            cell["error"] = r["error"]
        elif r.get("median_ms"):
            cell["rounds"].append(r["median_ms"])
        if r.get("checked") and not r.get("passed"):
            cell["wrong"] = True
    for cells in table.values():
        for cell in cells.values():
            cell["ms"] = statistics.median(cell["rounds"]) if cell["rounds"] else 0.0
    return table


def geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


def bench_reports(root=ROOT):
    """(path, document) of every bench report in docs/results (rows named by "step", not
    compare.py's "impl"), in the order they are read: a GPU's current bench run,
    `<gpu>_bench.json`, before the runs kept beside it (`<gpu>_<what>*.json`), whatever their
    names; then by name. recorded_gain and the instructor's figures.py read the same first."""
    paths = sorted((root / "docs" / "results").glob("*.json"),
                   key=lambda p: (re.fullmatch(r"[^_]+_bench\.json", p.name) is None, p.name))
    out = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows = doc.get("results", []) if isinstance(doc, dict) else []
        if rows and isinstance(rows[0], dict) and "step" in rows[0]:
            out.append((path, doc))
    return out


def recorded_gain(baseline, reference, direction, shapes, root=ROOT):
    """The reference's gain over the baseline at `shapes` as recorded by the bench in
    docs/results/*.json (the harness that times a lab, on the GPU named there), for a build
    without the reference (a course pack), or None. Returns (gain, "where it comes from").
    Only the bench's rows count: compare.py queues its runs back to back, the harness
    synchronizes after each, and 01_naive's stream-ordered allocations make its time differ by
    2x between the two. The reports are read in bench_reports' order."""
    keys = [shape_key(parse_shape(s)) for s in shapes]
    for path, doc in bench_reports(root):
        times = {}
        for r in doc["results"]:
            name = r.get("step")
            if (name in (baseline, reference) and r.get("direction") == direction
                    and r.get("dtype", "fp16") == "fp16" and r.get("median_ms")
                    and not r.get("error")):
                try:
                    times[(shape_key(r), name)] = r["median_ms"]
                except KeyError:
                    continue
        if all((k, s) in times for k in keys for s in (baseline, reference)):
            gain = geomean([times[(k, baseline)] / times[(k, reference)] for k in keys])
            run_info = doc.get("run", {})
            where = (f"{doc.get('gpu', {}).get('name', '?')}, {rel(path)}, commit "
                     f"{run_info.get('commit', '?')}, {run_info.get('date', '?')}")
            return gain, where, run_info.get("commit", "")
    return None


def same_code(path, commit, root=ROOT):
    """Whether `path` holds the same code at `commit` as at HEAD, comments and whitespace aside
    (diff_report.code_lines): a comment edit does not change what the bench measured."""
    texts = []
    for rev in (commit, "HEAD"):
        status, text = run(["git", "-C", root, "show", f"{rev}:{path}"])
        if status != 0:
            return False
        texts.append("".join("".join(diff_report.code_lines(text.splitlines())).split()))
    return texts[0] == texts[1]


def recorded_is_stale(baseline, reference, direction, shapes, root=ROOT):
    """Why the recorded gain of `reference` over `baseline` no longer describes the steps (the
    code of their kernel.cu changed after the commit the bench measured, or that commit is
    unknown here), or "" if it still does. Needs the repository's history: `pack` asks it and
    writes the answer into the pack (pack.json, "stale_recorded"), whose own history is one
    commit."""
    got = recorded_gain(baseline, reference, direction, shapes, root)
    if got is None:
        return ""
    commit = got[2]
    paths = [f"{baseline}/kernel.cu", f"{reference}/kernel.cu"]
    status, out = run(["git", "-C", root, "log", "--format=%h", f"{commit}..HEAD", "--", *paths])
    if status != 0 or not commit:
        return f"the recorded figures' commit {commit or '?'} is not in this history"
    changed = out.split()
    if not changed or all(same_code(p, commit, root) for p in paths):
        return ""
    return (f"the code of {baseline} or {reference} changed after the recorded figures' commit "
            f"{commit} ({len(changed)} commit(s))")


def speed_verdict(table, lab, baseline, reference, shapes, recorded=None):
    """The speed check of one lab from the aggregated timing `table`: a dict with graded,
    passed, lab_gain, ref_gain, mark, note. `recorded` ((gain, where)) stands in for a
    reference that is not in the build."""
    keys = [shape_key(parse_shape(s)) for s in shapes]
    v = {"graded": False, "passed": None, "lab_gain": 0.0, "ref_gain": 0.0, "mark": 0.0,
         "note": "", "baseline": baseline, "reference": reference}
    for k in keys:
        cells = table.get(k, {})
        mine = cells.get(lab, {})
        if mine.get("wrong"):
            v.update(graded=True, passed=False,
                     note=f"wrong at the timing shape {describe_shape(k)} (sampled rows checked "
                          "against the oracle): a fast wrong answer does not count")
            return v
        if mine.get("error") or not mine.get("ms"):
            v.update(graded=True, passed=False,
                     note=f"did not run at {describe_shape(k)}: {mine.get('error') or 'no time'}")
            return v
        if not cells.get(baseline, {}).get("ms"):
            v["note"] = (f"{baseline} did not run at {describe_shape(k)} "
                         f"({cells.get(baseline, {}).get('error') or 'no time'}): not graded")
            return v
    v["lab_gain"] = geomean([table[k][baseline]["ms"] / table[k][lab]["ms"] for k in keys])
    if all(table[k].get(reference, {}).get("ms") for k in keys):
        v["ref_gain"] = geomean([table[k][baseline]["ms"] / table[k][reference]["ms"]
                                 for k in keys])
        v["ref_source"] = "measured in this run"
    elif recorded:
        v["ref_gain"], v["ref_source"] = recorded[0], f"recorded on {recorded[1]}"
    else:
        v["note"] = (f"{reference} is not in this build and no figure of it is recorded: not "
                     "graded (your instructor grades it beside the reference)")
        return v
    if v["ref_gain"] < MIN_REF_GAIN:
        v["note"] = (f"{reference} itself gains only {v['ref_gain']:.2f}x over {baseline} on this "
                     f"GPU (less than {MIN_REF_GAIN:.2f}x): the check cannot tell; not graded")
        return v
    v["mark"] = v["ref_gain"] ** SHARE
    v["graded"] = True
    v["passed"] = v["lab_gain"] >= v["mark"]
    return v


def run_speed(group, lab_def, target, test_steps, bin_dir, args, out_dir):
    """Times the labs of one target beside the baseline and the reference; fills each lab's
    'speed'."""
    speed = lab_def["speed"]
    steps = known_steps()
    baseline = speed.get("baseline") or parent_of(target, steps)
    reference = args.reference or target
    shapes = speed["shapes"]
    direction = speed.get("direction", "fwd")
    names = [lab["name"] for lab in group]
    timed = [s for s in dict.fromkeys([baseline, reference] + names) if s in test_steps]
    recorded = None if reference in test_steps else recorded_gain(
        baseline, reference, direction, shapes)
    stale = {}
    if recorded is not None and PACK_META.exists():  # a course pack: its maker checked the figure
        try:
            stale = json.loads(PACK_META.read_text()).get("stale_recorded", {})
        except ValueError:
            stale = {}
    if reference in stale:
        recorded = None
    table = {}
    if baseline in test_steps:
        json_path = out_dir / f"timing_{target}.json"
        cmd = [bin_dir / "fa_lab_timing", "--steps", ",".join(timed), "--check", ",".join(names),
               "--direction", direction, "--rounds", args.rounds, "--warmup", args.warmup,
               "--repeats", args.repeats, "--out", json_path]
        for s in shapes:
            cmd += ["--shape", shape_arg(s)]
        print(f"grade: timing {', '.join(timed)} ({direction}, {len(shapes)} shapes, "
              f"{args.rounds} rounds) ...", flush=True)
        if json_path.exists():
            json_path.unlink()
        status, out = run(cmd, log=out_dir / f"timing_{target}.log")
        try:
            table = aggregate_timing(json.loads(json_path.read_text())["results"])
        except (OSError, ValueError, KeyError):
            for lab in group:
                lab["speed"] = {"graded": True, "passed": False, "note":
                                f"the timer failed (status {status}); see "
                                f"{rel(out_dir / f'timing_{target}.log')}"}
            return
    for lab in group:
        if baseline not in test_steps:
            lab["speed"] = {"graded": False, "passed": None, "note":
                            f"{baseline} (the step the lab starts from) is not in this build: "
                            "not graded"}
            continue
        v = speed_verdict(table, lab["name"], baseline, reference, shapes, recorded)
        if reference in stale and not v["graded"]:
            v["note"] = (f"{reference} is not in this build, and its gain recorded on the "
                         f"reference GPU is out of date ({stale[reference]}): not graded (your "
                         "instructor grades it beside the reference)")
        v["direction"] = direction
        v["table"] = [(describe_shape(shape_key(parse_shape(s))),
                       {n: table.get(shape_key(parse_shape(s)), {}).get(n, {}).get("ms", 0.0)
                        for n in (baseline, lab["name"], reference)}) for s in shapes]
        v["rounds"] = args.rounds
        v["idea"] = lab_def.get("idea", "")
        v["why"] = speed.get("why", "")
        lab["speed"] = v


# ---------------------------------------------------------------------------------------------
# grade: the report


def report_lines(lab, args):
    name, t = lab["name"], lab["tests"]
    lines = [f"Lab {name}: your {lab['target'] or '?'}, started from {lab['source'] or '?'}; "
             f"reference {lab['reference'] or '?'}"]
    lines.append(f"GPU: {lab['gpu']}")
    lines.append("")
    if not t["ran"]:
        lines.append(f"Correctness: {t.get('error', 'not run')}")
    else:
        lines.append("Correctness (fp64 oracle, bounds of fa::tolerance)"
                     + (" -- quick: fp16 matrix, no LongSequences/LargestGrid"
                        if args.quick else "")
                     + (" -- stopped at the first failure" if args.fail_fast else "") + ":")
        for group in ("forward matrix", "backward matrix", "decode", "edge cases"):
            if group in t["groups"]:
                p, f, s = t["groups"][group]
                lines.append(f"  {group:16s} {p:4d} passed {f:4d} failed"
                             + (f" {s:4d} skipped" if s else ""))
        for group, problems, failed, seed, not_run in t["random"]:
            lines.append(f"  {group:16s} {problems - failed:4d} of {problems} problems passed"
                         + (f" (first seed {seed})" if seed else "")
                         + (f"; {not_run} not run (FA_RANDOM_SECONDS)" if not_run else ""))
        if t["missing_backward"]:
            lines.append(f"  backward         missing: {name} registers no backward pass, "
                         f"{lab['reference']} has one")
        if t["failures"]:
            test, messages = t["failures"][0]
            info = explain_failure("\n".join(messages))
            lines.append("")
            lines.append(f"First failure: {test}  ({len(t['failures'])} failing test(s) in all)")
            if info.get("shape"):
                lines.append(f"  shape:   {info['shape']}"
                             + (f"  seed {info['seed']}" if info.get("seed") else ""))
            if info.get("quantity"):
                lines.append(f"  largest error: {info['quantity']}: {info['error']}")
                if info.get("where"):
                    lines.append(f"  where:   {info['where']}")
            elif info.get("error"):
                lines.append(f"  error:   {info['error']}")
            else:
                lines.append("  " + info["text"].replace("\n", "\n  "))
            if info.get("reproduce"):
                lines.append(f"  rerun:   {info['reproduce']}")
            if t["quantities"]:
                lines.append("  wrong:   " + ", ".join(
                    f"{q} (in {n} test{'s' if n > 1 else ''})" for q, n in t["quantities"].items())
                    + ("; lse is the logsumexp L" if "lse" in t["quantities"] else ""))
            lines.append(f"  all messages: {rel(lab['out'] / 'tests.log')}")

    if lab.get("sass"):
        passed, why = lab["sass"]["passed"], lab["sass"]["why"]
        lines.append("")
        lines.append(f"Machine code (host.sass.{name}, the checks of {lab['target']}'s "
                     f"CMakeLists.txt): "
                     + {True: "passed", None: why, False: f"FAILED: {why}"}[passed])
    s = lab.get("speed")
    lines.append("")
    if s is None:
        lines.append("Speed: " + ("not checked (--no-speed)" if args.no_speed else
                                  "not measured: correctness first" if not t.get("passed") else
                                  f"no speed check is defined for {lab['target']} "
                                  f"(common/labs/{lab['target']}.json)"))
    else:
        if s.get("table"):
            base, ref = s["baseline"], s["reference"]
            lines.append(f"Speed: is the idea there? ({s['direction']}, fp16, median ms of "
                         f"{s['rounds']} interleaved rounds, same inputs)")
            if s.get("why"):
                lines.append(f"  where it matters: {s['why']}")
            cols = [base, name, ref]
            lines.append(f"  {'shape':34s}" + "".join(f" {c[:20]:>20s}" for c in cols))
            for shape, cells in s["table"]:
                lines.append(f"  {shape:34s}" + "".join(
                    f" {(f'{cells[c]:.3f}' if cells.get(c) else '-'):>20s}" for c in cols))
            if s.get("lab_gain"):
                lines.append(f"  gain over {base} (geometric mean): yours {s['lab_gain']:.2f}x, "
                             f"{ref} {s['ref_gain']:.2f}x"
                             + (f" ({s['ref_source']})" if s.get("ref_source") else ""))
            if s.get("graded") and s.get("mark"):
                lines.append(f"  pass mark: {s['mark']:.2f}x = the square root of the reference's "
                             "gain (half of it on a log scale)")
        if s.get("graded") and s.get("passed"):
            lines.append("  -> PASS")
        elif s.get("graded"):
            if s.get("note"):
                lines.append(f"  -> FAIL: {s['note']}")
            else:
                lines.append(f"  -> FAIL: the idea is missing: yours gains {s['lab_gain']:.2f}x "
                             f"over {s['baseline']} where {s['reference']} gains "
                             f"{s['ref_gain']:.2f}x"
                             + (f". The idea: {s['idea']}" if s.get("idea") else ""))
        else:
            lines.append(f"  -> not graded: {s['note']}")
    lines.append("")
    lines.append(f"Result: {lab['result']}" + lab["result_why"])
    return lines


def run_sass_check(lab, build, log_dir):
    """The lab's host.sass.<name> test, where its step has one (the Hopper steps: wgmma and not
    mma.sync; step 10 also the order of its loop): None without one, else {"passed", "why"}. An
    unchanged copy of the step before fails it however fast it runs. Without cuobjdump the
    check cannot run: "passed" is then None and the grade does not count it."""
    if not shutil.which("ctest"):
        return None
    pattern = "^host\\.sass\\." + re.escape(lab["name"]) + "$"
    status, out = run(["ctest", "--test-dir", build, "-R", pattern, "--no-tests=error",
                       "--output-on-failure"])
    if status != 0 and "No tests were found" in out:
        return None
    (log_dir / f"sass_{lab['name']}.log").write_text(out)  # only a lab with a check has a log
    if status != 0 and "cuobjdump not found" in out:
        return {"passed": None, "why": "not checked: cuobjdump is not installed (the CUDA "
                "toolkit's bin folder; CheckSass.cmake says how to get it)"}
    if status == 0:
        return {"passed": True, "why": ""}
    # The first of CMake's messages ("CMake Error at ...:", then the text indented and wrapped
    # at ~80 columns) other than the closing "SASS check failed".
    lines = out.splitlines()
    for i, line in enumerate(lines):
        text = []
        for follow in lines[i + 1:] if line.startswith("CMake Error") else []:
            if not follow.startswith("  "):
                break
            text.append(follow.strip())
        if text and text != ["SASS check failed"]:
            return {"passed": False, "why": " ".join(text)}
    return {"passed": False, "why": "see " + rel(log_dir / f"sass_{lab['name']}.log")}


def verdict(lab, args):
    t, s = lab["tests"], lab.get("speed")
    if not t.get("passed"):
        return "FAIL", " (correctness first: fix the first failure above)"
    if lab.get("sass") and lab["sass"]["passed"] is False:
        return "FAIL", " (correct, but the machine code lacks the step's idea: see Machine code)"
    if s is not None and s.get("graded") and not s.get("passed"):
        return "FAIL", " (correct, but the step's idea is not there: see Speed)"
    if args.no_speed:
        return "PASS", " (correctness only: --no-speed)"
    if s is None or not s.get("graded"):
        return "PASS", " (correctness; the speed check was not graded)"
    return "PASS", ""


#: The fewest random problems the GPU suite accepts per direction: one per coverage class it
#: promises (common/tests/gpu/test_random.cpp: 9 forward, 10 backward).
MIN_RANDOM_PROBLEMS = 10


def cmd_grade(args):
    if args.problems < MIN_RANDOM_PROBLEMS:
        raise LabError(f"--problems {args.problems}: the random suite needs at least "
                       f"{MIN_RANDOM_PROBLEMS} (one per coverage class it promises)")
    build = Path(args.build).resolve() if args.build else ROOT / "build"
    ok, gpu = gpu_present()
    if not ok:
        print(f"grade: no CUDA GPU on this machine ({gpu}); grading runs "
              f"{', '.join(args.names)} on an sm_80+ GPU")
        return 1
    defs = lab_defs()
    labs = []
    for name in dict.fromkeys(args.names):
        lab_dir = find_lab(name, build)
        meta = read_meta(lab_dir)
        if args.out:
            out = Path(args.out).resolve() / (name if len(args.names) > 1 else "")
        else:
            out = lab_dir / "grade"
        out.mkdir(parents=True, exist_ok=True)
        target = meta.get("target", "")
        labs.append({"name": name, "dir": lab_dir, "out": out, "target": target,
                     "source": meta.get("source", ""), "variant": meta.get("variant", "student"),
                     "reference": args.reference or target, "gpu": gpu.split(":", 1)[-1].split(
                         "(")[0].strip()})
    bin_dir = build / "bin"
    test_bin = bin_dir / "fa_gpu_tests"
    # Logs of the build and the timer: the lab's folder, or with several labs, --out or
    # <build>/grade.
    log_dir = labs[0]["out"] if len(labs) == 1 else (
        Path(args.out).resolve() if args.out else build / "grade")
    log_dir.mkdir(parents=True, exist_ok=True)

    # 1. Build: the labs' kernels, the tests and the timer (every step is linked into libfa;
    # the labs' runners are not needed here).
    names = [lab["name"] for lab in labs]
    print(f"grade: building {', '.join(names)} in {rel(build)} ...", flush=True)
    status, out = run(["cmake", "--build", build, "--target", "fa_gpu_tests", "fa_lab_timing",
                       *[f"fa_step_{n}" for n in names]], log=log_dir / "build.log")
    if status != 0:
        errors = [l for l in out.splitlines() if re.search(r"error|Error", l)]
        print(f"grade: the build failed (full log: {rel(log_dir / 'build.log')}):")
        for line in (errors or out.splitlines())[:20]:
            print("  " + line)
        return 1
    for lab in labs:
        lab["sass"] = run_sass_check(lab, build, log_dir)
    test_steps = registered_steps(test_bin)
    with_backward = {ref: has_backward_tests(test_bin, ref) for ref in
                     {lab["reference"] for lab in labs} if ref in test_steps}
    for lab in labs:
        d = defs.get(lab["target"], {})
        lab["needs_backward"] = (d.get("speed", {}).get("direction") == "bwd"
                                 or with_backward.get(lab["reference"], False))

    # 2. Correctness: the conformance suite and the random problems, each lab on its own.
    print(f"grade: conformance suite{' (quick)' if args.quick else ''} and {args.problems} "
          f"random problems per direction, {len(labs)} lab(s) ...", flush=True)
    jobs = max(1, min(args.jobs, len(labs)))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda lab: run_correctness(lab, test_bin, args), labs))

    # 3. Speed: per target, the labs that are correct beside the baseline and the reference.
    if not args.no_speed:
        groups = {}
        for lab in labs:
            if lab["tests"].get("passed") and lab["target"] in defs:
                groups.setdefault(lab["target"], []).append(lab)
        for target, group in groups.items():
            run_speed(group, defs[target], target, test_steps, bin_dir, args, log_dir)

    # 4. The reports.
    summary = []
    for lab in labs:
        lab["result"], lab["result_why"] = verdict(lab, args)
        text = "\n".join(report_lines(lab, args))
        if len(labs) > 1:
            print("=" * 100)
        print(text)
        (lab["out"] / "report.txt").write_text(text + "\n")
        t = lab["tests"]
        first = explain_failure("\n".join(t["failures"][0][1])) if t.get("failures") else {}
        entry = {"name": lab["name"], "target": lab["target"], "source": lab["source"],
                 "variant": lab["variant"], "result": lab["result"],
                 "correct": bool(t.get("passed")), "missing_backward": t.get("missing_backward"),
                 "tests_error": t.get("error", ""),
                 "quantities": t.get("quantities", {}), "first_failure": first,
                 "sass": lab.get("sass"),
                 "speed": {k: v for k, v in (lab.get("speed") or {}).items() if k != "table"}}
        (lab["out"] / "grade.json").write_text(json.dumps(entry, indent=2) + "\n")
        summary.append(entry)
    if len(labs) > 1:
        print("=" * 100)
        print(f"{'lab':28s} {'step':22s} {'correct':8s} {'speed (yours / ref / mark)':28s} result")
        for e in summary:
            s = e["speed"]
            sp = (f"{s['lab_gain']:.2f}x / {s['ref_gain']:.2f}x / {s['mark']:.2f}x"
                  if s.get("graded") and s.get("mark") else "fail" if s.get("graded")
                  else "-")
            print(f"{e['name']:28s} {e['target']:22s} {'yes' if e['correct'] else 'no':8s} "
                  f"{sp:28s} {e['result']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(e["result"] == "PASS" for e in summary) else 1


# ---------------------------------------------------------------------------------------------
# pack


def doc_filter():
    """docs/doc_filter.py as a module (the pages of a pack get the docs build's filter)."""
    return _load("doc_filter", ROOT / "docs" / "doc_filter.py")


def source_files():
    """The repository's files (tracked and new, not ignored), relative to ROOT."""
    status, out = run(["git", "-C", ROOT, "ls-files", "--cached", "--others",
                       "--exclude-standard", "-z"])
    if status == 0:
        files = [f for f in out.split("\0") if f]
    else:  # an exported tree without .git
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            relative = Path(dirpath).relative_to(ROOT)
            dirnames[:] = [d for d in dirnames if not (
                d.startswith(".git") or d.startswith("build") or
                (relative == Path(".") and d in ("labs", "gpu-logs")) or d == "__pycache__")]
            files += [str(relative / f) for f in filenames if not f.endswith(".pyc")]
    return sorted(f for f in set(files) if (ROOT / f).is_file())


def pack_plan(target, steps):
    """(steps left out, labs handed out) of a pack that stops before `target`: the step
    folders from `target` on (by number: 08, a branch, stays in a pack that stops before 09)
    and the labs up to `target`'s."""
    return [s for s in steps if s >= target], [s for s in lab_defs() if s <= target]


def write_pack(target, out, force=False, use_git=True):
    """Writes the course pack that stops before `target` into `out`."""
    steps = known_steps()
    removed, labs = pack_plan(target, steps)
    defs = lab_defs()
    if out.exists():
        if not force and any(out.iterdir()):
            raise LabError(f"{rel(out)} exists and is not empty (use --force to replace it)")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    left_out = [f"{s}/" for s in removed]
    left_out += [f"docs/lab_{s[:2]}.md" for s in defs if s not in labs]
    left_out += [f"common/labs/{s}.json" for s in defs if s not in labs]
    left_out += ["common/labs/instructor/", "common/scripts/gpu/"]
    count = 0
    for f in source_files():
        if any(f == p or (p.endswith("/") and f.startswith(p)) for p in left_out):
            continue
        dst = out / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst)
        count += 1

    # FA_STEPS: the steps the pack holds.
    cml = out / "CMakeLists.txt"
    text = cml.read_text()
    m = re.search(r"set\(FA_STEPS\s+([^)]*)\)", text)
    kept = [s for s in m.group(1).split() if s not in removed]
    text = text[:m.start()] + "set(FA_STEPS\n    " + "\n    ".join(kept) + ")" + text[m.end():]
    cml.write_text(text)

    # The pages: links to what is not in the pack go (the docs build's own filter).
    flt = doc_filter()
    for page in sorted(out.rglob("*.md")):
        page.write_text(flt.filter_markdown(page.read_text(), page, out))
    readme = out / "README.md"
    lines = readme.read_text().splitlines(keepends=True)
    lab_list = ", ".join(s[:2] for s in labs)
    banner = (f"\n> **Course pack.** This copy of flash-attention-steps stops before step "
              f"`{target}`: that step and the later ones are left out, to be written in the "
              f"labs ({lab_list}; see [docs/labs.md](docs/labs.md) and the handouts "
              f"`docs/lab_NN.md`). `python3 common/scripts/lab.py start {target}` starts the "
              f"next one.\n")
    readme.write_text(lines[0] + banner + "".join(lines[1:]))

    commit = run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"])[1].strip() or "unknown"
    # The gains recorded on the reference GPU stand in for the references the pack leaves out;
    # one measured before its baseline or reference last changed would set a wrong pass mark.
    stale = {}
    for s in labs:
        speed = defs[s]["speed"]
        why = recorded_is_stale(speed.get("baseline") or parent_of(s, steps), s,
                                speed.get("direction", "fwd"), speed["shapes"])
        if why:
            stale[s] = why
    meta = {"upto": target, "steps": kept, "labs": labs, "from_commit": commit,
            "stale_recorded": stale,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    (out / PACK_META.relative_to(ROOT)).write_text(json.dumps(meta, indent=2) + "\n")
    if use_git and shutil.which("git"):
        env = dict(os.environ, GIT_AUTHOR_NAME="lab.py", GIT_AUTHOR_EMAIL="lab.py@localhost",
                   GIT_COMMITTER_NAME="lab.py", GIT_COMMITTER_EMAIL="lab.py@localhost")
        run(["git", "init", "-q"], cwd=out, check=True)
        run(["git", "add", "-A"], cwd=out, check=True)
        run(["git", "commit", "-q", "-m",
             f"Course pack: steps up to {kept[-1]}, labs {lab_list} (from {commit})"],
            cwd=out, env=env, check=True)
    return removed, labs, count


def check_pack(out, cmake_args):
    """Configures, builds, runs the host tests and builds the docs of a pack; raises LabError
    on the first failure. Build settings come from the environment (CUDAARCHS, launchers)."""
    build = out / "build"
    cmd = ["cmake", "-S", out, "-B", build, "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    steps = [("configure", cmd + cmake_args),
             ("build", ["cmake", "--build", build]),
             ("host tests", ["ctest", "--test-dir", build, "-L", "host", "--output-on-failure",
                             "-j", str(os.cpu_count() or 2)])]
    if shutil.which("doxygen"):
        steps.append(("docs", ["cmake", "--build", build, "--target", "docs"]))
    for what, c in steps:
        status, log = run(c, log=out / f"check_{what.replace(' ', '_')}.log")
        if status != 0:
            tail = "\n".join(log.splitlines()[-30:])
            raise LabError(f"pack {out.name}: {what} failed:\n{tail}")
        if what == "docs" and re.search(r"warning|error", log, re.I):
            raise LabError(f"pack {out.name}: the docs build printed warnings:\n{log[-2000:]}")


def cmd_pack(args):
    if PACK_META.exists():
        print("pack: this is a course pack; packs are made from the full repository")
        return 0
    steps = known_steps()
    if args.upto == "all":
        targets = [s for s in lab_defs() if step_present(s)]
    else:
        targets = [resolve_step(args.upto, steps)]
        if targets[0] not in lab_defs():
            raise LabError(f"no lab is defined for {targets[0]} (common/labs/{targets[0]}.json)")
    out = Path(args.out).resolve()
    for target in targets:
        # Not OUT/<step>: Doxygen resolves a page's ../<step>/README.md link against its working
        # folder (the pack) first, and would find the sibling pack of that name.
        dest = out / f"pack_{target}" if args.upto == "all" else out
        removed, labs, count = write_pack(target, dest, args.force or args.upto == "all",
                                          not args.no_git)
        print(f"pack: {rel(dest)}: {count} files, labs {', '.join(s[:2] for s in labs)}; left "
              f"out {', '.join(removed)} and the instructor folder", flush=True)
        stale = json.loads((dest / PACK_META.relative_to(ROOT)).read_text())["stale_recorded"]
        if stale:
            print(f"pack: note: the gains recorded on the reference GPU predate the steps of "
                  f"lab(s) {', '.join(s[:2] for s in stale)}: in the pack those are graded on "
                  "correctness (and the machine code, where the step has a SASS check) only "
                  "(measure again and commit the results to fix it)", flush=True)
        if args.check:
            check_pack(dest, args.cmake_args)
            print(f"pack: {rel(dest)}: builds, host tests pass, docs build without warnings",
                  flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# bugs, list, remove


def check_bugs(root=ROOT):
    """Every planted bug applies to the current reference code. Returns [(step, bug, problem)].
    The bugs of a step that is not in the tree (yet) are not checked."""
    problems = []
    for path in sorted((root / "common" / "labs" / "instructor" / "bugs").glob("*.json")):
        step = path.stem
        if not step_present(step, root):
            continue
        for bug in load_bugs(step, root):
            kernel = root / step / bug.get("file", "kernel.cu")
            if not kernel.exists():
                problems.append((step, bug.get("name", "?"), f"{rel(kernel)} is missing"))
                continue
            try:
                plant(kernel.read_text(), bug, f"{step}/{kernel.name}")
            except LabError as e:
                problems.append((step, bug.get("name", "?"), str(e)))
    return problems


def cmd_bugs(args):
    for path in sorted((INSTRUCTOR / "bugs").glob("*.json")):
        for bug in load_bugs(path.stem):
            print(f"{path.stem:22s} {bug['name']:24s} expect {bug['expect']:6s} {bug['why']}")
    problems = check_bugs()
    for step, name, problem in problems:
        print(f"bugs: {step} {name}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def cmd_list(args):
    build = Path(args.build).resolve() if args.build else ROOT / "build"
    dirs = lab_dirs(build)
    if not dirs:
        print(f"no labs registered in {rel(build)}")
    for d in dirs:
        meta = read_meta(d)
        state = "" if (d / "CMakeLists.txt").exists() else "  (folder missing)"
        print(f"{d.name:24s} {meta.get('target', '?'):22s} from {meta.get('source', '?'):22s} "
              f"{rel(d)}{state}")
    return 0


def cmd_remove(args):
    build = Path(args.build).resolve() if args.build else ROOT / "build"
    lab_dir = find_lab(args.name, build)
    kept = [d for d in lab_dirs(build) if d != lab_dir and (d / "CMakeLists.txt").exists()]
    configure(build, kept, [])
    if args.delete:
        if not (lab_dir / META).exists():
            raise LabError(f"{rel(lab_dir)} has no {META}: not deleting a folder lab.py did "
                           "not make")
        shutil.rmtree(lab_dir)
        print(f"lab {args.name}: unregistered and deleted")
    else:
        print(f"lab {args.name}: unregistered (its folder {rel(lab_dir)} is kept)")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="lab.py", description="Course labs graded by the harness (docs/labs.md).",
        epilog="start, pack: arguments after -- go to cmake, e.g. -- -DCMAKE_CUDA_ARCHITECTURES=86")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("start", help="copy the step a lab starts from and register it")
    p.add_argument("step", help="the step to write, e.g. 05_split_q (or 05)")
    p.add_argument("--name", help="lab name (default lab_<step>)")
    p.add_argument("--dir", help="folder for the lab (default <repo>/labs, git-ignored)")
    p.add_argument("--build", help="build folder (default <repo>/build)")
    p.add_argument("--no-configure", action="store_true", help="only create the folder")
    p.add_argument("--reference", action="store_true",
                   help="instructors: copy the reference step itself (it must pass)")
    p.add_argument("--bug", help="instructors: the reference with this planted bug (lab.py bugs)")
    p.set_defaults(func=cmd_start)

    p = sub.add_parser("grade", help="build, test and time labs; print the reports")
    p.add_argument("names", nargs="+", metavar="NAME", help="the labs' names")
    p.add_argument("--reference", help="step to compare with (default: the step the lab is for)")
    p.add_argument("--build", help="build folder (default <repo>/build)")
    p.add_argument("--problems", type=int, default=200,
                   help="random problems per direction (default 200)")
    p.add_argument("--no-speed", "--no-bench", dest="no_speed", action="store_true",
                   help="correctness only (the result says so)")
    p.add_argument("--quick", action="store_true",
                   help="fp16 matrix only, without the two largest edge cases "
                        "(the random and decode problems still run)")
    p.add_argument("--fail-fast", action="store_true",
                   help="stop a lab's tests at its first failure")
    p.add_argument("--jobs", type=int, default=4, help="labs tested side by side (default 4)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs per step and round (default 5)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed runs per step and round (default 2)")
    p.add_argument("--out", help="folder for the logs and reports (default <lab>/grade)")
    p.add_argument("--json", help="also write every lab's result to this JSON file")
    p.set_defaults(func=cmd_grade)

    p = sub.add_parser("pack", help="write a course pack that stops before a step")
    p.add_argument("--upto", required=True,
                   help="the first step left out, e.g. 05_split_q (its lab is the last one "
                        "handed out); 'all': one pack per lab, in OUT/pack_<step>")
    p.add_argument("--out", required=True, help="folder to write (must be empty, see --force)")
    p.add_argument("--force", action="store_true", help="replace OUT")
    p.add_argument("--no-git", action="store_true", help="do not make it a git repository")
    p.add_argument("--check", action="store_true",
                   help="build it, run its host tests and build its docs (warnings fail)")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("bugs", help="list the planted bugs and check they apply")
    p.set_defaults(func=cmd_bugs)

    p = sub.add_parser("list", help="the labs registered in a build")
    p.add_argument("--build", help="build folder (default <repo>/build)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("remove", help="unregister a lab (and with --delete, delete it)")
    p.add_argument("name")
    p.add_argument("--build", help="build folder (default <repo>/build)")
    p.add_argument("--delete", action="store_true", help="also delete the lab's folder")
    p.set_defaults(func=cmd_remove)

    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" goes to cmake as is, e.g. -DCMAKE_CUDA_ARCHITECTURES=86.
    cmake_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = parser.parse_args(argv)
    args.cmake_args = cmake_args
    try:
        return args.func(args)
    except LabError as e:
        print(f"lab.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
