#!/usr/bin/env python3
"""Device-memory traffic of every step, measured by Nsight Compute, beside the CPU models.

Usage (on a GPU machine, after `cmake --workflow --preset default`):

    python3 common/python/profile_io.py                       # B=1 H=16 N=4096 d=128, fp16
    python3 common/python/profile_io.py --causal --log-dir "$OUT"
    python3 common/python/profile_io.py --steps 01_naive,05_split_q --directions fwd
    python3 common/python/profile_io.py --model-only          # no GPU: the predictions only
    python3 common/python/profile_io.py --help

For each step it runs the step's runner once under Nsight Compute,

    ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum \\
        ./build/bin/<step> --batch 1 --heads 16 --seqlen 4096 --head-dim 128 \\
        --repeats 1 --warmup 0 --warmup-ms 0 --no-check --no-ceilings

and sums the DRAM bytes read and written over the kernels of that one forward pass (with
--no-check and no warm-up, by count or by time, the runner launches exactly one forward, after
the harness kernels that make its inputs on the GPU, which are left out by name). For the
backward (``--backward``) the runner launches one forward and then one backward; the
forward's kernels are left out too, by the kernel count of the forward profile.

Beside each measurement it prints the bytes the CPU models predict
(common/include/fa/cpu_models.h, implemented in common/src/host/cpu_models.cpp): the models
count elements; this script evaluates their documented closed forms in Python (the host tests
check the C++ models against the same closed forms) and converts elements to bytes with the
sizes the kernels use (fp16/bf16 Q, K, V, O, dO, dK, dV: 2 bytes; fp32 S, logsumexp, m, l,
D and the dQ accumulator: 4 bytes; P in step 01: 2 bytes). The model of a step:

- 01_naive: standard attention (S and P written to and read back from device memory);
- 02_tiled_fa1: FlashAttention-1 (O, m, l re-read and re-written per K/V block);
- 03..05: FlashAttention-2 forward without skipping (masked blocks are still loaded);
- 06_causal_skip, 07_backward, 08_split_kv, 09_hopper_wgmma, 10_hopper_pingpong:
  FlashAttention-2 forward with causal skipping;
- backward of 07_backward: FlashAttention-2 backward (no model for 01's cuBLAS backward).

Block sizes are read from each step's kernel.cu (its TileShape / BwdTileShape), else assumed.
The models charge every tile load to device memory; on the GPU, re-reads of K and V tiles
often hit the L2 cache (50 MB on an H200), so measured DRAM bytes fall below the model for
the FlashAttention steps, while step 01's N x N matrices do not fit and show up in full.

Output: a table on stdout, and JSON + Markdown at --out (default
docs/results/<gpu-slug>_io.json and .md, or _io_causal with --causal), copied to --log-dir
(default $OUT if set) with the raw ncu logs.
"""

import argparse
import csv
import datetime
import glob
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402  (standard library only at import: its run_info names the commit)
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")

#: Which CPU model describes each step's forward (steps not listed: FlashAttention-2).
FORWARD_MODEL = {"01_naive": "standard", "02_tiled_fa1": "fa1", "03_loop_swap": "fa2",
                 "04_deferred_rescale": "fa2", "05_split_q": "fa2",
                 "06_causal_skip": "fa2_skip", "07_backward": "fa2_skip",
                 "08_split_kv": "fa2_skip", "09_hopper_wgmma": "fa2_skip",
                 "10_hopper_pingpong": "fa2_skip"}
#: The harness's own kernels in a runner's launches (its inputs, made on the GPU).
HARNESS_KERNEL = re.compile(r"\bfill_(bits|inputs)_kernel\b")
#: Which CPU model describes each step's backward.
BACKWARD_MODEL = {"07_backward": "fa2_bwd"}
#: Tile sizes assumed when a kernel.cu does not show them: FlashAttention-2's (B_r, B_c).
DEFAULT_FWD_BLOCKS = {64: (128, 128), 128: (128, 64)}
DEFAULT_BWD_BLOCKS = {64: (64, 128), 128: (64, 128)}

HALF, FLOAT = 2, 4  # bytes per element: fp16/bf16 tensors, fp32 side data


# ---------------------------------------------------------------------------------------------
# The CPU models' closed forms (cpu_models.h), in bytes
# ---------------------------------------------------------------------------------------------


def cdiv(a, b):
    return -(-a // b)


def standard_forward_bytes(B, H, Hkv, Nq, Nk, d, causal):
    """Standard attention: per query head reads Q, K, S, P, V; writes S, P, L, O."""
    reads = (Nq * d + 2 * Nk * d) * HALF + Nq * Nk * FLOAT + Nq * Nk * HALF
    writes = Nq * Nk * FLOAT + Nq * Nk * HALF + Nq * FLOAT + Nq * d * HALF
    return B * H * reads, B * H * writes


def fa1_forward_bytes(B, H, Hkv, Nq, Nk, d, causal, br, bc):
    """FlashAttention-1: K_j, V_j once; Q_i, O_i, l_i, m_i per inner step; O, l, m written
    once to initialize and then per inner step."""
    tc = cdiv(Nk, bc)
    reads = 2 * B * Hkv * Nk * d * HALF + tc * B * H * Nq * (2 * d * HALF + 2 * FLOAT)
    writes = (tc + 1) * B * H * Nq * (d * HALF + 2 * FLOAT)
    return reads, writes


def kv_rows_seen(q_block, Nq, Nk, br, bc, causal):
    """K/V rows a Q block loads: all N_k, or under causal skipping up to the last block its
    last row sees (cpu_models.h, fa2_forward)."""
    if not causal:
        return Nk
    last = min((q_block + 1) * br, Nq) - 1 + Nk - Nq
    if last < 0:
        return 0
    return min(Nk, bc * (last // bc + 1))


def fa2_forward_bytes(B, H, Hkv, Nq, Nk, d, causal, br, bc, skip):
    """FlashAttention-2 forward: Q_i once, K_j and V_j per inner step (skipped above the
    diagonal when `skip`), O and L written once."""
    tr = cdiv(Nq, br)
    kv = sum(kv_rows_seen(i, Nq, Nk, br, bc, causal and skip) for i in range(tr))
    reads = B * H * (Nq * d + 2 * kv * d) * HALF
    writes = B * H * Nq * (d * HALF + FLOAT)
    return reads, writes


def fa2_backward_bytes(B, H, Hkv, Nq, Nk, d, causal, br, bc):
    """FlashAttention-2 backward: dO and O read for D; K_j, V_j once; per inner step Q_i,
    O_i, dO_i (2 bytes), dQ_i (fp32), L_i, D_i (fp32) read and dQ_i written; dQ zeroed and D
    written; dK, dV written. Inner steps whose Q block sees nothing of the K/V block are
    skipped under causal masking."""
    tr, tc = cdiv(Nq, br), cdiv(Nk, bc)
    q_rows = 0  # sum over the inner steps that run of the Q block's rows
    for j in range(tc):
        for i in range(tr):
            last = min((i + 1) * br, Nq) - 1 + Nk - Nq
            if causal and last < j * bc:
                continue
            q_rows += min((i + 1) * br, Nq) - i * br
    reads = (2 * B * H * Nq * d * HALF + 2 * B * Hkv * Nk * d * HALF
             + B * H * q_rows * (3 * d * HALF + d * FLOAT + 2 * FLOAT))
    writes = (B * H * Nq * (d * FLOAT + FLOAT) + B * H * q_rows * d * FLOAT
              + 2 * B * Hkv * Nk * d * HALF)
    return reads, writes


def lab_source(step, bin_dir):
    """(folder, step it is a lab for) of a course lab registered in the build that holds
    bin_dir (FA_LAB_DIRS, read by common/scripts/lab.py), else (None, None)."""
    try:
        spec = importlib.util.spec_from_file_location(
            "lab", os.path.join(REPO, "common", "scripts", "lab.py"))
        lab = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(lab)
        for folder in lab.lab_dirs(pathlib.Path(bin_dir).resolve().parent):
            if folder.name == step:
                return str(folder), lab.read_meta(folder).get("target")
    except Exception:  # no lab.py, no build, no lab.json: not a lab this script can place
        pass
    return None, None


def step_source(step, bin_dir):
    """(folder of its kernel.cu, the step whose CPU model describes it): a step's own folder,
    or for a course lab its folder and the step it is a lab for (the lab's own tiles)."""
    if os.path.isdir(os.path.join(REPO, step)):
        return os.path.join(REPO, step), step
    folder, target = lab_source(step, bin_dir)
    return (folder, target) if folder and target else (os.path.join(REPO, step), step)


def parse_blocks(step, d, backward=False, folder=None):
    """(B_r, B_c, source) from the step's kernel.cu (in `folder`, default the step's own),
    else FlashAttention-2's defaults."""
    kind = "BwdTileShape" if backward else "TileShape"
    path = os.path.join(folder or os.path.join(REPO, step), "kernel.cu")
    try:
        text = open(path).read()
    except OSError:
        text = ""
    defines = dict(re.findall(r"#define\s+(\w+)\s+(\d+)", text))
    m = re.search(r"struct\s+%s<%d>\s*\{[^}]*?kBlockM\s*=\s*(\w+)\s*,\s*kBlockN\s*=\s*(\w+)"
                  % (kind, d), text)
    if m:
        try:
            br, bc = (int(defines.get(x, x)) for x in m.groups())
            return br, bc, "%s/kernel.cu" % step
        except ValueError:
            pass
    br, bc = (DEFAULT_BWD_BLOCKS if backward else DEFAULT_FWD_BLOCKS).get(d, (128, 64))
    return br, bc, "assumed"


def model_bytes(step, direction, shape, source=None):
    """(model name, reads, writes, blocks) predicted for one step, or (None, ...) if no
    CPU model covers it. source: step_source()'s (folder, model step) for a course lab."""
    folder, model_step = source or (None, step)
    B, H, Hkv, N, d, causal = (shape[k] for k in ("batch", "heads", "heads_kv", "seqlen",
                                                   "head_dim", "causal"))
    if direction == "bwd":
        model = BACKWARD_MODEL.get(model_step)
        if model is None:
            return None, None, None, None
        br, bc, src = parse_blocks(step, d, backward=True, folder=folder)
        r, w = fa2_backward_bytes(B, H, Hkv, N, N, d, causal, br, bc)
        return model, r, w, {"block_r": br, "block_c": bc, "from": src}
    model = FORWARD_MODEL.get(model_step, "fa2")
    if model == "standard":
        r, w = standard_forward_bytes(B, H, Hkv, N, N, d, causal)
        return model, r, w, None
    br, bc, src = parse_blocks(step, d, folder=folder)
    if model == "fa1":
        r, w = fa1_forward_bytes(B, H, Hkv, N, N, d, causal, br, bc)
    else:
        r, w = fa2_forward_bytes(B, H, Hkv, N, N, d, causal, br, bc, model == "fa2_skip")
    return model, r, w, {"block_r": br, "block_c": bc, "from": src}


# ---------------------------------------------------------------------------------------------
# Nsight Compute
# ---------------------------------------------------------------------------------------------

UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
         "kibyte": 1024, "mibyte": 1024 ** 2, "gibyte": 1024 ** 3}


def parse_ncu_csv(text):
    """Sums the two DRAM metrics over the kernels of an `ncu --csv` log.

    Returns {"kernels": n, "read": bytes, "write": bytes, "per_kernel": [...]}. Lines before
    the CSV header (the program's own output, ==PROF== notes) are ignored."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (\"ID\",...) in the output")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    kernels = {}
    for row in reader:
        name = row.get("Metric Name")
        if name not in METRICS or row.get("ID") is None:
            continue
        raw = (row.get("Metric Value") or "").replace(",", "").strip()
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("cannot read %s = %r" % (name, row.get("Metric Value")))
        unit = (row.get("Metric Unit") or "byte").strip().lower()
        if unit not in UNITS:
            raise ValueError("unknown unit %r for %s" % (unit, name))
        k = kernels.setdefault(row["ID"], {"kernel": row.get("Kernel Name", "?"),
                                            "read": 0.0, "write": 0.0})
        k["read" if name == METRICS[0] else "write"] += value * UNITS[unit]
    per = [kernels[i] for i in sorted(kernels, key=lambda x: int(x) if x.isdigit() else x)]
    return {"kernels": len(per), "read": sum(k["read"] for k in per),
            "write": sum(k["write"] for k in per), "per_kernel": per}


def select_pass(parsed, skip):
    """The kernels of one pass from parse_ncu_csv's dict: the harness's kernels left out, then
    the first `skip` of the others (the forward that a backward run launches first)."""
    per = [k for k in parsed["per_kernel"] if not HARNESS_KERNEL.search(k["kernel"])][skip:]
    return {"kernels": len(per), "read": sum(k["read"] for k in per),
            "write": sum(k["write"] for k in per), "per_kernel": per}


def find_ncu(explicit):
    if explicit:
        return explicit
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/usr/local/cuda*/bin/ncu",
                    "/usr/local/cuda*/nsight-compute*/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def runner_args(shape, direction):
    a = ["--batch", str(shape["batch"]), "--heads", str(shape["heads"]), "--heads-kv",
         str(shape["heads_kv"]), "--seqlen", str(shape["seqlen"]), "--head-dim",
         str(shape["head_dim"]), "--dtype", shape["dtype"], "--repeats", "1", "--warmup", "0",
         "--warmup-ms", "0", "--no-check", "--no-ceilings"]
    if shape["causal"]:
        a.append("--causal")
    if direction == "bwd":
        a.append("--backward")
    return a


def profile(ncu, runner, shape, direction, skip, workdir, tag):
    """Runs one step under ncu; returns select_pass's dict (the harness's kernels and the first
    `skip` of the step's left out) plus the command."""
    log = os.path.join(workdir, "ncu_%s.csv" % tag)
    cmd = [ncu, "--clock-control", "none", "--metrics", ",".join(METRICS), "--csv",
           "--print-units", "base", "--log-file", log]
    cmd += [runner] + runner_args(shape, direction)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = open(log).read() if os.path.exists(log) else ""
    if p.returncode != 0:
        why = (p.stderr.strip() or text.strip() or p.stdout.strip()).splitlines()
        raise RuntimeError("exit %d: %s" % (p.returncode, " | ".join(why[-3:])))
    result = select_pass(parse_ncu_csv(text), skip)
    result["command"] = " ".join(os.path.relpath(c, REPO) if c == runner else c for c in cmd)
    return result


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Measure each step's device-memory bytes with Nsight Compute and print "
                    "them beside the CPU models' predictions.")
    p.add_argument("--bin", default=os.path.join(REPO, "build", "bin"),
                   help="folder of the step runners (default: build/bin)")
    p.add_argument("--steps", help="comma-separated steps (default: every runner in --bin)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-kv", type=int, help="default: = heads")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--directions", default="fwd,bwd",
                   help="fwd, bwd or fwd,bwd (default; bwd only for steps with a backward)")
    p.add_argument("--ncu", help="path of ncu (default: PATH, then /usr/local/cuda*/)")
    p.add_argument("--model-only", action="store_true",
                   help="no GPU: print the model's predictions only")
    p.add_argument("--out", help="JSON to write; the .md goes beside it (default: "
                                 "docs/results/<gpu-slug>_io.json, _io_causal.json with --causal)")
    p.add_argument("--log-dir", default=os.environ.get("OUT"),
                   help="folder for copies of the outputs and the raw ncu logs "
                        "(default: $OUT if set)")
    a = p.parse_args(argv)
    a.directions = [x for x in a.directions.split(",") if x]
    if not a.directions or any(x not in ("fwd", "bwd") for x in a.directions):
        p.error("--directions takes fwd, bwd or fwd,bwd")
    return a


def list_steps(bin_dir):
    """Runner programs in bin_dir named like steps (NN_name)."""
    if not os.path.isdir(bin_dir):
        return []
    return sorted(f for f in os.listdir(bin_dir) if re.match(r"^\d\d_\w+$", f)
                  and os.access(os.path.join(bin_dir, f), os.X_OK))


def has_backward(step, bin_dir=None):
    """Whether the step has a backward pass: asked of libfa (beside the runners, or $FA_LIB)
    through the wrapper; without the library, the steps known to have one."""
    try:
        if bin_dir and not os.environ.get("FA_LIB"):
            lib = os.path.join(bin_dir, os.pardir, "lib", "libfa.so")
            if os.path.isfile(lib):
                os.environ["FA_LIB"] = os.path.abspath(lib)
        import flash_steps  # beside this script (HERE is on sys.path)

        return flash_steps.has_backward(step)
    except Exception:  # no library here (e.g. --model-only on a laptop): fall back
        return step in BACKWARD_MODEL or step == "01_naive"


def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip().splitlines()
        name, driver = [x.strip() for x in out[0].split(",")[:2]]
        return name, driver
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return "unknown GPU", "unknown"


def mb(x):
    return "-" if x is None else "%.1f" % (x / 1e6)


def markdown(doc):
    s = doc["shape"]
    lines = [
        "Device-memory traffic of one %s pass, B=%d H=%d N=%d d=%d %s %s, on %s "
        "(Nsight Compute `dram__bytes_read.sum` + `dram__bytes_write.sum`, summed over the "
        "pass's kernels), beside the CPU models' prediction (common/src/host/cpu_models.cpp, "
        "closed forms evaluated by common/python/profile_io.py). MB = 10^6 bytes." % (
            "/".join(doc["directions"]), s["batch"], s["heads"], s["seqlen"], s["head_dim"],
            s["dtype"], "causal" if s["causal"] else "no mask", doc["gpu"]),
        "",
        "| step | pass | kernels | DRAM read MB | DRAM write MB | DRAM total MB | model | "
        "model read MB | model write MB | measured / model |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r.get("error"):
            lines.append("| %s | %s | error: %s | | | | | | | |" % (
                r["step"], r["direction"], r["error"].replace("|", "\\|")))
            continue
        total = (r["read"] + r["write"]) if r.get("read") is not None else None
        model_total = (r["model_read"] + r["model_write"]) if r.get("model_read") else None
        ratio = "%.2f" % (total / model_total) if total is not None and model_total else "-"
        blocks = r.get("blocks")
        model = r.get("model") or "-"
        if blocks:
            model += " (%dx%d%s)" % (blocks["block_r"], blocks["block_c"],
                                     ", assumed" if blocks["from"] == "assumed" else "")
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["step"], r["direction"], r.get("kernels", "-"), mb(r.get("read")),
            mb(r.get("write")), mb(total), model, mb(r.get("model_read")),
            mb(r.get("model_write")), ratio))
    lines += ["", "The model charges every tile load to device memory; re-reads that hit the "
              "L2 cache do not reach DRAM, so the FlashAttention steps measure below their "
              "model, while step 01's N x N score and probability matrices do not fit in L2 "
              + ("and reach DRAM; under the mask 01's kernels skip part of them, which its "
                 "model still charges." if s["causal"] else "and are measured in full.")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    a = parse_args(argv)
    steps = [x for x in a.steps.split(",") if x] if a.steps else list_steps(a.bin)
    if not steps:
        sys.exit("profile_io.py: no step runners in %s (build first: cmake --workflow --preset "
                 "default), or pass --steps" % a.bin)
    shape = {"batch": a.batch, "heads": a.heads, "heads_kv": a.heads_kv or a.heads,
             "seqlen": a.seqlen, "head_dim": a.head_dim, "dtype": a.dtype,
             "causal": a.causal}
    ncu = None
    if not a.model_only:
        ncu = find_ncu(a.ncu)
        if ncu is None:
            sys.exit("profile_io.py: ncu (Nsight Compute) not found; pass --ncu PATH, or "
                     "--model-only for the predictions alone")
    name, driver = gpu_name() if not a.model_only else ("(model only)", "")
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"
    out = a.out or os.path.join(REPO, "docs", "results",
                                slug + ("_io_causal.json" if a.causal else "_io.json"))
    workdir = a.log_dir or os.path.join(REPO, "build", "profile_io")
    os.makedirs(workdir, exist_ok=True)
    rows = []
    for step in steps:
        runner = os.path.join(a.bin, step)
        fwd_kernels = None
        for direction in ("fwd", "bwd"):
            if direction == "bwd" and not has_backward(step, a.bin):
                continue
            measure = direction in a.directions
            if not measure and not (direction == "fwd" and "bwd" in a.directions
                                    and has_backward(step, a.bin)):
                continue
            model, mr, mw, blocks = model_bytes(step, direction, shape,
                                                step_source(step, a.bin))
            row = {"step": step, "direction": direction, "model": model, "model_read": mr,
                   "model_write": mw, "blocks": blocks, "error": ""}
            if not a.model_only:
                sys.stderr.write("profile_io.py: %s %s ...\n" % (step, direction))
                sys.stderr.flush()
                try:
                    if direction == "bwd" and fwd_kernels is None:
                        raise RuntimeError("the forward profile failed, so the backward's "
                                           "kernels cannot be told apart")
                    res = profile(ncu, runner, shape, direction,
                                  fwd_kernels if direction == "bwd" else 0, workdir,
                                  "%s_%s" % (step, direction))
                    row.update(res)
                    if direction == "fwd":
                        fwd_kernels = res["kernels"]
                except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
                    row["error"] = str(e)
            if measure:
                rows.append(row)
    doc = {"gpu": name, "driver": driver, "shape": shape, "directions": a.directions,
           "ncu": ncu, "metrics": list(METRICS),
           "commit": compare.run_info()["commit"],  # FA_GIT_COMMIT first, then git
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "model_source": "closed forms of common/include/fa/cpu_models.h evaluated in Python",
           "rows": rows}
    md = markdown(doc)
    print(md)
    if not a.model_only or a.out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(md)
        if a.log_dir and os.path.abspath(os.path.dirname(out)) != os.path.abspath(a.log_dir):
            shutil.copy(out, a.log_dir)
            shutil.copy(os.path.splitext(out)[0] + ".md", a.log_dir)
        print("profile_io.py: wrote %s and .md" % os.path.relpath(out))
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
