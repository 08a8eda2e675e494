#!/usr/bin/env python3
"""Step 08_split_kv side by side (issue 18), in one process on one GPU:

- decode: 08 as built (and, with --candidates, 08 under FA_NUM_SPLITS settings, which libfa
  reads at each call), step 06 and PyTorch's FLASH backend, on the same tensors;
- the paper's training shapes (16K tokens, hidden 2048): 08 against 06, where 08 must run
  step 06's kernel;
- where the time of a decode call goes, kernel by kernel (torch.profiler: 08's split kernel
  and merge, FLASH's), with FLASH's grid (its split count);
- two bandwidth ceilings: torch's device-to-device copy (compare.py's, read + write) and a
  read-only reduction (torch.sum), since a decode kernel only reads.

    python3 common/scripts/gpu/splitkv_tune.py --out splitkv_tune.json [--quick]

Timing: the implementations of a shape are interleaved. In each of --rounds rounds every
implementation is timed over --repeats back-to-back calls (CUDA events around each call, after
one warm-up call; two in the first round), in an order that shifts by one from round to round,
so that a drift of the GPU's clocks or temperature during the shape does not favour one of
them. Reported: the median of all the calls, and the spread of the rounds' medians ((max -
min) / median). "08 again" and "06 again" time the same code a second time: the difference
between two identical entries is the noise floor of the comparison (METHOD.md: a difference
smaller than that is noise). Decode shapes whose K and V fit in the L2 cache rotate among
copies of their tensors, as compare.py does (compare.rotation_sets).

Checks: every implementation's first output is compared with FLASH's (decode) or 06's
(training) on the whole tensor: max|diff| within twice the harness's fp16 bound for O. The
conformance suite (fa_gpu_tests) is what proves the kernels right; this only guards against
timing an output that is wrong.

History: run 6 (commit 5d40a8c) timed seven decode tiles, two split heuristics and two merges
here, compiled in for that run only; 08_split_kv/NOTES.md has the table and the choice. The
candidates are gone from the kernel; this script stays to measure 08 against 06 and FLASH.

Exit status: 0 if every row ran and passed its check, 1 otherwise.
"""

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "common", "python"))

import compare  # noqa: E402  (sdpa_call, kv_bytes, flops, rotation_sets, in_turn, time_calls, ceilings)

#: Variables that select 08's launcher settings; all are cleared before each implementation
#: runs, then its own are set.
KNOBS = ("FA_NUM_SPLITS",)

#: The 08 entries timed by default: (row name, environment). The first is 08 as built.
CANDIDATES = [("08", {})]

STEP08, STEP06, FLASH = "08_split_kv", "06_causal_skip", "FLASH"


def parse_candidates(text):
    """'name:VAR=v,VAR=v;name2:...' -> [(name, {VAR: v})]; '08' alone is the default."""
    out = []
    for item in [x for x in text.split(";") if x.strip()]:
        name, _, env = item.partition(":")
        pairs = dict(p.split("=", 1) for p in env.split(",") if "=" in p)
        unknown = [k for k in pairs if k not in KNOBS]
        if unknown:
            raise SystemExit("splitkv_tune: unknown knob(s) %s (known: %s)" % (unknown, KNOBS))
        out.append((name.strip(), pairs))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="splitkv_tune.json", help="JSON of every row")
    p.add_argument("--sections", default="ceilings,decode,decode2,profile,train",
                   help="which parts, in this order (default: all)")
    p.add_argument("--candidates", type=parse_candidates,
                   help="'name:VAR=v,...;...' instead of the built-in list (VAR in %s)"
                        % ",".join(KNOBS))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape (3)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per round (5)")
    p.add_argument("--train-rounds", type=int, default=5, help="rounds, training shapes (5)")
    p.add_argument("--train-repeats", type=int, default=6, help="calls per round, training (6)")
    p.add_argument("--seed", type=int, default=0, help="input seed (0: from the clock)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and calls (a smoke run)")
    a = p.parse_args(argv)
    a.sections = [s for s in a.sections.split(",") if s]
    a.candidates = a.candidates or CANDIDATES
    if a.quick:
        a.rounds, a.repeats, a.train_rounds, a.train_repeats = 2, 3, 2, 3
    if a.seed == 0:
        a.seed = int(time.time() * 1000) % 1000000007
    return a


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


def decode_shape(b, nk, hkv=8, nq=1, heads=32, d=128):
    return {"batch": b, "seqlen_k": nk, "heads_kv": hkv, "seqlen_q": nq, "heads": heads,
            "head_dim": d, "causal": False}


def decode_grid(quick):
    """The issue's must-show grid: fp16, seqlen_q 1, heads 32 / 8, d 128, batch 1-64, seqlen_k
    1K-128K."""
    batches = [1, 16] if quick else [1, 4, 16, 64]
    nks = [4096, 32768] if quick else [1024 << i for i in range(8)]
    return [decode_shape(b, nk) for b in batches for nk in nks]


def decode_grid2(quick):
    """seqlen_q 16 and heads_kv 32 (MHA), a coarser grid, K and V at most 16 GiB."""
    out = []
    for nq, hkv in ((1, 32), (16, 8), (16, 32)):
        for b in ([1, 16] if quick else [1, 4, 16, 64]):
            for nk in ([16384] if quick else [4096, 16384, 65536]):
                if compare.kv_bytes(b, hkv, nk, 128) <= 16 * 2 ** 30:
                    out.append(decode_shape(b, nk, hkv, nq))
    return out


def train_grid(quick):
    """The paper's sweep as compare.py makes it: 16K tokens, hidden 2048, N = N_q = N_k."""
    out = []
    for d in (64, 128):
        for causal in (False, True):
            for n in ([2048] if quick else [1024, 2048, 4096, 8192, 16384]):
                h = 2048 // d
                out.append({"batch": 16384 // n, "seqlen_k": n, "heads_kv": h, "seqlen_q": n,
                            "heads": h, "head_dim": d, "causal": causal})
    return out


def describe(s):
    if s["seqlen_q"] == s["seqlen_k"] and s["heads"] == s["heads_kv"]:
        return "d=%d %s N=%d B=%d H=%d" % (s["head_dim"], "causal" if s["causal"] else "full",
                                           s["seqlen_q"], s["batch"], s["heads"])
    return "Nq=%d B=%d Nk=%d H=%d/%d" % (s["seqlen_q"], s["batch"], s["seqlen_k"], s["heads"],
                                         s["heads_kv"])


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


class Knobs:
    """Sets exactly one implementation's knobs for the duration of a `with` block."""

    def __init__(self, env):
        self.env = env

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in KNOBS}
        for k in KNOBS:
            os.environ.pop(k, None)
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def interleaved(torch, fns, rounds, repeats):
    """{name: (all call times, per-round medians)} with the entries of `fns` ([(name, env,
    fn)]) interleaved round by round, the order shifted by one each round."""
    times = {name: ([], []) for name, _, _ in fns}
    for r in range(rounds):
        shift = r % len(fns)
        for name, env, fn in fns[shift:] + fns[:shift]:
            with Knobs(env):
                t = compare.time_calls(torch, fn, 2 if r == 0 else 1, repeats)["samples"]
            times[name][0].extend(t)
            times[name][1].append(statistics.median(t))
    return times


def summarize(t_all, t_rounds):
    med = statistics.median(t_all)
    return {"median_ms": med, "min_ms": min(t_all), "max_ms": max(t_all), "calls": len(t_all),
            "round_medians_ms": t_rounds,
            "round_spread_pct": 100.0 * (max(t_rounds) - min(t_rounds)) / med if med > 0 else 0}


def agreement(torch, out, ref):
    """max|out - ref|, its bound (twice the harness's fp16 bound for O against max|ref|), and
    whether it holds (NaN fails)."""
    c1 = 2 * compare.tolerance("fp16", "output")[0]
    diff = (out.float() - ref.float()).abs()
    worst = float(diff.max()) if bool(torch.isfinite(out).all()) else float("inf")
    bound = c1 * max(float(ref.float().abs().max()), 1.0)
    return {"max_abs_vs_ref": worst, "bound": bound, "passed": worst <= bound}


def measure_shape(torch, fs, args, shape, impls, rounds, repeats, l2_bytes, copy_gbps):
    """All rows of one shape. `impls`: [(name, kind, env)] with kind 'flash', '06' or '08';
    the first that is 'flash' (decode) or '06' (training) is the reference of the check."""
    B, H, Hkv = shape["batch"], shape["heads"], shape["heads_kv"]
    Nq, Nk, d, causal = shape["seqlen_q"], shape["seqlen_k"], shape["head_dim"], shape["causal"]
    dev, dtype = "cuda", torch.float16
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed + zlib.crc32(describe(shape).encode()) % 100003)
    q = torch.randn((B, Nq, H, d), generator=gen, device=dev, dtype=dtype)
    k, v = (torch.randn((B, Nk, Hkv, d), generator=gen, device=dev, dtype=dtype) for _ in "kv")
    kv = compare.kv_bytes(B, Hkv, Nk, d)
    decode = Nq != Nk or H != Hkv
    n_sets = compare.rotation_sets(kv, l2_bytes) if decode else 1
    sets = [(q, k, v)] + [tuple(t.clone() for t in (q, k, v)) for _ in range(n_sets - 1)]
    fns, outs, rows = [], {}, []
    for name, kind, env in impls:
        row = dict(shape, impl=name, env=env, rotated_sets=n_sets, kv_bytes=kv,
                   flops=compare.flops("fwd", B, H, Nq, Nk, d, causal), error="")
        try:
            if kind == "flash":
                calls = [(lambda s=s: compare.sdpa_call(torch, "FLASH_ATTENTION", *s, causal,
                                                        scale)) for s in sets]
                outs[name] = calls[0]()
            else:
                step = STEP08 if kind == "08" else STEP06
                o = torch.full_like(q, float("nan"))
                lse = torch.full((B, H, Nq), float("nan"), device=dev, dtype=torch.float32)
                calls = [fs.prepare_forward(step, *s, o, lse, causal, scale) for s in sets]
                with Knobs(env):
                    calls[0]()
                outs[name] = o
            torch.cuda.synchronize()
            fns.append((name, env, compare.in_turn(calls)))
        except Exception as e:  # a candidate the library refuses, OOM, ...
            row["error"] = compare.describe_error(e)
        rows.append(row)
    ref_name = next((n for n, kind, _ in impls if kind == ("flash" if decode else "06")), None)
    for row in rows:
        if not row["error"] and ref_name in outs and row["impl"] != ref_name:
            row.update(agreement(torch, outs[row["impl"]], outs[ref_name]))
    del outs
    times = interleaved(torch, fns, rounds, repeats) if fns else {}
    for row in rows:
        if row["impl"] in times:
            row.update(summarize(*times[row["impl"]]))
            sec = row["median_ms"] * 1e-3
            row["tflops"] = row["flops"] / sec / 1e12
            row["gbps"] = kv / sec / 1e9
            if copy_gbps:
                row["pct_copy"] = 100.0 * row["gbps"] / copy_gbps
    del sets, fns, q, k, v
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Kernel breakdown (torch.profiler)
# ---------------------------------------------------------------------------------------------


def kernel_breakdown(torch, fs, shapes, impls, calls=6):
    """{shape: {implementation: breakdown}}: the kernels of one call (name, mean duration,
    grid, block, shared memory, registers per thread) and the mean span of a call from its
    first kernel's start to its last kernel's end, from one CUPTI trace (torch.profiler) of
    1 + `calls` calls of every implementation on every shape, 2 ms apart (the first call of
    each is left out)."""
    from torch.profiler import ProfilerActivity, profile

    plan, keep = [], []
    for shape in shapes:
        B, H, Hkv, Nq, Nk, d = (shape[k] for k in ("batch", "heads", "heads_kv", "seqlen_q",
                                                   "seqlen_k", "head_dim"))
        scale = 1.0 / math.sqrt(d)
        q = torch.randn((B, Nq, H, d), device="cuda", dtype=torch.float16)
        k, v = (torch.randn((B, Nk, Hkv, d), device="cuda", dtype=torch.float16) for _ in "kv")
        o = torch.empty_like(q)
        lse = torch.empty((B, H, Nq), device="cuda", dtype=torch.float32)
        keep.append((q, k, v, o, lse))
        for name, kind, env in impls:
            try:
                if kind == "flash":
                    def fn(q=q, k=k, v=v, scale=scale):
                        compare.sdpa_call(torch, "FLASH_ATTENTION", q, k, v, False, scale)
                else:
                    fn = fs.prepare_forward(STEP08 if kind == "08" else STEP06, q, k, v, o, lse,
                                            False, scale)
                with Knobs(env):
                    fn()
                torch.cuda.synchronize()
                plan.append((describe(shape), name, env, fn))
            except Exception as e:
                plan.append((describe(shape), name, env, compare.describe_error(e)))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _, _, env, fn in plan:
            if callable(fn):
                with Knobs(env):
                    for _ in range(1 + calls):
                        fn()
                        torch.cuda.synchronize()
                        time.sleep(0.002)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    del keep
    torch.cuda.empty_cache()
    kernels = sorted((e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    groups = group_calls(kernels)
    ran = [p for p in plan if callable(p[3])]
    out = {}
    for desc, name, _, fn in plan:
        out.setdefault(desc, {})[name] = {"error": fn} if not callable(fn) else None
    if len(groups) != len(ran) * (1 + calls):
        for desc, name, _, fn in ran:
            out[desc][name] = {"error": "trace has %d calls, expected %d" % (
                len(groups), len(ran) * (1 + calls))}
        return out
    for i, (desc, name, _, _) in enumerate(ran):
        out[desc][name] = summarize_kernels(groups[i * (1 + calls) + 1:(i + 1) * (1 + calls)])
    return out


def group_calls(kernels):
    """The kernels of a trace in calls: kernel_breakdown leaves 2 ms between calls, so a gap of
    more than 500 us between two kernels starts a new call."""
    groups, cur = [], []
    for e in kernels:
        if cur and e["ts"] - (cur[-1]["ts"] + cur[-1]["dur"]) > 500:
            groups.append(cur)
            cur = []
        cur.append(e)
    if cur:
        groups.append(cur)
    return groups


def summarize_kernels(groups):
    """Mean duration per kernel name over the calls `groups`, and per call its span (first
    kernel's start to last kernel's end) and its kernels' total time."""
    per_name = {}
    for g in groups:
        for e in g:
            per_name.setdefault(e["name"], []).append(e)
    kern = []
    for name, es in per_name.items():
        a = es[0].get("args", {})
        kern.append({"name": name[:90], "mean_us": statistics.mean(x["dur"] for x in es),
                     "per_call": len(es) / len(groups), "grid": a.get("grid"),
                     "block": a.get("block"), "smem": a.get("shared memory"),
                     "regs": a.get("registers per thread")})
    spans = [g[-1]["ts"] + g[-1]["dur"] - g[0]["ts"] for g in groups]
    busy = [sum(e["dur"] for e in g) for g in groups]
    return {"calls": len(groups), "span_us": statistics.mean(spans),
            "kernel_us": statistics.mean(busy), "kernels": kern}


# ---------------------------------------------------------------------------------------------
# Ceilings
# ---------------------------------------------------------------------------------------------


def read_ceiling_gbps(torch, mib=2048, repeats=10):
    """Bytes read per second by torch.sum (fp32 accumulation) over `mib` MiB of fp16."""
    x = torch.ones(mib * 2 ** 19, device="cuda", dtype=torch.float16)
    t = compare.time_calls(torch, lambda: torch.sum(x, dtype=torch.float32), 3, repeats)["samples"]
    del x
    torch.cuda.empty_cache()
    return mib * 2 ** 20 / (statistics.median(t) * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def short(name):
    return (name.replace("08 ", "").replace("tile=", "t").replace("waves=", "w")
            .replace("combine=", "c"))


def decode_table(rows, names):
    """One line per shape: FLASH and 06 in us, 08 in us and GB/s, then every 08 entry's speed
    over FLASH (x FLASH > 1: faster)."""
    by = {}
    for r in rows:
        by.setdefault(describe(r), {})[r["impl"]] = r
    eights = [n for n in names if n.startswith("08")]
    head = "%-28s %8s %8s %8s %6s %5s" % ("shape", "FLASH us", "06 us", "08 us", "GB/s", "%cp")
    head += "".join(" %8s" % short(n)[:8] for n in eights) + "  (x FLASH)"
    lines = [head]
    for shape, g in by.items():
        fl, s6, s8 = g.get("FLASH"), g.get("06"), g.get("08")

        def us(r):
            return "%8.1f" % (1e3 * r["median_ms"]) if r and "median_ms" in r else "%8s" % "-"

        line = "%-28s %s %s %s" % (shape, us(fl), us(s6), us(s8))
        line += " %6.0f %5.1f" % (s8.get("gbps", 0), s8.get("pct_copy", 0)) if s8 else " " * 13
        for n in eights:
            r = g.get(n)
            if r and fl and "median_ms" in r and "median_ms" in fl:
                mark = "" if r.get("passed", True) else "!"
                line += " %7.3f%1s" % (fl["median_ms"] / r["median_ms"], mark)
            else:
                line += " %8s" % ("err" if r and r.get("error") else "-")
        lines.append(line)
    return "\n".join(lines)


def must_show(rows, names):
    """Per 08 entry, the issue's bars over the must-show grid (seqlen_q 1, heads 32/8): shapes
    below 1.0x FLASH, the worst ratio to FLASH and to 06, batch 1 and Nk >= 16K against 06,
    the lowest share of the copy ceiling at batch >= 4 and Nk >= 32K, and the geometric mean
    of the ratio to FLASH at Nk >= 16K."""
    by = {}
    for r in rows:
        if r["seqlen_q"] == 1 and r["heads_kv"] == 8:
            by.setdefault((r["batch"], r["seqlen_k"]), {})[r["impl"]] = r
    out = []
    for n in [n for n in names if n.startswith("08")]:
        below, worst_f, worst_6, b1, pct, logs, bad = [], 9e9, 9e9, 9e9, 9e9, [], 0
        for (b, nk), g in sorted(by.items()):
            r, fl, s6 = g.get(n), g.get("FLASH"), g.get("06")
            if not (r and fl and s6 and "median_ms" in r and "median_ms" in fl
                    and "median_ms" in s6):
                bad += 1
                continue
            bad += not r.get("passed", True)
            xf, x6 = fl["median_ms"] / r["median_ms"], s6["median_ms"] / r["median_ms"]
            if xf < 1.0:
                below.append("%d/%dK %.3f" % (b, nk // 1024, xf))
            worst_f, worst_6 = min(worst_f, xf), min(worst_6, x6)
            if b == 1 and nk >= 16384:
                b1 = min(b1, x6)
            if b >= 4 and nk >= 32768:
                pct = min(pct, r.get("pct_copy", 0))
            if nk >= 16384:
                logs.append(math.log(xf))
        out.append({"impl": n, "below_flash": below, "worst_x_flash": worst_f,
                    "worst_x_06": worst_6, "b1_worst_x_06": b1, "min_pct_copy": pct,
                    "geomean_x_flash_16k": math.exp(sum(logs) / len(logs)) if logs else 0,
                    "failed_or_missing": bad})
    return out


def must_show_table(summary):
    lines = ["%-22s %6s %8s %8s %8s %8s %8s %4s  %s" % (
        "08 entry", "<FLASH", "min xFL", "gm xFL", "min x06", "b1 x06", "min %cp", "bad",
        "shapes below 1.0x FLASH")]
    for s in summary:
        if s["worst_x_flash"] > 1e9:  # nothing measured
            lines.append("%-22s %6s %8s %8s %8s %8s %8s %4d" % (
                s["impl"], "-", "-", "-", "-", "-", "-", s["failed_or_missing"]))
            continue
        lines.append("%-22s %6d %8.3f %8.3f %8.2f %8.2f %8.1f %4d  %s" % (
            s["impl"], len(s["below_flash"]), s["worst_x_flash"], s["geomean_x_flash_16k"],
            s["worst_x_06"], s["b1_worst_x_06"], s["min_pct_copy"], s["failed_or_missing"],
            ", ".join(s["below_flash"][:6])))
    return "\n".join(lines)


def train_table(rows):
    by = {}
    for r in rows:
        by.setdefault(describe(r), {})[r["impl"]] = r
    lines = ["%-34s %9s %9s %7s %7s %13s  %s" % ("shape", "06 ms", "08 ms", "08/06",
                                                    "06/06'", "rounds 08/06", "08 vs 06")]
    worst, worst_noise = 9.0, 0.0
    for shape, g in by.items():
        a, b, a2 = g.get("06"), g.get("08"), g.get("06 again")
        if not (a and b and "median_ms" in a and "median_ms" in b):
            lines.append("%-34s  missing rows" % shape)
            worst = 0
            continue
        ratio = a["median_ms"] / b["median_ms"]
        noise = a2["median_ms"] / a["median_ms"] if a2 and "median_ms" in a2 else float("nan")
        per_round = [x / y for x, y in zip(a["round_medians_ms"], b["round_medians_ms"])]
        worst = min(worst, ratio)
        if noise == noise:
            worst_noise = max(worst_noise, abs(1 - noise))
        lines.append("%-34s %9.4f %9.4f %7.3f %7.3f %6.3f-%6.3f  %s" % (
            shape, a["median_ms"], b["median_ms"], ratio, noise, min(per_round),
            max(per_round), "max|diff| %.1e" % b["max_abs_vs_ref"] if "max_abs_vs_ref" in b
            else b.get("error", "")))
    lines.append("training shapes: worst 08/06 %.3f (>= 0.97 wanted: %s); largest |1 - 06/06'| "
                 "(the same kernel timed twice) %.3f" % (worst, "ok" if worst >= 0.97 else "MISS",
                                                         worst_noise))
    return "\n".join(lines)


def profile_table(results):
    lines = []
    for shape, per_impl in results.items():
        lines.append("-- %s" % shape)
        for name, s in per_impl.items():
            if "error" in s:
                lines.append("   %-16s error: %s" % (name, s["error"]))
                continue
            lines.append("   %-16s call span %8.1f us, kernels %8.1f us" % (
                name, s["span_us"], s["kernel_us"]))
            for kk in s["kernels"]:
                lines.append("      %8.1f us x%.0f grid %-14s block %-12s smem %-7s regs %-4s %s"
                             % (kk["mean_us"], kk["per_call"], kk["grid"], kk["block"],
                                kk["smem"], kk["regs"], kk["name"][:60]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    import torch

    import flash_steps as fs

    if not torch.cuda.is_available():
        sys.exit("splitkv_tune: no CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    prop = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = int(getattr(prop, "L2_cache_size", 0) or 0)
    doc = {"gpu": prop.name, "sm_count": prop.multi_processor_count, "l2_bytes": l2,
           "torch": torch.__version__, "seed": args.seed, "argv": sys.argv[1:],
           "candidates": args.candidates, "rounds": args.rounds, "repeats": args.repeats,
           "commit": compare.run_info()["commit"], "sections": {}}
    t0 = time.time()
    rc = 0

    def save():
        with open(args.out, "w") as f:
            json.dump(compare.clean(doc), f, indent=1)

    def say(text):
        print(text)
        sys.stdout.flush()

    copy = 0.0
    decode_impls = ([("FLASH", "flash", {}), ("06", "06", {})]
                    + [(n, "08", env) for n, env in args.candidates] + [("08 again", "08", {})])
    names = [n for n, _, _ in decode_impls]
    for section in args.sections:
        say("\n=== %s (%.0f s)" % (section, time.time() - t0))
        try:
            if section == "ceilings":
                copy = compare.measure_copy_gbps(torch)
                read = read_ceiling_gbps(torch)
                doc["sections"]["ceilings"] = {"copy_gbps": copy, "read_gbps": read}
                say("copy ceiling %.0f GB/s (torch copy_, 1 GiB, read + write); read-only "
                    "reduction %.0f GB/s (torch.sum over 2 GiB of fp16)" % (copy, read))
            elif section in ("decode", "decode2"):
                shapes = decode_grid(args.quick) if section == "decode" else decode_grid2(
                    args.quick)
                rows = []
                for s in shapes:
                    rows += measure_shape(torch, fs, args, s, decode_impls, args.rounds,
                                          args.repeats, l2, copy)
                    doc["sections"][section] = rows
                    save()
                    sys.stderr.write("[%4.0fs] %s done\n" % (time.time() - t0, describe(s)))
                say(decode_table(rows, names))
                if section == "decode":
                    summary = must_show(rows, names)
                    doc["sections"]["must_show"] = summary
                    say("\nmust-show grid (Nq 1, H 32/8, d 128, fp16): per 08 entry")
                    say(must_show_table(summary))
                rc |= any(r["error"] or not r.get("passed", True) for r in rows)
            elif section == "profile":
                impls = [("FLASH", "flash", {})] + [(n, "08", env) for n, env in args.candidates]
                res = kernel_breakdown(torch, fs, [decode_shape(16, 16384)] if args.quick else
                                       [decode_shape(1, 16384), decode_shape(4, 32768),
                                        decode_shape(16, 16384), decode_shape(16, 131072)],
                                       impls)
                doc["sections"]["profile"] = res
                say(profile_table(res))
            elif section == "train":
                impls = [("06", "06", {}), ("08", "08", {}), ("06 again", "06", {})]
                rows = []
                for s in train_grid(args.quick):
                    rows += measure_shape(torch, fs, args, s, impls, args.train_rounds,
                                          args.train_repeats, l2, copy)
                    doc["sections"]["train"] = rows
                    save()
                say(train_table(rows))
                rc |= any(r["error"] or not r.get("passed", True) for r in rows)
            else:
                say("unknown section %r" % section)
                rc = 1
        except Exception as e:  # keep the other sections
            say("section %s failed: %s" % (section, compare.describe_error(e)))
            rc = 1
        save()
    say("\nsplitkv_tune: %.0f s, -> %s" % (time.time() - t0, args.out))
    return 1 if rc else 0


if __name__ == "__main__":
    sys.exit(main())
