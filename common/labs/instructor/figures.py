#!/usr/bin/env python3
"""Writes figures.md: the figures each lab's answer key quotes, taken from the results measured
on the reference GPU (docs/results/*.json), never typed by hand.

    python3 common/labs/instructor/figures.py        # rewrites common/labs/instructor/figures.md

Per lab: the speed check as it came out on that GPU (the starting step and the reference at
the lab's shapes, the reference's gain and the pass mark it sets), the bench sweep of both
steps (time, TFLOP/s, gain) and the device-memory traffic Nsight Compute measured. Run it again
after new results are committed. Python 3 standard library only.
"""

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def load_lab():
    spec = importlib.util.spec_from_file_location("lab", ROOT / "common" / "scripts" / "lab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def io_rows():
    """{(step, direction): row} of the Nsight Compute traffic report, and the report."""
    path = ROOT / "docs" / "results" / "nvidia-h200_io.json"
    if not path.exists():
        return {}, None
    doc = json.loads(path.read_text())
    return {(r["step"], r["direction"]): r for r in doc.get("rows", [])}, doc


def main():
    m = load_lab()
    steps = m.known_steps()
    files = m.bench_reports()  # the report lab.py's recorded gains come from first
    if not files:
        print("figures.py: no bench report in docs/results", file=sys.stderr)
        return 1
    path, doc = files[0]
    run = doc.get("run", {})
    gpu = doc.get("gpu", {})
    rows = doc["results"]
    io, io_doc = io_rows()

    out = ["# Lab figures on the reference GPU {#labs_figures}", "",
           f"Written by `common/labs/instructor/figures.py` from `{path.relative_to(ROOT)}` "
           f"(**{gpu.get('name', '?')}**, {gpu.get('sm_count', '?')} SMs, driver "
           f"{gpu.get('driver', '?')}, CUDA {gpu.get('cuda_runtime', '?')}; commit "
           f"`{run.get('commit', '?')}`, {run.get('date', '?')}; `{run.get('command', '?')}`)"
           + (f" and `docs/results/nvidia-h200_io.json` (Nsight Compute, commit "
              f"`{io_doc.get('commit', '?')}`, {io_doc.get('date', '?')})" if io_doc else "")
           + "; do not edit by hand. Back to @ref labs_instructor.", "",
           "The bench times every run between two CUDA events, the runs queued back to back "
           "(median of its repeats), as the lab timer does; unlike the lab timer it warms up "
           "for at least 250 ms first (the lab timer interleaves rounds of all its steps "
           "instead). fp16, 16K tokens per batch, hidden 2048. The figures belong to the "
           "commit named above: after the steps change, measure again and rerun this script.",
           "", "[TOC]", ""]
    for target, d in m.lab_defs().items():
        speed = d["speed"]
        base = speed.get("baseline") or m.parent_of(target, steps)
        direction = speed.get("direction", "fwd")
        out += [f"## Lab {target[:2]}: {target} from {m.parent_of(target, steps)} "
                f"{{#labs_figures_{target[:2]}}}", ""]
        got = m.recorded_gain(base, target, direction, speed["shapes"])
        out += [f"**Speed check** ({direction}; the lab is timed beside `{base}` and `{target}`):",
                "", f"| shape | {base} ms | {target} ms | gain |", "|---|---|---|---|"]
        for s in speed["shapes"]:
            key = m.shape_key(m.parse_shape(s))
            t = {r["step"]: r["median_ms"] for r in rows
                 if m.shape_key(r) == key and r["direction"] == direction}
            if base in t and target in t:
                out.append(f"| {m.describe_shape(key)} | {t[base]:.3f} | {t[target]:.3f} | "
                           f"{t[base] / t[target]:.2f}x |")
            else:
                out.append(f"| {m.describe_shape(key)} | - | - | not measured |")
        if got:
            out += ["", f"Reference gain (geometric mean) {got[0]:.2f}x, so the pass mark on this "
                        f"GPU is {got[0] ** m.SHARE:.2f}x; a lab left unchanged gains 1.00x.", ""]
        else:
            out += ["", "Not all of these shapes are in the bench report: no expected figure.", ""]

        parent = m.parent_of(target, steps)
        dirs = ["fwd", "bwd"] if direction == "bwd" else ["fwd"]
        for dr in dirs:
            base = speed.get("baseline") or parent if dr == direction else parent
            table = []
            keys = sorted({(r["head_dim"], r["causal"], r["seqlen_q"], r["batch"]) for r in rows
                           if r["direction"] == dr and r["step"] in (base, target)})
            for dd, causal, n, b in keys:
                cell = {}
                for r in rows:
                    if (r["direction"] == dr and r["head_dim"] == dd and r["causal"] == causal
                            and r["seqlen_q"] == n and r["step"] in (base, target)
                            and not r.get("error")):
                        cell[r["step"]] = r
                if base not in cell or target not in cell:
                    continue
                a, c = cell[base], cell[target]
                table.append(f"| {dd} | {'yes' if causal else 'no'} | {n} ({b}) | "
                             f"{a['median_ms']:.3f} ({a['tflops']:.0f}) | "
                             f"{c['median_ms']:.3f} ({c['tflops']:.0f}) | "
                             f"{a['median_ms'] / c['median_ms']:.2f}x |")
            if table:
                out += [f"**Bench, {dr}** (ms, and TFLOP/s in brackets):", "",
                        f"| d | causal | N (B) | {base} | {target} | gain |",
                        "|---|---|---|---|---|---|"] + table + [""]
        traffic = [io.get((parent, "fwd")), io.get((target, "fwd"))]
        if direction == "bwd":
            traffic += [io.get((speed.get("baseline") or parent, "bwd")), io.get((target, "bwd"))]
        traffic = [r for r in traffic if r]
        if traffic and io_doc:
            shape = io_doc.get("shape", {})
            if isinstance(shape, dict):
                shape = " ".join(f"{k}={v}" for k, v in shape.items())
            out += [f"**Device-memory traffic** (Nsight Compute, one pass, "
                    f"{shape}; "
                    "MB = 10^6 bytes; the model charges every tile load to DRAM, the L2 cache "
                    "serves many of them):", "",
                    "| step | pass | read MB | write MB | model | model read MB | model write MB |",
                    "|---|---|---|---|---|---|---|"]
            for r in traffic:
                mr = f"{r['model_read'] / 1e6:.1f}" if r.get("model_read") else "-"
                mw = f"{r['model_write'] / 1e6:.1f}" if r.get("model_write") else "-"
                out.append(f"| {r['step']} | {r['direction']} | {r['read'] / 1e6:.1f} | "
                           f"{r['write'] / 1e6:.1f} | {r.get('model') or '-'} | {mr} | {mw} |")
            out.append("")
    (HERE / "figures.md").write_text("\n".join(out).rstrip() + "\n")
    print(f"figures.py: wrote {(HERE / 'figures.md').relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
