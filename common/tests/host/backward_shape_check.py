#!/usr/bin/env python3
"""Issue 14's reading bars for 07_backward/kernel.cu, kept from growing back:

- the backward code (everything after the banner "The backward pass (this step)"; the forward
  above it is step 06's, carried word for word) calls the raw mma wrapper
  `fa::mma_m16n8k16` from at most MAX_MMA_SITES places: every product of Algorithm 2 goes
  through the one warp GEMM building block;
- no top-level definition in the file spans more than MAX_LINES lines from its first code line
  to its last (the comment above it not counted).

Definitions are found as common/scripts/diff_report.py finds them (the same parser, so both
reports name a function the same way). Exits 1 with the offenders named. Python stdlib only.
"""
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "common", "scripts"))
import diff_report  # noqa: E402

KERNEL = os.path.join(ROOT, "07_backward", "kernel.cu")
BANNER = "// The backward pass (this step)"
MAX_MMA_SITES = 4
MAX_LINES = 150


def spans(lines):
    """{definition name: (first code line, last code line)}, 0-based, file scope left out."""
    result, in_block = {}, False
    for i, (line, owner) in enumerate(zip(lines, diff_report.owners(lines))):
        code, in_block = diff_report.code_only(line, in_block)
        if code.strip() and owner not in ("(file scope)", "(file comment)"):
            first, last = result.get(owner, (i, i))
            result[owner] = (min(first, i), max(last, i))
    return result


def check(text):
    """The list of problems of one kernel.cu's text (empty: it meets both bars)."""
    lines = text.split("\n")
    problems = []
    start = next((i for i, line in enumerate(lines) if line.startswith(BANNER)), None)
    if start is None:
        return [f"no line starting with {BANNER!r}: cannot tell the backward from the forward"]
    sites, in_block = [], False
    for i, line in enumerate(lines):
        code, in_block = diff_report.code_only(line, in_block)
        if i > start and re.search(r"\bmma_m16n8k16\s*<", code):
            sites.append(i + 1)
    if len(sites) > MAX_MMA_SITES:
        problems.append(f"the backward calls mma_m16n8k16 from {len(sites)} places (lines "
                        f"{', '.join(map(str, sites))}), more than {MAX_MMA_SITES}")
    for name, (first, last) in sorted(spans(lines).items()):
        if last - first + 1 > MAX_LINES:
            problems.append(f"{name} spans {last - first + 1} lines (lines {first + 1}-"
                            f"{last + 1}), more than {MAX_LINES}")
    return problems


def self_test():
    """The check fails where it should: a planted long function and extra mma sites."""
    fails = []
    body = "\n".join(["  x += 1;"] * (MAX_LINES + 5))
    long_fn = f"{BANNER}\nvoid f() {{\n{body}\n}}\n"
    if not any("f spans" in p for p in check(long_fn)):
        fails.append("a function of more than MAX_LINES lines was not reported")
    calls = "\n".join(["  fa::mma_m16n8k16<T>(a, b, c);"] * (MAX_MMA_SITES + 1))
    many = f"{BANNER}\nvoid g() {{\n{calls}\n}}\n"
    if not any("from 5 places" in p for p in check(many)):
        fails.append("more than MAX_MMA_SITES mma call sites were not reported")
    forward_only = f"void h() {{\n{calls}\n}}\n{BANNER}\n"
    if check(forward_only):
        fails.append("mma calls above the banner (the forward) were counted")
    return fails


def main():
    fails = self_test()
    if fails:
        for f in fails:
            print("backward_shape_check self-test: " + f)
        return 1
    if not os.path.exists(KERNEL):  # a course pack that stops before step 07
        print("backward_shape_check: no 07_backward/kernel.cu here, nothing to check")
        return 0
    with open(KERNEL) as f:
        problems = check(f.read())
    for p in problems:
        print("backward_shape_check: 07_backward/kernel.cu: " + p)
    with open(KERNEL) as f:
        lines = f.read().split("\n")
    name, (first, last) = max(spans(lines).items(), key=lambda kv: kv[1][1] - kv[1][0])
    print(f"backward_shape_check: longest definition {name}, {last - first + 1} lines "
          f"(at most {MAX_LINES}); {'FAILED' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
