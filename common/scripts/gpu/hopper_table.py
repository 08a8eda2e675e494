#!/usr/bin/env python3
"""One table of hopper.sh's compare.py runs: TFLOP/s of FLASH, cuDNN and steps 09 and 10 as
built, their ratios to FLASH against issue 16's bars, and 09 and 10 under each tuning variant
(FA_HOPPER_* knobs) beside them.

    python3 common/scripts/gpu/hopper_table.py DIR   # reads DIR/cmp_<variant>.json
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


def load(path):
    """{(impl, d, causal, N): row} of the forward rows of one compare.py JSON."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return {(r["impl"], r["head_dim"], bool(r["causal"]), r["seqlen_q"]): r
            for r in doc.get("results", []) if r.get("direction") == "fwd"}


def worse(a, b):
    """The smaller ratio; a missing one (NaN) wins, so that no data never meets a bar."""
    return b if math.isnan(b) or b < a else a


def tflops(rows, impl, d, c, n):
    r = rows.get((impl, d, c, n))
    if r is None or r.get("error") or (r.get("checked") and not r.get("passed")):
        return math.nan
    return r["tflops"]


def bad(rows, name):
    """Step rows of variant `name` that errored or failed compare.py's check."""
    return ["%s %s d=%d %s N=%d: %s" % (name, r["impl"], r["head_dim"], "causal" if r["causal"]
                                        else "none", r["seqlen_q"], r.get("error") or "FAIL")
            for r in rows.values() if r["impl"] in STEPS and
            (r.get("error") or (r.get("checked") and not r.get("passed")))]


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else "."
    base = load(os.path.join(folder, "cmp_default.json"))
    variants = {}
    for path in sorted(glob.glob(os.path.join(folder, "cmp_*.json"))):
        name = os.path.basename(path)[4:-5]
        if name != "default":
            variants[name] = load(path)
    print("TFLOP/s, fp16 forward, 16K tokens, hidden 2048 (compare.py, one run); x = ratio to "
          "FLASH of this run")
    head = "%4s %-6s %6s %7s %7s | %7s %7s | %6s %6s %8s" % (
        "d", "mask", "N", "FLASH", "cuDNN", "09", "10", "09/FL", "10/FL", "10/cuDNN")
    for name in variants:
        head += " | %-22s" % (name + " 09, 10")
    print(head)
    worst = {}
    worst_variant = {}
    for d in (64, 128):
        for c in (False, True):
            for n in SEQLENS:
                fl = tflops(base, "sdpa_flash", d, c, n)
                cu = tflops(base, "sdpa_cudnn", d, c, n)
                s9, s10 = (tflops(base, s, d, c, n) for s in STEPS)
                line = "%4d %-6s %6d %7.1f %7.1f | %7.1f %7.1f | %6.2f %6.2f %8.2f" % (
                    d, "causal" if c else "none", n, fl, cu, s9, s10, s9 / fl, s10 / fl, s10 / cu)
                for step, v in zip(STEPS, (s9, s10)):
                    worst[(step, d)] = worse(worst.get((step, d), math.inf), v / fl)
                for name, rows in variants.items():
                    v9, v10 = (tflops(rows, s, d, c, n) for s in STEPS)
                    if math.isnan(v9) and math.isnan(v10):
                        line += " | %-22s" % "-"
                        continue
                    line += " | %6.1f %6.1f (%4.2fx)" % (v9, v10, v10 / fl)
                    for step, v in zip(STEPS, (v9, v10)):
                        key = (name, step, d)
                        worst_variant[key] = worse(worst_variant.get(key, math.inf), v / fl)
                print(line)
    verdict = []
    for (step, d), bar in sorted(BARS.items()):
        w = worst.get((step, d), math.nan)
        verdict.append("%s d=%d worst %.2fx (bar %.2f: %s)" % (
            step[:2], d, w, bar, "MET" if w >= bar else "MISSED"))
    print("bars (as built, seqlen 1024..16384, causal off and on): " + "; ".join(verdict))
    for (name, step, d), w in sorted(worst_variant.items()):
        bar = BARS[(step, d)]
        print("  variant %-12s %s d=%d: worst %.2fx FLASH (bar %.2f)" % (name, step[:2], d, w,
                                                                          bar))
    problems = bad(base, "default") + [p for name, rows in variants.items()
                                       for p in bad(rows, name)]
    print("step rows that errored or failed the check: %d" % len(problems))
    for p in problems[:20]:
        print("  " + p)


if __name__ == "__main__":
    main()
