#!/usr/bin/env python3
"""The diff between neighbouring steps, measured: is each one its lesson and nothing else?

Every step folder holds one kernel.cu that adds one idea to its parent's (README.md, "How to
read a step"). This script reads the pairs (parent, child, budget, reason) from
common/scripts/diff_budget.txt, the one place that says which step comes from which, and for
every pair whose two folders exist prints:

- code lines: the lines removed and added once comments and blank lines are left out (a
  minimal line diff of the code alone);
- all lines: the count `diff -u parent/kernel.cu child/kernel.cu | grep -c '^[-+]'`, i.e. the
  minimal number of removed plus added lines, plus the two header lines of `diff -u`, which
  is what the budget bounds;
- the functions touched: the definitions (functions, structs, macros) that hold a changed
  line, comment lines included, in the child's order.

Usage:
    python3 common/scripts/diff_report.py                 # the table
    python3 common/scripts/diff_report.py --check         # also exit 1 if a pair is over budget
    python3 common/scripts/diff_report.py --markdown FILE # also write the Doxygen page
    python3 common/scripts/diff_report.py --self-test     # the counting, checked on small cases

--check also fails when a numbered step folder has no line in the budget file (a new step must
say where its lesson comes from) or when the budget file is malformed. A budget of "-" means
"not bounded yet": the pair is reported, never failed. Standard library only.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
BUDGET_FILE = os.path.join(HERE, "diff_budget.txt")
STEP_DIR = re.compile(r"^\d\d_[A-Za-z0-9_]+$")


# --- the diff -----------------------------------------------------------------------------------

def lcs_length(a, b):
    """Length of a longest common subsequence of the sequences a and b (Myers' O((N+M)D)
    greedy algorithm: fast when the two are close, as neighbouring steps are)."""
    n, m = len(a), len(b)
    v = {1: 0}
    for d in range(n + m + 1):
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[k - 1] < v[k + 1]):
                x = v[k + 1]
            else:
                x = v[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            v[k] = x
            if x >= n and y >= m:
                return (n + m - d) // 2
    return 0


def changed_lines(a, b):
    """Removed + added lines of a minimal line diff of a into b."""
    return len(a) + len(b) - 2 * lcs_length(a, b)


def matched_lines(a, b):
    """The indices of a and of b that a minimal diff keeps (an LCS), as two sets; every other
    line is removed (in a) or added (in b). Dynamic programming over the lines between the
    common prefix and suffix, which is small for neighbouring steps."""
    lo = 0
    while lo < len(a) and lo < len(b) and a[lo] == b[lo]:
        lo += 1
    hi_a, hi_b = len(a), len(b)
    while hi_a > lo and hi_b > lo and a[hi_a - 1] == b[hi_b - 1]:
        hi_a, hi_b = hi_a - 1, hi_b - 1
    keep_a = set(range(lo)) | set(range(hi_a, len(a)))
    keep_b = set(range(lo)) | set(range(hi_b, len(b)))
    ma, mb = a[lo:hi_a], b[lo:hi_b]
    n, m = len(ma), len(mb)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        row, below = table[i], table[i + 1]
        for j in range(m - 1, -1, -1):
            row[j] = below[j + 1] + 1 if ma[i] == mb[j] else max(below[j], row[j + 1])
    i = j = 0
    while i < n and j < m:
        if ma[i] == mb[j]:
            keep_a.add(lo + i)
            keep_b.add(lo + j)
            i, j = i + 1, j + 1
        elif table[i + 1][j] >= table[i][j + 1]:
            i += 1
        else:
            j += 1
    return keep_a, keep_b


# --- what a line is -----------------------------------------------------------------------------

def code_only(line, in_block):
    """The code of one line: comments removed (// to the end of the line, /* ... */, which may
    span lines: `in_block` says whether the line starts inside one), string and character
    literals kept as they are. Returns (code, in_block after the line)."""
    out, i, quote = [], 0, None
    while i < len(line):
        c = line[i]
        if in_block:
            if line.startswith("*/", i):
                in_block, i = False, i + 2
            else:
                i += 1
            continue
        if quote:
            out.append(c)
            if c == "\\" and i + 1 < len(line):
                out.append(line[i + 1])
                i += 1
            elif c == quote:
                quote = None
            i += 1
            continue
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            in_block, i = True, i + 2
            continue
        if c in "\"'":
            quote = c
        out.append(c)
        i += 1
    return "".join(out).rstrip(), in_block


def code_lines(lines):
    """The lines that hold code (comments and blank lines left out), comments stripped."""
    result, in_block = [], False
    for line in lines:
        code, in_block = code_only(line, in_block)
        if code.strip():
            result.append(code)
    return result


NOT_A_NAME = {"__launch_bounds__", "__attribute__", "alignas", "decltype", "sizeof",
              "static_assert", "if", "for", "while", "switch", "return", "template"}


def definition_name(text):
    """The name a definition's text (its lines up to the body, joined) introduces."""
    m = re.match(r"^(?:template\s*<[^;{]*?>\s*)?(?:struct|class|union|enum(?:\s+class)?)\s+(\w+)",
                 text)
    if m:
        return m.group(1)
    head = text.split("(")[0]
    if "=" in head:  # a variable: the name before its initializer
        m = re.search(r"(\w+)\s*(?:\[[^=]*\])?\s*=", head)
        if m:
            return m.group(1)
    for m in re.finditer(r"(\w+)\s*(?:<[^()<>]*>)?\s*\(", text):
        if m.group(1) not in NOT_A_NAME:
            return m.group(1)
    names = re.findall(r"\w+", text)
    return names[-1] if names else "(file scope)"


def owners(lines):
    """For every line, the name of the top-level definition it belongs to: a function, struct
    or macro call at namespace scope, or a macro (#define, and the #ifndef around it), each
    with the comment lines right above it; "(file scope)" for includes, namespaces and
    comments that stand alone. Namespace braces are transparent; braces in comments and
    literals do not count."""
    result = ["(file scope)"] * len(lines)
    depth, kinds = 0, []  # brace depth (namespaces excluded), and the kind of each open brace
    pending = []  # comment lines waiting for the definition they describe
    current, text = None, ""  # the lines and the joined code of the definition being read
    macro = "(file scope)"  # the macro of the current #ifndef/#define/#endif run
    in_block = False
    continues = False  # the previous line was a #define ending in a backslash
    for i, line in enumerate(lines):
        code, in_block = code_only(line, in_block)
        stripped = code.strip()
        if current is None and depth == 0:
            if continues or stripped.startswith("#"):
                m = re.match(r"#\s*(?:define|ifndef|ifdef|undef)\s+(\w+)", stripped)
                if m:
                    macro = m.group(1)
                elif not continues and not re.match(r"#\s*(?:endif|else|elif)", stripped):
                    macro = "(file scope)"
                for p in pending + [i]:
                    result[p] = macro
                pending = []
                continues = code.endswith("\\")
                continue
            if not stripped:
                if line.strip():  # a comment line
                    pending.append(i)
                else:  # a blank line: the comments above it stand alone
                    pending = []
                continue
            if re.match(r"^(namespace\b|\}|extern\s+\"C\"\s*\{)", stripped):
                pending = []
            else:
                current, text = pending + [i], ""
                pending = []
        elif current is not None:
            current.append(i)
        if current is not None and depth == 0:
            text += " " + stripped
        for ch in code:
            if ch == "{":
                namespace = depth == 0 and re.match(r"^\s*(namespace\b|extern\s+\"C\")", code)
                kinds.append("ns" if namespace else "code")
                depth += 0 if namespace else 1
            elif ch == "}" and kinds and kinds.pop() == "code":
                depth -= 1
        if current is not None and depth == 0 and stripped.endswith((";", "}")):
            name = definition_name(text.strip())
            for p in current:
                result[p] = name
            current = None
    for i, line in enumerate(lines):  # the comment that opens the file
        if not line.strip().startswith("//"):
            break
        result[i] = "(file comment)"
    return result


# --- the report -----------------------------------------------------------------------------------

def read_budget(path):
    """The pairs of the budget file: (parent, child, budget or None, reason), in file order."""
    pairs, errors = [], []
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split(None, 3)
            if len(fields) < 4:
                errors.append("%s:%d: expected 'parent child max-all-lines reason'" % (path, number))
                continue
            parent, child, budget, reason = fields
            if budget != "-" and not budget.isdigit():
                errors.append("%s:%d: budget %r is neither a number nor '-'" % (path, number, budget))
                continue
            pairs.append((parent, child, None if budget == "-" else int(budget), reason))
    return pairs, errors


def parents(path=None):
    """{child: parent} of every pair in the budget file: the one place that says which step
    each step's lesson starts from (lab.py and common/python/results.py read it here)."""
    pairs, _ = read_budget(path or BUDGET_FILE)
    return {child: parent for parent, child, _, _ in pairs}


def diff_u_count(path_a, path_b):
    """`diff -u path_a path_b | grep -c '^[-+]'`, the budget's measure, or None without diff."""
    tool = shutil.which("diff")
    if tool is None:
        return None
    run = subprocess.run([tool, "-u", path_a, path_b], stdout=subprocess.PIPE,
                         universal_newlines=True)
    if run.returncode not in (0, 1):
        return None
    return sum(1 for line in run.stdout.splitlines() if line[:1] in "-+" and line)


def measure(repo, parent, child):
    """The numbers of one pair (both kernel.cu files must exist)."""
    with open(os.path.join(repo, parent, "kernel.cu")) as f:
        a = f.read().splitlines()
    with open(os.path.join(repo, child, "kernel.cu")) as f:
        b = f.read().splitlines()
    keep_a, keep_b = matched_lines(a, b)
    removed = [i for i in range(len(a)) if i not in keep_a]
    added = [i for i in range(len(b)) if i not in keep_b]
    all_lines = diff_u_count(os.path.join(repo, parent, "kernel.cu"),
                             os.path.join(repo, child, "kernel.cu"))
    if all_lines is None:  # no diff(1) here: a minimal diff, which GNU diff can exceed a little
        all_lines = len(removed) + len(added) + (2 if removed or added else 0)
    ca, cb = code_lines(a), code_lines(b)
    code_changed = changed_lines(ca, cb)
    code_removed = len(ca) - lcs_length(ca, cb)
    own_a, own_b = owners(a), owners(b)
    touched = []
    for name in [own_b[i] for i in added] + [own_a[i] for i in removed]:
        if name not in touched:
            touched.append(name)
    return {"parent": parent, "child": child, "all_lines": all_lines,
            "code_removed": code_removed, "code_added": code_changed - code_removed,
            "touched": touched, "lines_parent": len(a), "lines_child": len(b)}


def report(repo, budget_file):
    """Rows for every pair whose folders exist, and the problems --check fails on."""
    pairs, problems = read_budget(budget_file)
    steps = sorted(d for d in os.listdir(repo)
                   if STEP_DIR.match(d) and os.path.isfile(os.path.join(repo, d, "kernel.cu")))
    children = {c for _, c, _, _ in pairs}
    for s in steps[1:]:
        if s not in children:
            problems.append("%s has no line in %s (parent child max-all-lines reason)"
                            % (s, os.path.relpath(budget_file, repo)))
    rows = []
    for parent, child, budget, reason in pairs:
        if child not in steps or parent not in steps:
            continue
        row = measure(repo, parent, child)
        row.update(budget=budget, reason=reason)
        row["over"] = budget is not None and row["all_lines"] > budget
        if row["over"]:
            problems.append("%s -> %s: %d lines changed, budget %d (%s)"
                            % (parent, child, row["all_lines"], budget, reason))
        rows.append(row)
    return rows, problems


def text_table(rows):
    out = ["%-22s %-22s %12s %9s %7s  %s" % ("parent", "child", "code -/+", "all", "budget",
                                             "functions touched")]
    for r in rows:
        out.append("%-22s %-22s %12s %9d %7s  %s" % (
            r["parent"], r["child"], "-%d/+%d" % (r["code_removed"], r["code_added"]),
            r["all_lines"], "-" if r["budget"] is None else r["budget"],
            ", ".join(r["touched"]) + ("   OVER BUDGET" if r["over"] else "")))
    return "\n".join(out)


def markdown(rows, problems):
    lines = [
        "# The diff between neighbouring steps {#diff_report}",
        "",
        "Generated by `common/scripts/diff_report.py` when the documentation is built; the pairs "
        "and their budgets come from `common/scripts/diff_budget.txt`. Each step's lesson is "
        "`diff -u <parent>/kernel.cu <step>/kernel.cu`: this page says how large each of those "
        "diffs is and what it touches, so that a diff holding more than its one idea shows. The "
        "host test `host.diff_report` fails when a pair grows past its budget.",
        "",
        "- **code lines**: removed / added lines once comments and blank lines are left out;",
        "- **all lines**: `diff -u parent/kernel.cu child/kernel.cu | grep -c '^[-+]'` "
        "(comments included, plus the two header lines), bounded by the budget;",
        "- **touched**: the functions, structs and macros that hold a changed line (doc "
        "comments included).",
        "",
        "| parent | step | code lines -/+ | all lines | budget | what the diff is | touched |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append("| %s | %s | -%d / +%d | %d%s | %s | %s | %s |" % (
            r["parent"], r["child"], r["code_removed"], r["code_added"], r["all_lines"],
            " (over)" if r["over"] else "", "-" if r["budget"] is None else r["budget"],
            r["reason"].replace("|", "/"), ", ".join("`%s`" % t for t in r["touched"])))
    if problems:
        lines += ["", "Problems found when this page was made:", ""]
        lines += ["- " + p for p in problems]
    return "\n".join(lines) + "\n"


# --- self-test ------------------------------------------------------------------------------------

def self_test():
    """The counting on cases whose answer is known; returns the failures."""
    fails = []

    def expect(what, got, want):
        if got != want:
            fails.append("%s: got %r, want %r" % (what, got, want))

    expect("lcs of equal", lcs_length(list("abc"), list("abc")), 3)
    expect("lcs disjoint", lcs_length(list("abc"), list("xyz")), 0)
    expect("changed", changed_lines(list("abcd"), list("abxd")), 2)
    expect("changed insert", changed_lines(list("ac"), list("abc")), 1)
    a, b = list("axbycz"), list("abc")
    ka, kb = matched_lines(a, b)
    expect("matched size", (len(ka), len(kb)), (3, 3))
    expect("code only", code_only('  int x = 1;  // one "two"', False), ("  int x = 1;", False))
    expect("code in string", code_only('  s = "a // b";', False), ('  s = "a // b";', False))
    expect("block comment", code_only("x /* y", False), ("x", True))
    expect("block end", code_only("y */ z", True), (" z", False))
    expect("code lines", code_lines(["/// doc", "", "int f() {", "  return 1;  // r", "}"]),
           ["int f() {", "  return 1;", "}"])
    text = ["#include <x>", "", "namespace {", "", "/// Doc.", "template <class T>",
            "__device__ int add(int a,", "                  int b) {", "  return a + b;", "}",
            "", "#define KNOB 3", "struct Tile {", "  int n;", "};", "", "}  // namespace",
            "", "FA_REGISTER_STEP(\"s\", f,", "                 g);"]
    own = owners(text)
    expect("doc comment owner", own[4], "add")
    expect("template owner", own[5], "add")
    expect("body owner", own[8], "add")
    expect("macro owner", own[11], "KNOB")
    expect("struct owner", own[13], "Tile")
    expect("macro call owner", own[19], "FA_REGISTER_STEP")
    expect("variable", definition_name("constexpr int kThreads = 256;"), "kThreads")
    expect("specialization", definition_name("template <> __device__ __half cast<__half>(float x) {"),
           "cast")
    expect("file scope", own[0], "(file scope)")
    expect("file comment", owners(["/// \\file x.cu", "/// What.", "#include <y>"])[1],
           "(file comment)")
    return fails


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a pair is over budget")
    p.add_argument("--markdown", metavar="FILE", help="also write the Doxygen page here")
    p.add_argument("--budget", default=BUDGET_FILE, help="the budget file")
    p.add_argument("--repo", default=REPO, help="the repository root")
    p.add_argument("--self-test", action="store_true", help="check the counting and exit")
    args = p.parse_args(argv)
    if args.self_test:
        fails = self_test()
        for f in fails:
            print("diff_report self-test: " + f)
        print("diff_report self-test: %s" % ("FAILED" if fails else "ok"))
        return 1 if fails else 0
    rows, problems = report(args.repo, args.budget)
    print(text_table(rows))
    for prob in problems:
        print("diff_report: " + prob)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, problems))
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
