#!/usr/bin/env python3
"""Course labs: start a step from a copy of the one before it, and grade it with the harness.

    lab.py start 05_split_q [--name NAME] [--dir labs] [--build build] [-- CMAKE_ARGS...]
    lab.py grade NAME [--reference 05_split_q] [--build build] [--problems 200] [--no-bench]
    lab.py list [--build build]
    lab.py remove NAME [--build build] [--delete]

`start` copies the step before the one you name (04_deferred_rescale for 05_split_q) into a
new folder outside the tracked tree (default labs/<name>, git-ignored), writes its two-line
CMakeLists.txt (`fa_add_step(<name>)`), and adds the folder to the build's FA_LAB_DIRS, the
same mechanism the real steps use: the lab gets a runner (build/bin/<name>), its own entries in
the conformance suite, and a place in the bench.

`grade` builds the lab, runs the GPU conformance suite and the random problems on it, then the
bench with its predecessor and the reference step, and prints a short report: what passed,
the first failing shape with its largest error and where it is (row, head, quantity), and the
speed beside the reference and the predecessor. It exits 0 only if every test passed.

Python 3 standard library only. See docs/labs.md.
"""

import argparse
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
META = "lab.json"
# CMake targets a lab must not shadow (its name becomes a target and a runner program).
RESERVED = {"all", "bench", "clean", "docs", "fa", "help", "install", "test", "labs"}
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,47}$")


class LabError(Exception):
    """A mistake the user can fix; printed as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------
# The repository and the build


def real_steps():
    """The steps in the paper's order, from the top-level FA_STEPS list."""
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"set\(FA_STEPS\s+([^)]*)\)", text)
    if not m:
        raise LabError(f"cannot find the FA_STEPS list in {ROOT / 'CMakeLists.txt'}")
    return m.group(1).split()


#: Steps that do not start from the step before them in FA_STEPS: 09 is the forward of 06 on
#: Hopper's machinery (DESIGN.md: the steps after 07 branch from the forward they extend).
STARTS_FROM = {"09_hopper_wgmma": "06_causal_skip"}


def step_arch(step):
    """The ARCH of a step's fa_add_step() call (e.g. '90a' for 09 and 10), or None."""
    path = ROOT / step / "CMakeLists.txt"
    m = re.search(r"fa_add_step\(\s*\S+\s+ARCH\s+(\w+)", path.read_text()) if path.exists() else None
    return m.group(1) if m else None


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


def run(cmd, log=None, env=None, check=False):
    """Runs a command; output to `log` (a Path) or captured. Returns (status, output)."""
    proc = subprocess.run(
        [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, errors="replace")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout)
    if check and proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        raise LabError(f"{' '.join(str(c) for c in cmd)} failed:\n{tail}")
    return proc.returncode, proc.stdout


def configure(build, dirs, extra):
    """(Re)configures `build` with FA_LAB_DIRS = dirs (fresh builds: Ninja, Release)."""
    cmd = ["cmake", "-S", ROOT, "-B", build, "-DFA_LAB_DIRS=" + ";".join(str(d) for d in dirs)]
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
    steps = real_steps()
    target = resolve_step(args.step, steps)
    index = steps.index(target)
    if index == 0:
        raise LabError(f"{target} is the first step: there is no step before it to start from")
    source = STARTS_FROM.get(target, steps[index - 1])
    source_dir = ROOT / source
    if not (source_dir / "kernel.cu").exists():
        raise LabError(f"the lab for {target} starts from {source}, which has not landed yet "
                       f"({rel(source_dir / 'kernel.cu')} is missing)")
    name = args.name or f"lab_{target}"
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
    for item in sorted(source_dir.iterdir()):
        if item.name == "CMakeLists.txt" or item.suffix == ".md":
            continue
        if item.is_dir():
            shutil.copytree(item, lab_dir / item.name)
        else:
            shutil.copy2(item, lab_dir / item.name)
    handout = f"docs/lab_{target[:2]}.md"
    (lab_dir / "CMakeLists.txt").write_text(
        f"# Course lab {name}: your {target}, started from a copy of {source}.\n"
        f"# Created by common/scripts/lab.py (handout: {handout}); registered like a step.\n"
        f"fa_add_step({name}{' ARCH ' + step_arch(target) if step_arch(target) else ''})\n")
    meta = {"name": name, "target": target, "source": source,
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
    print(f"Lab {name} created in {rel(lab_dir)}: a copy of {source}, {where}.")
    print(f"Goal: turn it into {target}. Handout: {handout}\n")
    steps_next = [
        (f"$EDITOR {k}", "write the step"),
        (f"diff -u {rel(source_dir / 'kernel.cu')} {k}", "your change so far"),
        (f"cmake --build {b} --target {name}", "compile it and its runner"),
        (f"{b}/bin/{name} --seqlen 1024 --head-dim 64", "one run, checked against the oracle"),
        (f"python3 {script} grade {name}" + (f" --build {b}" if args.build else ""),
         "the grade: tests, random problems, bench (GPU)"),
    ]
    width = min(max(len(c) for c, _ in steps_next), 72)
    print("Next:")
    for command, why in steps_next:
        print(f"  {command:{width}s}  # {why}")
    return 0


# ---------------------------------------------------------------------------------------------
# grade


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


def bench_table(path, steps):
    """{(direction, seqlen, d, causal): {step: row}} from the bench's JSON."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, {}
    table = {}
    for r in data.get("results", []):
        key = (r["direction"], r["seqlen_q"], r["head_dim"], r["causal"])
        table.setdefault(key, {})[r["step"]] = r
    return table, data.get("gpu", {})


def geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


def cmd_grade(args):
    build = Path(args.build).resolve() if args.build else ROOT / "build"
    ok, gpu = gpu_present()
    if not ok:
        print(f"grade: no CUDA GPU on this machine ({gpu}); grading runs {args.name} on an "
              "sm_80+ GPU")
        return 1
    lab_dir = find_lab(args.name, build)
    meta = read_meta(lab_dir)
    name = args.name
    target = meta.get("target", "")
    source = meta.get("source", "")
    reference = args.reference or target
    out_dir = Path(args.out).resolve() if args.out else lab_dir / "grade"
    out_dir.mkdir(parents=True, exist_ok=True)
    bin_dir = build / "bin"
    test_bin = bin_dir / "fa_gpu_tests"

    # 1. Build: the lab, the tests and the bench (every step is linked into libfa).
    print(f"grade: building {name} in {rel(build)} ...", flush=True)
    status, out = run(["cmake", "--build", build, "--target", "fa_gpu_tests", "bench", name],
                      log=out_dir / "build.log")
    if status != 0:
        errors = [l for l in out.splitlines() if re.search(r"error|Error", l)]
        print(f"grade: {name} does not build (full log: {rel(out_dir / 'build.log')}):")
        for line in (errors or out.splitlines())[:20]:
            print("  " + line)
        return 1

    # 2. The conformance suite and the random problems, on the lab only.
    env = dict(os.environ)
    env["FA_RANDOM_PROBLEMS"] = str(args.problems)
    json_path = out_dir / "tests.json"
    if json_path.exists():
        json_path.unlink()
    print(f"grade: conformance suite{' (quick)' if args.quick else ''} and {args.problems} "
          "random problems per direction ...", flush=True)
    status, out = run([test_bin, f"--gtest_filter={test_filter(name, args.quick)}",
                       f"--gtest_output=json:{json_path}"], log=out_dir / "tests.log", env=env)
    if "No CUDA device" in out:
        line = next(l for l in out.splitlines() if "No CUDA device" in l)
        print(f"grade: {line.strip()}")
        return 1
    try:
        report = json.loads(json_path.read_text())
    except (OSError, ValueError):
        tail = "\n  ".join(out.splitlines()[-15:])
        print(f"grade: the test program did not finish (status {status}); last lines of "
              f"{rel(out_dir / 'tests.log')}:\n  {tail}")
        return 1
    groups, failures, random_rows = summarize_tests(report)
    built_steps = registered_steps(test_bin)
    # A lab of a step with a backward pass must have one too.
    expects_backward = target == "07_backward" or (
        reference in built_steps and run([test_bin, "--gtest_list_tests",
                                          f"--gtest_filter=Steps/BackwardConformance.*/"
                                          f"{reference}_*"])[1].count(reference) > 0)
    missing_backward = expects_backward and "backward matrix" not in groups

    # 3. The bench: predecessor, lab, reference.
    bench_steps = [s for s in (source, name, reference) if s and s in built_steps]
    bench_steps = list(dict.fromkeys(bench_steps))
    table, gpu_info = {}, {}
    if not args.no_bench:
        direction = "both" if expects_backward else "fwd"
        bench_json = out_dir / "bench.json"
        cmd = [bin_dir / "bench", "--steps", ",".join(bench_steps), "--seqlens", args.seqlens,
               "--head-dims", args.head_dims, "--causal", "both", "--direction", direction,
               "--repeats", str(args.repeats), "--out", bench_json]
        print(f"grade: bench {' '.join(str(c) for c in cmd[1:])} ...", flush=True)
        if bench_json.exists():
            bench_json.unlink()
        run(cmd, log=out_dir / "bench.log")
        table, gpu_info = bench_table(bench_json, bench_steps)

    # 4. The report.
    lines = []
    passed = not failures and not missing_backward and sum(g[0] for g in groups.values()) > 0
    lines.append(f"Lab {name}: your {target or '?'}, started from {source or '?'}; "
                 f"reference {reference or '?'}")
    lines.append(f"GPU: {gpu_info.get('name') or gpu.split(':', 1)[-1].split('(')[0].strip()}")
    lines.append("")
    lines.append("Correctness (fp64 oracle, bounds of fa::tolerance)"
                 + (" -- quick: fp16 matrix, no LongSequences/LargestGrid:" if args.quick else ":"))
    for group in ("forward matrix", "backward matrix", "edge cases"):
        if group in groups:
            p, f, s = groups[group]
            lines.append(f"  {group:16s} {p:4d} passed {f:4d} failed" + (f" {s:4d} skipped" if s else ""))
    for group, problems, failed, seed, not_run in random_rows:
        lines.append(f"  {group:16s} {problems - failed:4d} of {problems} problems passed"
                     + (f" (first seed {seed})" if seed else "")
                     + (f"; {not_run} not run (FA_RANDOM_SECONDS)" if not_run else ""))
    if missing_backward:
        lines.append(f"  backward         missing: {name} registers no backward pass, "
                     f"{reference} has one")
    if failures:
        test, messages = failures[0]
        info = explain_failure("\n".join(messages))
        lines.append("")
        lines.append(f"First failure: {test}  ({len(failures)} failing test(s) in all)")
        if info.get("shape"):
            lines.append(f"  shape:   {info['shape']}" + (f"  seed {info['seed']}" if info.get("seed") else ""))
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
        lines.append(f"  all messages: {rel(out_dir / 'tests.log')}")

    if table:
        lines.append("")
        lines.append("Speed (median ms; TFLOP/s in brackets; fp16, bench shapes of 16K tokens):")
        head = f"  {'dir':3s} {'seqlen':>6s} {'d':>3s} {'mask':6s}"
        for s in bench_steps:
            head += f" {s[:22]:>22s}"
        lines.append(head)
        ratios_ref, ratios_src = [], []
        for key in sorted(table, key=lambda k: (k[0] != "fwd", k[2], k[3], k[1])):
            direction, seqlen, d, causal = key
            row = f"  {direction:3s} {seqlen:6d} {d:3d} {'causal' if causal else 'full':6s}"
            for s in bench_steps:
                r = table[key].get(s)
                if not r or r.get("error") or not r.get("median_ms"):
                    cell = "-"
                else:
                    cell = f"{r['median_ms']:.3f} [{r['tflops']:.0f}]"
                    if r.get("checked") and not r.get("passed"):
                        cell += " WRONG"
                row += f" {cell:>22s}"
            lines.append(row)
            mine = table[key].get(name, {}).get("median_ms") or 0
            if mine > 0:
                for other, acc in ((reference, ratios_ref), (source, ratios_src)):
                    t = table[key].get(other, {}).get("median_ms") or 0
                    if t > 0 and other != name:
                        acc.append(t / mine)
        if ratios_ref:
            lines.append(f"  {name} is {geomean(ratios_ref):.2f}x the speed of {reference} "
                         "(geometric mean; above 1 is faster)")
        if ratios_src and source != reference:
            lines.append(f"  {name} is {geomean(ratios_src):.2f}x the speed of {source}")
    elif not args.no_bench:
        lines.append("")
        lines.append(f"Speed: the bench did not produce results (see {rel(out_dir / 'bench.log')})")

    lines.append("")
    lines.append(f"Result: {'PASS' if passed else 'FAIL'}" +
                 ("" if passed else " (correctness first: fix the first failure above)"))
    text = "\n".join(lines)
    print(text)
    (out_dir / "report.txt").write_text(text + "\n")
    return 0 if passed else 1


# ---------------------------------------------------------------------------------------------
# list, remove


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
            raise LabError(f"{rel(lab_dir)} has no {META}: not deleting a folder lab.py did not make")
        shutil.rmtree(lab_dir)
        print(f"lab {args.name}: unregistered and deleted")
    else:
        print(f"lab {args.name}: unregistered (its folder {rel(lab_dir)} is kept)")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="lab.py", description="Course labs graded by the harness (docs/labs.md).",
        epilog="start: arguments after -- go to cmake, e.g. -- -DCMAKE_CUDA_ARCHITECTURES=86")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("start", help="copy step N-1 as your lab for step N and register it")
    p.add_argument("step", help="the step to write, e.g. 05_split_q (or 05)")
    p.add_argument("--name", help="lab name (default lab_<step>)")
    p.add_argument("--dir", help="folder for the lab (default <repo>/labs, git-ignored)")
    p.add_argument("--build", help="build folder (default <repo>/build)")
    p.add_argument("--no-configure", action="store_true", help="only create the folder")
    p.set_defaults(func=cmd_start)

    p = sub.add_parser("grade", help="build, test and bench a lab; print the report")
    p.add_argument("name", help="the lab's name")
    p.add_argument("--reference", help="step to compare with (default: the step the lab is for)")
    p.add_argument("--build", help="build folder (default <repo>/build)")
    p.add_argument("--problems", type=int, default=200,
                   help="random problems per direction (default 200)")
    p.add_argument("--no-bench", action="store_true", help="correctness only")
    p.add_argument("--quick", action="store_true",
                   help="fp16 matrix only, without the two largest edge cases")
    p.add_argument("--seqlens", default="1024,4096", help="bench lengths (default 1024,4096)")
    p.add_argument("--head-dims", default="64,128", help="bench head dims (default 64,128)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per bench cell")
    p.add_argument("--out", help="folder for the logs and report (default <lab>/grade)")
    p.set_defaults(func=cmd_grade)

    p = sub.add_parser("list", help="the labs registered in a build")
    p.add_argument("--build", help="build folder (default <repo>/build)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("remove", help="unregister a lab (and with --delete, delete it)")
    p.add_argument("name")
    p.add_argument("--build", help="build folder (default <repo>/build)")
    p.add_argument("--delete", action="store_true", help="also delete the lab's folder")
    p.set_defaults(func=cmd_remove)

    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" goes to cmake as is (start), e.g. -DCMAKE_CUDA_ARCHITECTURES=86.
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
