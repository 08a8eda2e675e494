#!/usr/bin/env python3
"""The tables of hopper.sh's compare.py runs: TFLOP/s of PyTorch FLASH, cuDNN and steps 09 and
10 as built, their ratios against issue 16's bars, and, when hopper.sh ran the variants, what
each change of step 09 gains: the steps as built against the same steps without it
(FA_HOPPER_GRID=tiles: no persistent grid; FA_HOPPER_BLOCK_M=128: two consumers at d = 64).

    python3 common/scripts/gpu/hopper_table.py DIR          # DIR/cmp_<run>.json or
                                                            # DIR/hopper_compare_<run>.json
    python3 common/scripts/gpu/hopper_table.py --rows FILE  # one line: rows, failed, complete
"""
import glob
import json
import math
import os
import sys

STEPS = ("09_hopper_wgmma", "10_hopper_pingpong")
BARS = {("09_hopper_wgmma", 64): 1.15, ("09_hopper_wgmma", 128): 1.30,
        ("10_hopper_pingpong", 64): 1.30, ("10_hopper_pingpong", 128): 1.60}
SEQLENS = (1024, 2048, 4096, 8192, 16384)
# The variants hopper.sh measures: what each one takes away from the steps as built.
WITHOUT = {"tiles": "without the persistent grid (FA_HOPPER_GRID=tiles)",
           "bm128": "without the third consumer at d = 64 (FA_HOPPER_BLOCK_M=128)"}


def bad_rows(doc):
    """Step rows of a compare.py document that errored or failed its check."""
    return [r for r in doc.get("results", []) if r.get("kind", "step") == "step" and
            r.get("impl") in STEPS and
            (r.get("error") or (r.get("checked") and not r.get("passed")))]


def rows_line(path):
    """hopper.sh's one-line account of one compare.py JSON."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        return "no JSON (%s)" % e.__class__.__name__
    done = "" if doc.get("complete") else ", INCOMPLETE (%s)" % doc.get("aborted",
                                                                        "timeout or crash")
    return "%d rows, %d step rows failed or errored%s" % (len(doc.get("results", [])),
                                                          len(bad_rows(doc)), done)


def load(path):
    """{(impl, d, causal, N): row} of the forward rows of one compare.py JSON, and the bad
    step rows."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}, []
    rows = {(r["impl"], r["head_dim"], bool(r["causal"]), r["seqlen_q"]): r
            for r in doc.get("results", []) if r.get("direction") == "fwd"}
    return rows, bad_rows(doc)


def worse(a, b):
    """The smaller ratio; a missing one (NaN) wins, so that no data never meets a bar."""
    return b if math.isnan(b) or b < a else a


def tflops(rows, impl, d, c, n):
    r = rows.get((impl, d, c, n))
    if r is None or r.get("error") or (r.get("checked") and not r.get("passed")):
        return math.nan
    return r["tflops"]


def runs(folder):
    """{run name: path}: cmp_<name>.json (hopper.sh's working folder) or
    hopper_compare_<name>.json (its $OUT)."""
    found = {}
    for prefix in ("hopper_compare_", "cmp_"):
        for path in sorted(glob.glob(os.path.join(folder, prefix + "*.json"))):
            found[os.path.basename(path)[len(prefix):-5]] = path
    return found


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--rows":
        print(rows_line(sys.argv[2]))
        return
    folder = sys.argv[1] if len(sys.argv) > 1 else "."
    paths = runs(folder)
    base, problems = load(paths.get("default", ""))
    variants = {}
    for name, path in paths.items():
        if name != "default":
            variants[name], bad = load(path)
            problems += bad
    print("TFLOP/s, fp16 forward, 16K tokens, hidden 2048 (compare.py, one run); ratios to "
          "FLASH and cuDNN of this run")
    print("%4s %-6s %6s %7s %7s | %7s %7s | %6s %6s %8s" % (
        "d", "mask", "N", "FLASH", "cuDNN", "09", "10", "09/FL", "10/FL", "10/cuDNN"))
    worst = {}
    for d in (64, 128):
        for c in (False, True):
            for n in SEQLENS:
                fl = tflops(base, "sdpa_flash", d, c, n)
                cu = tflops(base, "sdpa_cudnn", d, c, n)
                s9, s10 = (tflops(base, s, d, c, n) for s in STEPS)
                print("%4d %-6s %6d %7.1f %7.1f | %7.1f %7.1f | %6.2f %6.2f %8.2f" % (
                    d, "causal" if c else "none", n, fl, cu, s9, s10, s9 / fl, s10 / fl,
                    s10 / cu))
                for step, v in zip(STEPS, (s9, s10)):
                    worst[(step, d)] = worse(worst.get((step, d), math.inf), v / fl)
    verdict = []
    for (step, d), bar in sorted(BARS.items()):
        w = worst.get((step, d), math.nan)
        verdict.append("%s d=%d worst %.2fx (bar %.2f: %s)" % (
            step[:2], d, w, bar, "MET" if w >= bar else "MISSED"))
    print("bars (seqlen 1024..16384, causal off and on): " + "; ".join(verdict))
    for name, rows in variants.items():
        print("")
        print("%s: TFLOP/s, and the steps as built / this (> 1: the change gains)" %
              WITHOUT.get(name, name))
        print("%4s %-6s %6s | %7s %7s %6s | %7s %7s %6s" % (
            "d", "mask", "N", "09", "09 w/o", "gain", "10", "10 w/o", "gain"))
        for d in (64, 128):
            for c in (False, True):
                for n in SEQLENS:
                    line = "%4d %-6s %6d" % (d, "causal" if c else "none", n)
                    have = False
                    for step in STEPS:
                        with_, without = tflops(base, step, d, c, n), tflops(rows, step, d, c, n)
                        have |= not math.isnan(without)
                        line += " | %7.1f %7.1f %6.2f" % (with_, without, with_ / without)
                    if have:
                        print(line)
    print("step rows that errored or failed the check: %d" % len(problems))
    for r in problems[:20]:
        print("  %s d=%d %s N=%d: %s" % (r["impl"], r["head_dim"],
                                         "causal" if r["causal"] else "none", r["seqlen_q"],
                                         r.get("error") or "FAIL"))


if __name__ == "__main__":
    main()
