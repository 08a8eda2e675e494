#!/usr/bin/env python3
"""Turn a compare.py JSON into the plot, the README's results table and docs/results.md.

Usage:

    python3 common/python/results.py docs/results/nvidia-h200.json
    python3 common/python/results.py docs/results/nvidia-h200.json --bench bench.json
    python3 common/python/results.py docs/results/nvidia-h200.json --check   # CI: up to date?
    python3 common/python/results.py --help

What it writes (nothing else, and never a number typed by hand):

1. ``docs/results/<gpu>.png``: TFLOP/s of every step over the sequence length, one panel per
   (direction, head dim, causal), PyTorch's SDPA backends as dashed reference lines. With
   ``--bench`` (the JSON of ``./build/bin/bench --out bench.json`` on the same GPU) also
   ``docs/results/<gpu>_ceilings.png``: each step's share of the two ceilings the harness
   measured (dense mma.sync and a large cuBLAS GEMM).
2. The README table between ``<!-- results:begin -->`` and ``<!-- results:end -->``: per
   implementation, TFLOP/s over seqlen 2048..16384 (harmonic mean) for d 64/128, causal off/on,
   and the speed relative to PyTorch's FLASH backend (FlashAttention-2).
3. ``docs/results.md``: the Doxygen page with the run's facts, the plots and every number.
4. In each step folder's ``README.md`` that opts in with the two lines ``<!-- measured:begin -->``
   and ``<!-- measured:end -->`` (a README without them is left alone): that step's TFLOP/s
   at the measured shapes of seqlen 1024..16384, forward and, where the step has one,
   backward, with the speed-up over the previous step and over 01_naive, from step 05 on the
   ratio to PyTorch's FLASH backend, and one line naming the GPU, date, commit and command.

The same JSON always gives the same files, byte for byte (the tests check it). Matplotlib is
needed only for the plots (``--no-plot`` skips them).
"""

import argparse
import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
#: Display names and order of the PyTorch backends (compare.py's row names).
BACKENDS = [("sdpa_flash", "PyTorch FLASH (FA2)"), ("sdpa_cudnn", "PyTorch cuDNN"),
            ("sdpa_efficient", "PyTorch EFFICIENT")]
FLASH = "sdpa_flash"
#: Sequence lengths the README summary averages over.
README_SEQLENS = (2048, 16384)
DIRECTIONS = [("fwd", "Forward"), ("bwd", "Backward")]
#: Markers of the block written into a step folder's README.md; a README opts in by holding
#: both lines, and one without them is never touched.
STEP_BEGIN, STEP_END = "<!-- measured:begin -->", "<!-- measured:end -->"
#: Sequence lengths shown in a step's table (those of the run that lie in this range).
STEP_SEQLENS = (1024, 16384)
#: The step every other step is compared with.
BASELINE = "01_naive"
#: Steps from this number on implement FlashAttention-2's algorithm, so their tables also give
#: the ratio to PyTorch's FLASH backend (FlashAttention-2 itself).
FIRST_FA2_STEP = 5
#: Step folders: two digits, an underscore, a name.
STEP_FOLDER = re.compile(r"^[0-9]{2}_[A-Za-z0-9_]+$")


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def load(path):
    """Reads a compare.py JSON (or a bench JSON: rows named by "step") and normalizes rows:
    every row gets impl, kind ("step" or "pytorch"), and a usable flag ``ok`` (ran, has a
    time, and did not fail a check)."""
    with open(path) as f:
        doc = json.load(f)
    if "results" not in doc or "gpu" not in doc:
        raise SystemExit("results.py: %s is not a compare.py or bench JSON (no gpu/results)"
                         % path)
    for r in doc["results"]:
        r.setdefault("impl", r.get("step"))
        r.setdefault("kind", "pytorch" if str(r["impl"]).startswith("sdpa_") else "step")
        r["causal"] = bool(r.get("causal"))
        r["ok"] = (not r.get("error") and r.get("tflops") is not None and r.get("tflops") > 0
                   and not (r.get("checked") and not r.get("passed")))
    return doc


def slug_of(path):
    """docs/results/nvidia-h200.json -> nvidia-h200."""
    return os.path.splitext(os.path.basename(path))[0]


def impls(doc, direction=None):
    """Implementations in display order: steps in folder order, then the backends."""
    names = {r["impl"] for r in doc["results"]
             if direction is None or r["direction"] == direction}
    steps = sorted(n for n in names if not n.startswith("sdpa_"))
    return steps + [b for b, _ in BACKENDS if b in names]


def label(impl):
    return dict(BACKENDS).get(impl, impl)


def configs(doc):
    """(head_dim, causal) pairs present, in order."""
    return sorted({(r["head_dim"], r["causal"]) for r in doc["results"]})


def config_name(d, causal):
    return "d=%d%s" % (d, " causal" if causal else "")


def index(doc):
    """(impl, direction, head_dim, causal, seqlen) -> row."""
    out = {}
    for r in doc["results"]:
        out[(r["impl"], r["direction"], r["head_dim"], r["causal"], r["seqlen_q"])] = r
    return out


def seqlens(doc):
    return sorted({r["seqlen_q"] for r in doc["results"]})


def harmonic_mean(values):
    values = [v for v in values if v and v > 0]
    return len(values) / sum(1.0 / v for v in values) if values else None


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def fmt_tflops(x):
    return "%.1f" % x if x >= 10 else "%.2f" % x


def run_facts(doc, json_name):
    """One paragraph: GPU, software, commit, date, command."""
    g, run = doc["gpu"], doc.get("run", {})
    parts = ["**%s**" % g.get("name", "unknown GPU")]
    if g.get("sm_count"):
        parts.append("%s SMs" % g["sm_count"])
    if g.get("driver"):
        parts.append("driver %s" % g["driver"])
    if g.get("cuda_runtime_torch"):
        parts.append("CUDA %s" % g["cuda_runtime_torch"])
    if g.get("cuda_runtime") and not g.get("cuda_runtime_torch"):
        parts.append("CUDA %s" % g["cuda_runtime"])
    if g.get("torch"):
        parts.append("PyTorch %s" % g["torch"])
    if g.get("cudnn"):
        parts.append("cuDNN %s" % g["cudnn"])
    commit = run.get("commit", "unknown")
    text = ", ".join(parts) + "; commit `%s`%s, %s, `%s`" % (
        commit[:12], " (with local changes)" if run.get("dirty") else "",
        run.get("date", "date unknown"), run.get("command", "?"))
    if not doc.get("complete", True):
        text += " **(incomplete run)**"
    return text + "; raw data `docs/results/%s`." % json_name


def settings_line(doc):
    s = doc.get("settings", {})
    if not s:
        return ""
    warm = "%d warm-up runs" % s.get("warmup", 0)
    if s.get("warmup_ms"):
        warm += " and more for at least %g ms" % s["warmup_ms"]
    return ("%s, %d tokens per batch (batch = %d / seqlen), hidden %d (heads = %d / head dim), "
            "%s, median of %d; %s." % (
                s.get("dtype", "fp16"), s.get("tokens", 16384), s.get("tokens", 16384),
                s.get("hidden", 2048), s.get("hidden", 2048), warm,
                s.get("repeats", 0), "outputs checked against an fp32 reference and FLASH"
                if s.get("checked", True) else "outputs not checked"))


def readme_block(doc, json_name, png_name):
    """The README table (the text between the markers)."""
    lo, hi = README_SEQLENS
    idx = index(doc)
    lines = [
        "Measured on " + run_facts(doc, json_name),
        "",
        "Each cell: TFLOP/s, harmonic mean over seqlen %d..%d (%s), and in brackets the speed "
        "relative to PyTorch's FLASH backend (FlashAttention-2) on the same tensors in the same "
        "run. Full tables and the ceilings: [docs/results.md](docs/results.md)." % (
            lo, hi, doc.get("settings", {}).get("dtype", "fp16")),
        "",
        "![TFLOP/s per step](docs/results/%s)" % png_name,
        "",
    ]
    any_missing = False
    for direction, title in DIRECTIONS:
        names = impls(doc, direction)
        if not names:
            continue
        cfgs = configs(doc)
        lines.append("| %s | %s |" % (title.lower(), " | ".join(config_name(*c) for c in cfgs)))
        lines.append("|---|" + "---|" * len(cfgs))
        for impl in names:
            cells = []
            for d, causal in cfgs:
                mine, ref, missing = [], [], False
                for n in seqlens(doc):
                    if not lo <= n <= hi:
                        continue
                    r = idx.get((impl, direction, d, causal, n))
                    f = idx.get((FLASH, direction, d, causal, n))
                    if r is None or not r["ok"]:
                        missing = True
                        continue
                    mine.append(r["tflops"])
                    if f is not None and f["ok"]:
                        ref.append((r["tflops"], f["tflops"]))
                hm = harmonic_mean(mine)
                if hm is None:
                    cells.append("-")
                    continue
                any_missing = any_missing or missing
                cell = fmt_tflops(hm) + ("*" if missing else "")
                if ref and impl != FLASH:
                    ratio = harmonic_mean([a for a, _ in ref]) / harmonic_mean([b for _, b in ref])
                    cell += " (%.2fx)" % ratio
                cells.append(cell)
            name = "[%s](%s/README.md)" % (impl, impl) if os.path.isfile(
                os.path.join(REPO, impl, "README.md")) else label(impl)
            lines.append("| %s | %s |" % (name, " | ".join(cells)))
        lines.append("")
    if any_missing:
        lines.append("\\* some sequence lengths of this range failed or did not run; see "
                     "docs/results.md.")
    return "\n".join(lines)


def replace_block(text, block, begin=BEGIN, end=END, where="README"):
    """Replaces what is between the markers `begin` and `end` (which must both be there once,
    in that order) of the text of `where`."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit("results.py: %s must contain %s ... %s once" % (where, begin, end))
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return head + begin + "\n" + block.rstrip("\n") + "\n" + end + tail


# ---------------------------------------------------------------------------------------------
# The block in each step's README
# ---------------------------------------------------------------------------------------------


def step_readmes(root):
    """(step, path) of every step folder under `root` that has a README.md, in folder order."""
    if not os.path.isdir(root):
        return []
    return [(name, os.path.join(root, name, "README.md")) for name in sorted(os.listdir(root))
            if STEP_FOLDER.match(name) and os.path.isfile(os.path.join(root, name, "README.md"))]


def _starts_from():
    """{step: the step its lesson starts from}, from common/scripts/diff_budget.txt (the one
    place that says it; common/scripts/diff_report.py reads it)."""
    import importlib.util
    path = os.path.join(REPO, "common", "scripts", "diff_report.py")
    spec = importlib.util.spec_from_file_location("diff_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parents()


#: Steps compared with the step their lesson starts from (08 and 09: 06; 10: 09).
STARTS_FROM = _starts_from()


def step_comparisons(doc, step, direction):
    """What `step` is compared with in one direction, as [(impl, caption)]: the step before it
    that the run measured (unless that is the baseline), the baseline 01_naive, and from step
    05 on PyTorch's FLASH backend."""
    names = impls(doc, direction)
    steps = [n for n in names if not n.startswith("sdpa_")]
    out = []
    earlier = [n for n in steps if n < step]
    if STARTS_FROM.get(step) in steps:  # a step that branches from an earlier forward
        earlier = [STARTS_FROM[step]]
    if earlier and earlier[-1] != BASELINE:
        out.append((earlier[-1], "speed-up over `%s`" % earlier[-1]))
    if step != BASELINE and BASELINE in steps:
        out.append((BASELINE, "speed-up over `%s`" % BASELINE))
    if int(step[:2]) >= FIRST_FA2_STEP and FLASH in names:
        out.append((FLASH, "ratio to PyTorch's FLASH backend (FlashAttention-2)"))
    return out


def step_cell(idx, step, others, key):
    """TFLOP/s of `step` at key = (direction, head_dim, causal, seqlen), and in brackets its
    speed over each of `others` at the same shape ("-" where one of the two did not run)."""
    r = idx.get((step,) + key)
    if r is None:
        return "-"
    if r.get("error"):
        return "error"
    if r.get("tflops") is None or r["tflops"] <= 0:
        return "-"
    if not r["ok"]:
        return fmt_tflops(r["tflops"]) + " (check failed)"
    ratios = []
    for other in others:
        o = idx.get((other,) + key)
        ratios.append("%.2fx" % (r["tflops"] / o["tflops"]) if o is not None and o["ok"]
                      else "-")
    return fmt_tflops(r["tflops"]) + (" (%s)" % " / ".join(ratios) if ratios else "")


def step_run_line(doc, json_name):
    """The one line of a step's block that says where its numbers come from."""
    g, run = doc["gpu"], doc.get("run", {})
    runs = doc.get("runs") or [run]
    commits = []
    for r in runs:
        c = "`%s`" % r.get("commit", "unknown")[:12]
        if c not in commits:
            commits.append(c)
    dates = sorted({r.get("date", "date unknown")[:10] for r in runs})
    s = doc.get("settings", {})
    tokens, hidden = s.get("tokens", 16384), s.get("hidden", 2048)
    text = ("Measured on **%s**, %s, commit%s %s%s, with `%s`%s; %s, %d tokens (batch = %d / "
            "seqlen), hidden %d (heads = %d / head dim). Written by `python3 "
            "common/python/results.py docs/results/%s`, never by hand; every implementation and "
            "shape: [docs/results.md](../docs/results.md)." % (
                g.get("name", "unknown GPU"), " to ".join(sorted({dates[0], dates[-1]})),
                "s" if len(commits) > 1 else "", ", ".join(commits),
                " (with local changes)" if any(r.get("dirty") for r in runs) else "",
                run.get("command", "?"),
                " (the last of %d merged runs)" % len(runs) if len(runs) > 1 else "",
                s.get("dtype", "fp16"), tokens, tokens, hidden, hidden, json_name))
    if not doc.get("complete", True):
        text += " **Incomplete run.**"
    return text


def step_block(doc, step, json_name):
    """The text between a step README's markers, or None when the run did not measure `step`."""
    lo, hi = STEP_SEQLENS
    idx = index(doc)
    out = [step_run_line(doc, json_name), ""]
    errors = False
    for direction, title in DIRECTIONS:
        mine = [r for r in doc["results"] if r["impl"] == step and r["direction"] == direction
                and lo <= r["seqlen_q"] <= hi]
        if not mine:
            continue
        cfgs = sorted({(r["head_dim"], r["causal"]) for r in mine})
        ns = sorted({r["seqlen_q"] for r in mine})
        others = step_comparisons(doc, step, direction)
        caption = "**%s**, TFLOP/s by sequence length" % title
        if others:
            caption += "; in brackets, on the same tensors in the same run: %s" % (
                " / ".join(c for _, c in others))
        out += [caption + ":", "",
                "| seqlen | %s |" % " | ".join(config_name(*c) for c in cfgs),
                "|---|" + "---|" * len(cfgs)]
        for n in ns:
            cells = [step_cell(idx, step, [o for o, _ in others], (direction, d, causal, n))
                     for d, causal in cfgs]
            errors = errors or "error" in cells
            out.append("| %d | %s |" % (n, " | ".join(cells)))
        out.append("")
    if len(out) == 2:
        return None
    if errors:
        out += ["error: the step did not run at that shape; the message is in "
                "[docs/results.md](../docs/results.md).", ""]
    return "\n".join(out).rstrip("\n")


def page(doc, json_name, png_name, ceilings_png, bench, io_text=None):
    """docs/results.md."""
    idx = index(doc)
    ns = seqlens(doc)
    out = [
        "# Results: every step beside PyTorch {#results_page}",
        "",
        "Written by `common/python/results.py` from `docs/results/%s`; do not edit by hand. "
        "Regenerate on your GPU with `python3 common/python/compare.py` and then "
        "`python3 common/python/results.py docs/results/<gpu>.json` (see @ref python_page)."
        % json_name,
        "",
        "Run: " + run_facts(doc, json_name),
        "",
    ]
    s = settings_line(doc)
    if s:
        out += ["Settings: " + s + " TFLOP/s count 4 B H N^2 d FLOPs forward over unmasked "
                "query/key pairs (about half under causal masking) and 2.5x that backward, "
                "as the harness does.", ""]
    out += ["![TFLOP/s per step over the sequence length; dashed: PyTorch](%s)" % png_name, ""]
    for direction, title in DIRECTIONS:
        names = impls(doc, direction)
        if not names:
            continue
        for d, causal in configs(doc):
            present = [n for n in ns if any((i, direction, d, causal, n) in idx for i in names)]
            if not present:
                continue
            out.append("## %s, head dim %d, %s" % (title, d, "causal" if causal else "no mask"))
            out.append("")
            out.append("TFLOP/s by sequence length (batch x heads); last column: speed "
                       "relative to FLASH, harmonic mean over all lengths.")
            out.append("")
            header = ["implementation"] + ["%d (%dx%d)" % (n, *_bh(idx, names, direction, d,
                                                                    causal, n))
                                           for n in present] + ["vs FLASH"]
            out.append("| " + " | ".join(header) + " |")
            out.append("|---" * len(header) + "|")
            for impl in names:
                cells, pairs = [], []
                for n in present:
                    r = idx.get((impl, direction, d, causal, n))
                    f = idx.get((FLASH, direction, d, causal, n))
                    if r is None:
                        cells.append("-")
                    elif r.get("error"):
                        cells.append("error")
                    elif r["ok"]:
                        cells.append(fmt_tflops(r["tflops"]))
                        if f is not None and f["ok"]:
                            pairs.append((r["tflops"], f["tflops"]))
                    else:
                        cells.append(fmt_tflops(r["tflops"]) + " (check failed)")
                ratio = "-"
                if pairs and impl != FLASH:
                    ratio = "%.2fx" % (harmonic_mean([a for a, _ in pairs]) /
                                       harmonic_mean([b for _, b in pairs]))
                out.append("| %s | %s | %s |" % (label(impl), " | ".join(cells), ratio))
            out.append("")
    out += agreement_section(doc)
    out += error_section(doc)
    if bench is not None:
        out += ceilings_section(doc, bench, ceilings_png)
    if io_text:
        # profile_io.py's table (docs/results/<gpu>_io.md), measured with Nsight Compute.
        out += ["## Device-memory traffic", "", io_text.strip(), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _bh(idx, names, direction, d, causal, n):
    for impl in names:
        r = idx.get((impl, direction, d, causal, n))
        if r is not None:
            return r["batch"], r["heads"]
    return 0, 0


def agreement_section(doc):
    rows = [r for r in doc["results"] if r.get("checked")]
    if not rows:
        return []
    out = ["## Agreement", "",
           "Worst errors over all shapes: against an fp32 PyTorch reference on the upcast "
           "inputs (two (batch, head) slices per shape, bounds of `fa::tolerance()`), and the "
           "largest difference from FLASH's output on the whole tensor.", "",
           "| implementation | direction | shapes within bounds | worst max abs error "
           "| worst rel. L2 error | worst max abs diff. to FLASH |",
           "|---|---|---|---|---|---|"]
    for direction, title in DIRECTIONS:
        for impl in impls(doc, direction):
            mine = [r for r in rows if r["impl"] == impl and r["direction"] == direction]
            if not mine:
                continue
            worst = lambda key: max((r.get(key) if r.get(key) is not None else math.inf)
                                    for r in mine)
            vs = [r["max_abs_vs_flash"] for r in mine if r.get("max_abs_vs_flash") is not None]
            out.append("| %s | %s | %d / %d | %.1e | %.1e | %s |" % (
                label(impl), title.lower(), sum(1 for r in mine if r.get("passed")), len(mine),
                worst("max_abs"), worst("rel_l2"), "%.1e" % max(vs) if vs else "-"))
    return out + [""]


def error_section(doc):
    errors = sorted({(r["impl"], r["direction"], r["head_dim"], r["causal"], r["seqlen_q"],
                      r["error"]) for r in doc["results"] if r.get("error")})
    if not errors:
        return []
    out = ["## Shapes that did not run", "", "| implementation | direction | shape | error |",
           "|---|---|---|---|"]
    for impl, direction, d, causal, n, err in errors:
        out.append("| %s | %s | d=%d%s N=%d | %s |" % (
            label(impl), direction, d, " causal" if causal else "", n,
            err.replace("|", "\\|").replace("\n", " ")))
    return out + [""]


def ceilings_section(doc, bench, ceilings_png):
    c = bench.get("ceilings", {})
    mma, cublas = c.get("mma_sync_tflops"), c.get("cublas_gemm_tflops")
    out = ["## Share of the two ceilings", "",
           "From `./build/bin/bench` on %s (commit `%s`, %s): dense mma.sync m16n8k16 "
           "%s TFLOP/s, which bounds every kernel here, and a large cuBLAS GEMM %s TFLOP/s, "
           "the chip's practical ceiling. Percent of mma.sync / percent of cuBLAS at the "
           "largest sequence length each step ran:" % (
               bench["gpu"].get("name", "?"), bench.get("run", {}).get("commit", "?")[:12],
               bench.get("run", {}).get("date", "?"),
               "%.0f" % mma if mma else "?", "%.0f" % cublas if cublas else "?"), ""]
    cfgs = sorted({(r["head_dim"], r["causal"]) for r in bench["results"]})
    out.append("| step | direction | " + " | ".join(config_name(*x) for x in cfgs) + " |")
    out.append("|---|---|" + "---|" * len(cfgs))
    for direction, title in DIRECTIONS:
        for impl in impls(bench, direction):
            cells = []
            for d, causal in cfgs:
                rs = [r for r in bench["results"] if r["impl"] == impl and r["ok"]
                      and r["direction"] == direction and r["head_dim"] == d
                      and r["causal"] == causal]
                if not rs:
                    cells.append("-")
                    continue
                r = max(rs, key=lambda r: r["seqlen_q"])
                cells.append("%.0f%% / %.0f%%" % (r.get("pct_mma") or 0, r.get("pct_cublas") or 0))
            out.append("| %s | %s | %s |" % (impl, title.lower(), " | ".join(cells)))
    out += ["", "![Share of the mma.sync and cuBLAS ceilings per step](%s)" % ceilings_png, ""]
    return out


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


def _panels(doc):
    dirs = [d for d, _ in DIRECTIONS if any(r["direction"] == d for r in doc["results"])]
    return dirs, configs(doc)


def _save(fig, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    # No "Software" or date metadata: the same JSON gives the same bytes.
    fig.savefig(path, dpi=110, metadata={"Software": None})


def plot(doc, path, value="tflops", ylabel="TFLOP/s", title=None, ceilings=None):
    """One panel per (direction, head dim, causal): `value` over the sequence length, steps as
    solid lines, PyTorch backends dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "svg.hashsalt": "flash-attention-steps"})
    dirs, cfgs = _panels(doc)
    fig, axes = plt.subplots(len(dirs), len(cfgs), figsize=(3.2 * len(cfgs), 2.9 * len(dirs)),
                             squeeze=False, sharex=True)
    idx = index(doc)
    cmap = plt.get_cmap("viridis")
    step_names = [i for i in impls(doc) if not i.startswith("sdpa_")]
    colors = {s: cmap(0.9 * i / max(1, len(step_names) - 1)) for i, s in enumerate(step_names)}
    colors.update({"sdpa_flash": "black", "sdpa_cudnn": "tab:red", "sdpa_efficient": "tab:gray"})
    ns = seqlens(doc)
    for row, direction in enumerate(dirs):
        for col, (d, causal) in enumerate(cfgs):
            ax = axes[row][col]
            for impl in impls(doc, direction):
                pts = [(n, idx[(impl, direction, d, causal, n)]) for n in ns
                       if (impl, direction, d, causal, n) in idx]
                pts = [(n, r[value]) for n, r in pts if r["ok"] and r.get(value) is not None]
                if not pts:
                    continue
                backend = impl.startswith("sdpa_")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label(impl),
                        color=colors.get(impl, "tab:blue"), linestyle="--" if backend else "-",
                        marker=None if backend else "o", markersize=3,
                        linewidth=1.0 if backend else 1.4)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns)
            ax.set_xticklabels(["%dK" % (n // 1024) if n >= 1024 else str(n) for n in ns])
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.set_title("%s, %s" % (dict(DIRECTIONS)[direction].lower(),
                                     config_name(d, causal)))
            if col == 0:
                ax.set_ylabel(ylabel)
            if row == len(dirs) - 1:
                ax.set_xlabel("sequence length")
            if ceilings:
                mma, cublas = ceilings
                ax.secondary_yaxis("right", functions=(lambda p: p * mma / cublas,
                                                       lambda p: p * cublas / mma))
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), frameon=False)
    fig.suptitle(title or "%s: TFLOP/s per step (dashed: PyTorch SDPA backends)"
                 % doc["gpu"].get("name", ""))
    fig.tight_layout(rect=(0, 0.1 if len(labels) > 5 else 0.06, 1, 0.97))
    _save(fig, path)
    plt.close(fig)


def ceilings_doc(doc, bench):
    """Rows for the ceilings plot: the bench's steps (their pct_mma) plus the PyTorch
    backends of `doc` over the same mma.sync ceiling."""
    mma = bench.get("ceilings", {}).get("mma_sync_tflops")
    rows = [r for r in bench["results"]]
    if mma:
        for r in doc["results"]:
            if r["kind"] == "pytorch" and r["ok"]:
                rr = dict(r)
                rr["pct_mma"] = 100.0 * r["tflops"] / mma
                rows.append(rr)
    return {"gpu": bench["gpu"], "results": rows}


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Write the plot, the README results table, the measured block of each "
                    "step README that has the %s / %s markers and docs/results.md from a "
                    "compare.py JSON. The same JSON always gives the same files."
                    % (STEP_BEGIN, STEP_END))
    p.add_argument("json", help="compare.py output, e.g. docs/results/nvidia-h200.json")
    p.add_argument("--bench", help="bench JSON (./build/bin/bench --out bench.json) of the same "
                                   "GPU: adds each step's share of the two ceilings")
    p.add_argument("--png", help="plot (default: docs/results/<json name>.png)")
    p.add_argument("--ceilings-png", help="ceilings plot (default: docs/results/<json "
                                          "name>_ceilings.png; needs --bench)")
    p.add_argument("--readme", default=os.path.join(REPO, "README.md"),
                   help="README whose table to rewrite (default: the repository's)")
    p.add_argument("--page", default=os.path.join(REPO, "docs", "results.md"),
                   help="results page to write (default: docs/results.md)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the plots")
    p.add_argument("--steps-dir",
                   help="folder holding the step folders whose README.md to update between "
                        "%s and %s (default: the --readme's folder)" % (STEP_BEGIN, STEP_END))
    p.add_argument("--no-readme", action="store_true",
                   help="leave the README and the step READMEs alone")
    p.add_argument("--no-step-readmes", action="store_true",
                   help="leave the step READMEs alone")
    p.add_argument("--no-page", action="store_true", help="do not write docs/results.md")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the README table, a step README's block or "
                        "the page is out of date")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    doc = load(a.json)
    bench = load(a.bench) if a.bench else None
    slug = slug_of(a.json)
    results_dir = os.path.join(REPO, "docs", "results")
    png = a.png or os.path.join(results_dir, slug + ".png")
    cpng = a.ceilings_png or os.path.join(results_dir, slug + "_ceilings.png")
    json_name = os.path.basename(a.json)
    texts = {}
    if not a.no_readme:
        with open(a.readme) as f:
            texts[a.readme] = replace_block(f.read(), readme_block(
                doc, json_name, os.path.basename(png)))
    if not a.no_readme and not a.no_step_readmes:
        root = a.steps_dir or os.path.dirname(os.path.abspath(a.readme))
        for step, path in step_readmes(root):
            with open(path) as f:
                old = f.read()
            if STEP_BEGIN not in old and STEP_END not in old:
                continue  # this README has not opted in
            block = step_block(doc, step, json_name)
            if block is None:
                if not a.check:
                    print("results.py: %s not measured in %s, %s left as it is"
                          % (step, json_name, os.path.relpath(path)))
                continue
            texts[path] = replace_block(old, block, STEP_BEGIN, STEP_END, path)
    if not a.no_page:
        io_path = os.path.join(results_dir, slug + "_io.md")
        io_text = open(io_path).read() if os.path.exists(io_path) else None
        texts[a.page] = page(doc, json_name, os.path.basename(png), os.path.basename(cpng),
                             bench, io_text)
    if a.check:
        stale = []
        for path, text in texts.items():
            old = open(path).read() if os.path.exists(path) else None
            if old != text:
                stale.append(path)
        for path in stale:
            print("results.py: %s is out of date with %s" % (path, a.json))
        return 1 if stale else 0
    for path, text in texts.items():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print("results.py: wrote %s" % os.path.relpath(path))
    if not a.no_plot:
        plot(doc, png)
        print("results.py: wrote %s" % os.path.relpath(png))
        if bench is not None:
            c = bench.get("ceilings", {})
            mma, cublas = c.get("mma_sync_tflops"), c.get("cublas_gemm_tflops")
            plot(ceilings_doc(doc, bench), cpng, value="pct_mma",
                 ylabel="% of mma.sync (right: % of cuBLAS)",
                 title="%s: share of the mma.sync (%.0f TFLOP/s) and cuBLAS (%.0f TFLOP/s) "
                       "ceilings" % (bench["gpu"].get("name", ""), mma or 0, cublas or 0),
                 ceilings=(mma, cublas) if mma and cublas else None)
            print("results.py: wrote %s" % os.path.relpath(cpng))
    return 0


if __name__ == "__main__":
    sys.exit(main())
