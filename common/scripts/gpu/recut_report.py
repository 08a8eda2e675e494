#!/usr/bin/env python3
"""Tables for common/scripts/gpu/recut.sh (issue #13) from the bench's and compare.py's JSON.

    recut_report.py chain BENCH.json STEPS         each step's gain over the one before it,
                                                   with the issue's bounds (02 >= 01, then >= 0.97x)
    recut_report.py whatif BENCH.json ALTS         the same chain for every choice of variants:
                                                   ALTS = "02_tiled_fa1=02_tiled_fa1_bn128,...;03_loop_swap=..."
    recut_report.py ratios BENCH.json BASE=V1,V2;BASE2=...   variant / default, shape by shape
    recut_report.py riders BENCH.json OUT.md       the 05 riders as a Markdown block for its README
    recut_report.py agree COMPARE.json BENCH.json  bench vs compare.py per step, direction and shape (issue:
                                                   within 5%; BENCH.json "-": none), 06 / PyTorch
                                                   FLASH, and the control: 07's forward over 06's
                                                   (the same machine code) in each tool
    recut_report.py bars RUN.json [RUN.json ...]   issues 13 and 14's speed bars over several compare.py
                                                   runs: per cell, the median over the runs of 06's
                                                   forward and 07's backward over FLASH's, its range,
                                                   and in how many runs it was under its bar; a
                                                   warning first where the runs mix the warm-ups
                                                   (one by one before cd5a5c4, batched since)
    recut_report.py rounds RUN.json                how far apart each cell's rounds lie (--rounds), per
                                                   step and direction: the precision of its figures
    recut_report.py regs BUILD.log                 registers and spills per kernel, from ptxas -v

Python 3 standard library only. Prints plain text; exit status 0 unless an input is unreadable.
"""

import itertools
import json
import re
import statistics
import sys

CHAIN = ["01_naive", "02_tiled_fa1", "03_loop_swap", "04_deferred_rescale", "05_split_q",
         "06_causal_skip"]


# The speed bars of the issues, against PyTorch FLASH on the same tensors in one compare.py run,
# at N >= 1024: (step, direction) -> (bar without the mask, bar under causal masking).
BARS = {("06_causal_skip", "fwd"): (1.05, 1.10), ("07_backward", "bwd"): (1.05, 1.05)}


def flash_tflops(rows):
    """{(direction, d, causal, N): TFLOP/s} of PyTorch FLASH's rows of a compare.py run that
    ran (an errored row is left out)."""
    return {(r["direction"], r["head_dim"], bool(r["causal"]), r["seqlen_q"]): r["tflops"]
            for r in rows if r["impl"] == "sdpa_flash" and not r.get("error") and r.get("tflops")}


def load_fwd(path):
    """{(step, d, causal, N): tflops (0 for a failed or errored cell)} and the shapes."""
    rows = [r for r in json.load(open(path))["results"] if r["direction"] == "fwd"]
    tf = {}
    for r in rows:
        ok = r.get("passed", False) and not r.get("error")
        tf[(r["step"], r["head_dim"], bool(r["causal"]), r["seqlen_q"])] = r["tflops"] if ok else 0.0
    shapes = sorted({k[1:] for k in tf})
    return tf, shapes


def bound(i):
    return 1.0 if i == 1 else 0.97


def chain_misses(tf, shapes, steps):
    """[(ratio / bound, text)] for every link of the chain `steps` (01..06) at every shape."""
    out = []
    for d, c, n in shapes:
        for i in range(1, len(steps)):
            a, b = tf.get((steps[i - 1], d, c, n)), tf.get((steps[i], d, c, n))
            if a is None or b is None:
                continue
            g = b / a if a > 0 else 0.0
            out.append((g / bound(i), "%s / %s = %.3f at d=%d causal=%d N=%d (bound %.2f)"
                        % (steps[i], steps[i - 1], g, d, c, n, bound(i))))
    return out


def cmd_chain(path, steps):
    tf, shapes = load_fwd(path)
    steps = steps.split(",")
    print("TFLOP/s (gain over the step before); '!' marks a miss of the issue's bound")
    print("d   causal N      " + " ".join("%-15s" % s[:15] for s in steps))
    for d, c, n in shapes:
        cells = []
        for i, s in enumerate(steps):
            t = tf.get((s, d, c, n))
            if t is None:
                cells.append("%-15s" % "-")
            elif i == 0 or t == 0:
                cells.append("%-15s" % ("%.1f" % t if t else "FAIL"))
            else:
                p = tf.get((steps[i - 1], d, c, n)) or 0
                g = t / p if p > 0 else 0
                cells.append("%-15s" % ("%.1f (%.2fx)%s" % (t, g, "!" if g < bound(i) else "")))
        print("%-3d %-6d %-6d " % (d, c, n) + " ".join(cells))
    fails = [k for k, v in tf.items() if v == 0]
    misses = [m for m in chain_misses(tf, shapes, steps) if m[0] < 1]
    print("failed cells: %d%s" % (len(fails), "".join("\n  %s d=%d causal=%d N=%d" % k for k in fails)))
    print("misses: %d" % len(misses))
    for _, text in sorted(misses):
        print("  " + text)


def cmd_whatif(path, alts):
    """Every combination of the alternatives; the default chain is CHAIN."""
    tf, shapes = load_fwd(path)
    choices = []
    alt = dict(a.split("=", 1) for a in alts.split(";") if a)
    for s in CHAIN:
        choices.append([s] + [v for v in alt.get(s, "").split(",") if v])
    results = []
    for combo in itertools.product(*choices):
        if any(not any(k[0] == s for k in tf) for s in combo):
            continue
        links = chain_misses(tf, shapes, list(combo))
        if not links:
            continue
        misses = [l for l in links if l[0] < 1]
        worst = min(links)
        results.append((len(misses), -worst[0], combo, worst[1]))
    results.sort()
    print("every choice of variants (%d), fewest misses first; worst link (ratio / bound):"
          % len(results))
    shown = results[:10] + [r for r in results[10:] if list(r[2]) == CHAIN]
    for n, w, combo, text in shown:
        picked = [c for c, s in zip(combo, CHAIN) if c != s] or ["defaults"]
        print("  misses %2d  worst %.3f  %-58s %s" % (n, -w, " ".join(picked), text))


def cmd_ratios(path, groups):
    tf, shapes = load_fwd(path)
    for g in groups.split(";"):
        base, others = g.split("=", 1)
        others = others.split(",")
        print("%s vs its variants: TFLOP/s (variant / default)" % base)
        print("d   causal N      %-10s " % "default" + " ".join("%-24s" % o for o in others))
        for d, c, n in shapes:
            b = tf.get((base, d, c, n))
            if b is None or all(tf.get((o, d, c, n)) is None for o in others):
                continue
            cells = []
            for o in others:
                v = tf.get((o, d, c, n))
                cells.append("%-24s" % ("-" if v is None else "%.1f (%.2fx)" % (v, v / b if b else 0)))
            print("%-3d %-6d %-6d %-10.1f " % (d, c, n, b) + " ".join(cells))


def cmd_riders(path, out_md):
    doc = json.load(open(path))
    tf, shapes = load_fwd(path)
    gpu, run = doc.get("gpu", {}), doc.get("run", {})
    md = ["Measured on **%s** (%s SMs), commit `%s`, %s, with `%s`: TFLOP/s, fp16, 16K tokens, "
          "hidden 2048, forward; in brackets the ratio to the default build (both riders on). "
          "Each variant is this kernel.cu built with the switch set, registered as an extra step "
          "(`common/scripts/gpu/recut.sh`)." % (gpu.get("name", "?"), gpu.get("sm_count", "?"),
                                                run.get("commit", "?"), run.get("date", "?"),
                                                run.get("command", "?")),
          "", "| d | causal | seqlen | default | `FA_FWD_BLOCK_M=64` | `FA_RESCALE_SKIP=0` | both off |",
          "|---|---|---|---|---|---|---|"]
    for d, c, n in shapes:
        b = tf.get(("05_split_q", d, c, n))
        if b is None:
            continue
        cell = lambda o: ("%.1f (%.2fx)" % (tf.get((o, d, c, n), 0.0), tf.get((o, d, c, n), 0.0) / b)
                          if b else "-")
        md.append("| %d | %s | %d | %.1f | %s | %s | %s |" % (
            d, "yes" if c else "no", n, b, cell("05_split_q_bm64"), cell("05_split_q_noskip"),
            cell("05_split_q_bm64_noskip")))
    open(out_md, "w").write("\n".join(md) + "\n")
    print("\n".join(md[2:]))


def cmd_agree(cmp_path, bench_path):
    rows = json.load(open(cmp_path))["results"]
    bench = {} if bench_path == "-" else {
        (r["step"], r["direction"], r["head_dim"], bool(r["causal"]), r["seqlen_q"]): r
        for r in json.load(open(bench_path))["results"]}
    flash = flash_tflops(rows)
    fwd, bwd = BARS[("06_causal_skip", "fwd")], BARS[("07_backward", "bwd")]
    print("bench vs compare.py, same step, direction and shape (issue: within 5%%; b/c: bench ms "
          "over compare.py ms, > 1 where compare.py is the faster); step / FLASH "
          "(06 forward: issue >= %g, causal >= %g; 07 backward: >= %g)" % (fwd + bwd[:1]))
    print("step                 dir d   causal N      bench ms  compare ms  b/c     vs FLASH")
    worst = {}  # (step, direction) -> largest |bench / compare.py - 1|
    for r in rows:
        if r.get("kind") != "step" or not r.get("median_ms"):
            continue
        key = (r["impl"], r["direction"], r["head_dim"], bool(r["causal"]), r["seqlen_q"])
        b = bench.get(key)
        if bench and not any(k[0] == key[0] for k in bench):
            continue
        f = flash.get(key[1:])
        vs = "%.2fx" % (r["tflops"] / f) if f else "-"
        head = "%-20s %-3s %-3d %-6d %-6d" % (key[0], key[1], key[2], key[3], key[4])
        if not b or not b.get("median_ms"):
            print("%s %-9s %-11.3f %-7s %s" % (head, "-", r["median_ms"], "-", vs))
            continue
        ratio = b["median_ms"] / r["median_ms"]
        worst[key[:2]] = max(worst.get(key[:2], 0.0), abs(ratio - 1))
        print("%s %-9.3f %-11.3f %-7.3f %s%s" % (head, b["median_ms"], r["median_ms"], ratio, vs,
                                                 " !" if abs(ratio - 1) > 0.05 else ""))
    for (step, direction), w in sorted(worst.items()):
        print("largest disagreement %-20s %s: %.1f%%%s" % (step, direction, 100 * w,
                                                           " (over 5%)" if w > 0.05 else ""))
    if worst:
        print("largest bench/compare.py disagreement: %.1f%%" % (100 * max(worst.values())))
    ratios = {}  # causal -> [(06 / FLASH, shape)]
    for r in rows:
        f = flash.get((r["direction"], r["head_dim"], bool(r["causal"]), r["seqlen_q"]))
        if r["impl"] == "06_causal_skip" and r["direction"] == "fwd" and f and r["seqlen_q"] >= 1024:
            ratios.setdefault(bool(r["causal"]), []).append(
                (r["tflops"] / f, "d=%d N=%d" % (r["head_dim"], r["seqlen_q"])))
    # The control: 07's forward kernel is 06's, instruction for instruction (cuobjdump, sm_90,
    # 07_backward/NOTES.md); within one tool the two forward rows differ only by the timing.
    tools = [("compare.py", {(r["impl"], r["head_dim"], bool(r["causal"]), r["seqlen_q"]): r
                             for r in rows if r["direction"] == "fwd"})]
    if bench:
        tools.append(("bench", {(k[0],) + k[2:]: r for k, r in bench.items() if k[1] == "fwd"}))
    for tool, cells in tools:
        control = [(cells[k]["median_ms"] / cells[("06_causal_skip",) + k[1:]]["median_ms"], k)
                   for k in cells if k[0] == "07_backward" and cells[k].get("median_ms")
                   and cells.get(("06_causal_skip",) + k[1:], {}).get("median_ms")]
        if control:
            lo, hi = min(control), max(control)
            print("control, %s: 07 / 06 forward (the same machine code), ms ratio %.3f (d=%d "
                  "causal=%d N=%d) to %.3f (d=%d causal=%d N=%d) over %d shapes"
                  % ((tool, lo[0]) + lo[1][1:] + (hi[0],) + hi[1][1:] + (len(control),)))
    print("06 / FLASH, N >= 1024: " + "; ".join(
        "%s min %.3f at %s (issue: >= %.2f)" % ("causal" if c else "non-causal", min(v)[0],
                                              min(v)[1], BARS[("06_causal_skip", "fwd")][c])
        for c, v in sorted(ratios.items())))


def bar_ratios(paths):
    """{(step, direction, d, causal, N): [step / FLASH, one per run that has the cell]}. A step
    row that errored or failed its check counts as 0 (a wrong kernel meets no speed bar); a
    cell whose FLASH row is missing or errored is left out of that run."""
    ratios = {}
    for path in paths:
        rows = json.load(open(path))["results"]
        flash = flash_tflops(rows)
        for r in rows:
            key = (r["impl"], r["direction"], r["head_dim"], bool(r["causal"]), r["seqlen_q"])
            f = flash.get(key[1:])
            if key[:2] not in BARS or key[4] < 1024 or not f:
                continue
            ok = r.get("passed", False) and not r.get("error") and r.get("tflops")
            ratios.setdefault(key, []).append(r["tflops"] / f if ok else 0.0)
    return ratios


def warmup_of(path):
    """Which warm-up a compare.py run had: "batched" (since cd5a5c4: its settings' timing names
    the batches) or "one by one" (each warm-up run waited for, before cd5a5c4). The two time
    short cells from different clock states (the README, "Burst or sustained")."""
    timing = json.load(open(path)).get("settings", {}).get("timing", "")
    return "batched" if "batches" in timing else "one by one"


def bar_table(paths):
    """The lines that cmd_bars prints, and the cells under their bar on the median."""
    ratios = bar_ratios(paths)
    lines, misses = [], []
    kinds = [warmup_of(p) for p in paths]
    if len(set(kinds)) > 1:
        lines.append("warning: these runs mix the warm-ups (%s); a short cell times from another "
                     "clock state under each, so judge each kind on its own" % ", ".join(
                         "%d %s" % (kinds.count(k), k) for k in sorted(set(kinds))))
    for step, direction in sorted({k[:2] for k in ratios}):
        cells = {k[2:]: v for k, v in ratios.items() if k[:2] == (step, direction)}
        ns = sorted({k[2] for k in cells})
        bars = BARS[(step, direction)]
        lines.append("%s %s / FLASH, %d runs; bars %.2f, causal %.2f (N >= 1024). Per cell: the "
                     "median over the runs [lowest-highest] runs under the bar / runs"
                     % (step, direction, max(len(v) for v in cells.values()), bars[0], bars[1]))
        lines.append("d   causal " + " ".join("%-27s" % ("N=%d" % n) for n in ns).rstrip())
        for d, causal in sorted({k[:2] for k in cells}):
            bar = bars[1] if causal else bars[0]
            text = []
            for n in ns:
                v = cells.get((d, causal, n))
                if not v:
                    text.append("%-27s" % "-")
                    continue
                med = statistics.median(v)
                if med < bar:
                    misses.append((step, direction, d, causal, n, med))
                text.append("%-27s" % ("%s%.3f [%.3f-%.3f] %d/%d" % (
                    "*" if med < bar else "", med, min(v), max(v), sum(x < bar for x in v),
                    len(v))))
            lines.append("%-3d %-6s " % (d, "yes" if causal else "no") + " ".join(text).rstrip())
        under = [m for m in misses if m[:2] == (step, direction)]
        lines.append("%s %s: %d of %d cells under the bar on the median (marked *)%s" % (
            step, direction, len(under), len(cells), "".join(
                "; d=%d%s N=%d %.3f" % (m[2], " causal" if m[3] else "", m[4], m[5])
                for m in under)))
    return lines, misses


def cmd_bars(*paths):
    lines, _ = bar_table(paths)
    print("\n".join(lines))


def cmd_rounds(path):
    """How far the rounds of each cell lie apart (--rounds; the README, "Burst or sustained"):
    per implementation and direction, the median and largest |round 2 / round 1 - 1|."""
    spread = {}
    for r in json.load(open(path))["results"]:
        rounds = r.get("round_ms")
        if r.get("error") or not rounds or len(rounds) < 2 or min(rounds) <= 0:
            continue
        key = (r.get("impl") or r.get("step"), r["direction"])
        spread.setdefault(key, []).append(max(rounds) / min(rounds) - 1)
    if not spread:
        print("no cell with two or more rounds in %s" % path)
        return
    print("rounds of one cell, max/min - 1 over its round medians: median and largest over the shapes")
    for (impl, direction), v in sorted(spread.items()):
        v.sort()
        print("%-20s %-3s median %4.1f%%  largest %4.1f%%  (%d cells)"
              % (impl, direction, 100 * v[len(v) // 2], 100 * v[-1], len(v)))


def cmd_regs(log_path):
    """ptxas -v lines of the kernels, grouped by the object file Ninja was building."""
    obj, entry, spill, seen = "?", None, "?", []
    for line in open(log_path, errors="replace"):
        m = re.search(r"Building CUDA object (\S+)", line)
        if m:
            obj = m.group(1)
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            spill = "?"
            k = re.search(r"flash_forward_kernelI(\w+?)Li(\d+)E", m.group(1))
            entry = "%s d=%s %s" % ("bf16" if k and "bfloat" in k.group(1) else "fp16",
                                    k.group(2) if k else "?", m.group(2)) if k else None
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and entry:
            spill = "%s/%s B spilled" % m.groups()
        m = re.search(r"Used (\d+) registers", line)
        if m and entry and "fp16" in entry and "kernel.cu" in obj:
            name = re.sub(r"/CMakeFiles.*", "", obj).replace("labs/", "")
            seen.append("%-34s %-18s %3s regs, %s" % (name, entry, m.group(1), spill))
            entry = None
    print("\n".join(sorted(set(seen))))


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    cmd, args = argv[1], argv[2:]
    {"chain": cmd_chain, "whatif": cmd_whatif, "ratios": cmd_ratios, "riders": cmd_riders,
     "agree": cmd_agree, "bars": cmd_bars, "rounds": cmd_rounds, "regs": cmd_regs}[cmd](*args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
