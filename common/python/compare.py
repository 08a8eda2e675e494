#!/usr/bin/env python3
"""Every step beside PyTorch's attention backends: same tensors, one process, checked, timed.

Usage (on a machine with an sm_80+ GPU, PyTorch and a built libfa):

    python3 common/python/compare.py                    # the paper sweep -> docs/results/<gpu>.json
    python3 common/python/compare.py --quick            # 2 seqlens, fewer repeats (a minute)
    python3 common/python/compare.py --steps 05_split_q,07_backward --seqlens 4096 \\
        --head-dims 128 --causal 1 --directions fwd --out /tmp/mine.json
    python3 common/python/compare.py --log-dir "$OUT"   # also copy the JSON and the log there
    python3 common/python/compare.py --merge a.json b.json --out all.json   # join partial runs
    python3 common/python/compare.py --decode --steps 06_causal_skip,08_split_kv --backends flash
    python3 common/python/compare.py --energy --steps 06_causal_skip --directions fwd   # + mJ/call
    python3 common/python/compare.py --help

For every shape of the sweep (16K tokens: batch = 16384 / seqlen; hidden 2048: heads =
2048 / head_dim; seqlen 512..16K; head dim 64 and 128; causal off and on; fp16) it makes one
set of random inputs q, k, v, dO in BSHD layout [B, N, H, d] (as the harness draws them:
uniform in (-1, 1), plus 0.5 for v and dO, rounded once from fp32, see draw_input(); or
N(0, 1) with --inputs normal: on the H200 normal inputs timed up to 5% slower at N = 16384,
see common/scripts/gpu/agree.sh) and runs on them:

- every landed step of this repository (through the ctypes wrapper, flash_steps), forward,
  and backward for the steps that have one;
- PyTorch's scaled_dot_product_attention with each of its FLASH (FlashAttention-2), CUDNN and
  EFFICIENT backends, forced with torch.nn.attention.sdpa_kernel, on [B, H, N, d] views of
  the same tensors (q.transpose(1, 2): no copy), forward, and backward through autograd
  (only the backward call is timed).

Agreement: each output (O, and the logsumexp for the steps; dQ, dK, dV) is compared with an
fp32 PyTorch reference computed on the upcast inputs of two (batch, head) slices, with the
harness's per-dtype bounds (fa::tolerance() in common/src/host/metrics.cpp), and with FLASH's
output on the whole tensor.

Timing: the harness's method: CUDA events around each call, warm-up runs (at least --warmup,
and for at least --warmup-ms, 250 ms, queued back to back in batches of about 5 ms: the GPU in
a sustained load's clock state, see the README's "Burst or sustained"; the first measurement
of a shape warms up for at least --heat-ms, 2000 ms, as the bench does, since the GPU idled
while the shape's inputs and reference were made), the median of the timed repeats, and the spread
(max - min) / median. The calls are queued back to back so
that Python's launch overhead (a few microseconds that the C++ harness does not have) is
hidden behind the GPU work instead of being timed. TFLOP/s use the harness's FLOP counts:
forward 4 B H Nq Nk d over unmasked pairs only, backward 2.5x forward.

Energy (--energy): under the power cap of a sustained load a kernel's time follows the energy
it spends per call (README, "Burst or sustained"), so each timed cell (each round) can also
read NVML's counter of the GPU's total energy (nvmlDeviceGetTotalEnergyConsumption, mJ since
the driver loaded, Volta and newer; through ctypes, no pip package) just before its timed calls
are queued and after the last synchronize. Rows then get energy_mj_per_call (energy / calls),
power_w (energy / wall time of the interval), energy_calls (the calls counted, over all rounds)
and, with rounds, round_energy_mj, each round's figure (the row's is their median, as for the
time). NVML updates the counter only every 20-100 ms: the interval must be much longer than
that, so calls are run after the timed ones (the CUDA-event timing is unchanged) until it lasts
--energy-ms (500 ms; at most about one update period off at each end, so more is more exact).
Where NVML or the counter is missing one warning says so and the rows get null. Without
--energy the JSON has none of these keys.

Decoding (--decode): instead of the paper's sweep, few query rows against long key sequences,
the shapes of text generation: seqlen_q in --seqlens-q (1, 16), seqlen_k in --seqlens-k (1K..128K),
batch in --batches (1..64), --heads query heads (32) with --heads-kv key/value heads (8, 32),
head dim 128, no mask and the forward pass unless --head-dims, --causal or --directions say
else; shapes whose K and V exceed --max-kv-gib are left out. SDPA gets GQA through enable_gqa,
and under causal masking with seqlen_q != seqlen_k the bottom-right mask the steps use
(torch.nn.attention.bias.causal_lower_right). These shapes are bound by reading K and V, not by
FLOPs: each forward row also gets gbps, the bytes of K and V (each read once) per second, and
pct_copy, that as a percentage of a device-to-device copy measured at the start of the run
(torch's copy_ of 1 GiB, bytes read + written over the median time; "ceilings" in the JSON).
A shape whose K and V would fit in the L2 cache is timed on several copies of its tensors,
called in turn (together at least 4x the L2; --no-rotate turns that off): each timed call then
reads K and V from device memory, as a decode step of a real model does, instead of from the
cache the previous repeat filled.
The JSON goes to docs/results/<gpu-slug>-decode.json by default.

Output: a JSON (GPU, driver, CUDA, torch and cuDNN versions, commit, date, command, and one
row per implementation x direction x shape) at --out, by default docs/results/<gpu-slug>.json;
a table on stdout; a progress line on stderr. The JSON is rewritten after every shape, so an
interrupted run keeps what it measured ("complete": false). Exit status 0 if every step ran
and passed its check, 1 otherwise, 2 on bad flags. Turn the JSON into the plot, the README
table and docs/results.md with common/python/results.py.
"""

import argparse
import ctypes
import datetime
import itertools
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

#: PyTorch SDPA backends compared, as (row name, torch.nn.attention.SDPBackend member).
BACKENDS = [("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION"),
            ("sdpa_efficient", "EFFICIENT_ATTENTION")]
FLASH = "sdpa_flash"

#: The harness's bounds (fa::tolerance, common/src/host/metrics.cpp), per dtype and quantity:
#: max|out - ref| <= c1 * max(|ref|max, 1) and ||out - ref|| / ||ref|| <= c2.
EPS = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}


def tolerance(dtype, quantity):
    """(c1, c2) of the harness for 'output', 'lse' or 'gradient'."""
    eps = EPS[dtype]
    return {"output": (4 * eps, eps), "lse": (1e-4, 1e-4), "gradient": (16 * eps, 4 * eps)}[quantity]


def unmasked_pairs(seqlen_q, seqlen_k, causal):
    """Query/key pairs not masked (bottom-right aligned causal), as fa::unmasked_pairs."""
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    if not causal:
        return seqlen_q * seqlen_k
    first = max(seqlen_k - seqlen_q + 1, 1)
    return seqlen_k * (seqlen_k + 1) // 2 - (first - 1) * first // 2


def flops(direction, batch, heads, seqlen_q, seqlen_k, head_dim, causal):
    """FLOPs as the harness counts them: forward 4 B H d pairs, backward 2.5x that."""
    f = 4.0 * batch * heads * head_dim * unmasked_pairs(seqlen_q, seqlen_k, causal)
    return 2.5 * f if direction == "bwd" else f


def kv_bytes(batch, heads_kv, seqlen_k, head_dim):
    """Bytes of K and V a forward reads, each element (2 bytes) once, as fa::kv_bytes."""
    return 2.0 * 2.0 * batch * heads_kv * seqlen_k * head_dim


#: What the harness adds to V and dO (fa::InputSpec::v_offset), so that O's mean is not 0.
V_OFFSET = 0.5

#: The decode sweep's defaults (--decode): the lists the issue that added step 08 asks for.
DECODE_SEQLENS_Q = [1, 16]
DECODE_SEQLENS_K = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
DECODE_BATCHES = [1, 4, 16, 64]
DECODE_HEADS_KV = [8, 32]


def decode_shapes(args):
    """The shapes of the decode sweep, in order, each with its seed."""
    shapes = []
    for d, causal, hkv, nq, b, nk in itertools.product(args.head_dims, args.causal, args.heads_kv,
                                                       args.seqlens_q, args.batches,
                                                       args.seqlens_k):
        if args.heads % hkv or kv_bytes(b, hkv, nk, d) > args.max_kv_gib * 2 ** 30:
            continue
        shapes.append({"dtype": args.dtype, "batch": b, "heads": args.heads, "heads_kv": hkv,
                       "seqlen_q": nq, "seqlen_k": nk, "head_dim": d, "causal": bool(causal),
                       "seed": args.seed + len(shapes)})
    return shapes


def gpu_slug(name):
    """'NVIDIA H200' -> 'nvidia-h200' (the file name of a GPU's results)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def int_list(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated integers, got %r" % text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False,  # --decode's defaults look for the flags spelled out
        description="Run every step and PyTorch's SDPA backends (FLASH, CUDNN, EFFICIENT) on "
                    "the same tensors, check that they agree, and time them.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: python3 common/python/compare.py --quick --log-dir $OUT")
    p.add_argument("--steps", help="comma-separated steps (default: every landed step)")
    p.add_argument("--backends", default="flash,cudnn,efficient",
                   help="PyTorch SDPA backends to run (default: flash,cudnn,efficient)")
    p.add_argument("--seqlens", type=int_list, default=[512, 1024, 2048, 4096, 8192, 16384],
                   help="sequence lengths (default: 512,1024,2048,4096,8192,16384)")
    p.add_argument("--head-dims", type=int_list, default=[64, 128], help="default: 64,128")
    p.add_argument("--causal", type=int_list, default=[0, 1],
                   help="0 (no mask), 1 (causal) or 0,1 (default)")
    p.add_argument("--directions", default="fwd,bwd", help="fwd, bwd or fwd,bwd (default)")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seqlen (16384)")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head_dim (2048)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per measurement (5)")
    p.add_argument("--warmup-ms", type=float, default=250.0,
                   help="and untimed runs until this many ms have passed (250; as the harness)")
    p.add_argument("--heat-ms", type=float, default=2000.0,
                   help="the first measurement of each shape warms up this long (2000; as the "
                        "bench's --heat-ms)")
    p.add_argument("--repeats", type=int, default=20, help="timed runs, median reported (20)")
    p.add_argument("--rounds", type=int, default=2,
                   help="time every cell of a shape this many times, in the order of the "
                        "table, then reversed, and so on; a cell's figure is the median of all "
                        "its runs (2; as the bench's --rounds)")
    p.add_argument("--quick", action="store_true",
                   help="seqlens 1024,4096, warm-up 2, repeats 5 (other flags still apply)")
    p.add_argument("--no-check", action="store_true", help="skip the agreement checks")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic backward of the steps")
    p.add_argument("--seed", type=int, default=0, help="input seed (0: from the clock, saved)")
    p.add_argument("--inputs", choices=("uniform", "normal"), default="uniform",
                   help="q, k, v, dO uniform in (-1, 1), plus 0.5 for v and dO: the "
                        "harness's distribution, so that the bench and this script time the "
                        "same kind of data (uniform, default); or ~ N(0, 1) (normal)")
    p.add_argument("--out", help="JSON to write (default: docs/results/<gpu-slug>.json)")
    p.add_argument("--log-dir", default=os.environ.get("OUT"),
                   help="folder for a copy of the JSON and the log (default: $OUT if set)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no GPU work: join the rows of these partial runs into --out")
    p.add_argument("--decode", action="store_true",
                   help="the decode sweep: few query rows against long keys, with GB/s of K "
                        "and V against a measured copy ceiling (see the top of this file)")
    p.add_argument("--seqlens-q", type=int_list, default=DECODE_SEQLENS_Q,
                   help="decode: query lengths (default: 1,16)")
    p.add_argument("--seqlens-k", type=int_list, default=DECODE_SEQLENS_K,
                   help="decode: key lengths (default: 1024,2048,...,131072)")
    p.add_argument("--batches", type=int_list, default=DECODE_BATCHES,
                   help="decode: batch sizes (default: 1,4,16,64)")
    p.add_argument("--heads", type=int, default=32, help="decode: query heads (default: 32)")
    p.add_argument("--heads-kv", type=int_list, default=DECODE_HEADS_KV,
                   help="decode: key/value heads (default: 8,32)")
    p.add_argument("--max-kv-gib", type=float, default=40.0,
                   help="decode: leave out shapes whose K and V take more (default: 40)")
    p.add_argument("--no-rotate", dest="rotate", action="store_false",
                   help="decode: time every call on the same tensors, even those that fit in "
                        "the L2 cache (default: rotate among copies, see the top of this file)")
    p.add_argument("--energy", action="store_true",
                   help="also the GPU's energy per call (mJ, NVML's energy counter) and its "
                        "mean power (W) in every timed cell (see the top of this file)")
    p.add_argument("--energy-ms", type=float, default=500.0,
                   help="with --energy: each cell's energy interval lasts at least this long, "
                        "more calls being run after the timed ones if need be (500; NVML's "
                        "counter moves only every 20-100 ms)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": smoke tests
    a = p.parse_args(argv)
    if a.decode:  # decoding: d = 128, no mask (seqlen_q = 1 sees every key anyway), forward
        given = set(x.split("=")[0] for x in (argv if argv is not None else sys.argv[1:]))
        if "--head-dims" not in given:
            a.head_dims = [128]
        if "--causal" not in given:
            a.causal = [0]
        if "--directions" not in given:
            a.directions = "fwd"
    if a.quick:
        if a.seqlens == p.get_default("seqlens"):
            a.seqlens = [1024, 4096]
        a.warmup = min(a.warmup, 2)
        a.warmup_ms = min(a.warmup_ms, 50.0)
        a.heat_ms = min(a.heat_ms, 50.0)
        a.repeats = min(a.repeats, 5)
    a.directions = [d for d in a.directions.split(",") if d]
    if not a.directions or any(d not in ("fwd", "bwd") for d in a.directions):
        p.error("--directions takes fwd, bwd or fwd,bwd")
    if any(c not in (0, 1) for c in a.causal) or not a.causal:
        p.error("--causal takes 0, 1 or 0,1")
    for flag in ("seqlens", "head_dims", "seqlens_q", "seqlens_k", "batches", "heads_kv"):
        if not getattr(a, flag):
            p.error("--%s expects a comma-separated list of integers" % flag.replace("_", "-"))
    if any(n < 1 for n in a.seqlens) or any(d < 1 for d in a.head_dims):
        p.error("--seqlens and --head-dims must be positive")
    if any(n < 1 for n in a.seqlens_q + a.seqlens_k + a.batches + a.heads_kv) or a.heads < 1:
        p.error("--seqlens-q, --seqlens-k, --batches, --heads and --heads-kv must be positive")
    if a.repeats < 1 or a.rounds < 1 or a.warmup < 0 or not a.warmup_ms >= 0 or not a.heat_ms >= 0:
        p.error("--repeats and --rounds must be >= 1, --warmup, --warmup-ms and --heat-ms >= 0")
    if not a.energy_ms >= 0:
        p.error("--energy-ms must be >= 0")
    names = dict((n.split("_", 1)[1], n) for n, _ in BACKENDS)
    a.backends = [b for b in a.backends.split(",") if b]
    for b in a.backends:
        if b not in names:
            p.error("unknown backend %r (choose from %s)" % (b, ",".join(names)))
    a.backends = [names[b] for b in a.backends]
    if a.merge and not a.out:
        p.error("--merge needs --out")
    a.copy_gbps = 0.0  # measured by main() for --decode
    a.l2_bytes = 0  # the GPU's L2 cache, set by main() for --decode (0: no rotation)
    a.meter = None  # the EnergyMeter of --energy, opened by main()
    return a


# ---------------------------------------------------------------------------------------------
# Run information
# ---------------------------------------------------------------------------------------------


def _run(cmd):
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# Environment variables that change which kernels the steps run (fa::smem_per_block_optin,
# 08_split_kv's FA_NUM_SPLITS, 07_backward's FA_BWD_TAIL_SPLIT and its test knob
# FA_BWD_LATE_PREPROCESS, the Hopper steps' FA_HOPPER_BLOCK_M and FA_HOPPER_GRID): recorded in
# front of the command, as the shell line that reproduces the run (fa::run_info does the same,
# with the same list; a host test keeps the two equal).
KERNEL_ENV = ("FA_SMEM_LIMIT", "FA_NUM_SPLITS", "FA_BWD_TAIL_SPLIT", "FA_BWD_LATE_PREPROCESS",
              "FA_HOPPER_BLOCK_M", "FA_HOPPER_GRID")


def run_info():
    """Commit (and whether tracked files differ from it), date, command line (with the
    KERNEL_ENV variables that are set)."""
    # FA_GIT_COMMIT names the commit of a source tree exported without .git (git archive).
    commit = os.environ.get("FA_GIT_COMMIT") or _run(["git", "rev-parse", "HEAD"]) or "unknown"
    dirty = False if os.environ.get("FA_GIT_COMMIT") else bool(
        _run(["git", "status", "--porcelain", "--untracked-files=no"]))
    return {"commit": commit, "dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join(["%s=%s" % (k, os.environ[k]) for k in KERNEL_ENV
                                 if k in os.environ]
                                + ["python3", os.path.relpath(os.path.abspath(sys.argv[0]), REPO)]
                                + sys.argv[1:]),
            "host": platform.node()}


def gpu_info(torch, fs):
    """The GPU and the software stack of this run."""
    dev = torch.cuda.current_device()
    prop = torch.cuda.get_device_properties(dev)
    driver = _run(["nvidia-smi", "-i", str(dev), "--query-gpu=driver_version",
                   "--format=csv,noheader"]) or "unknown"
    nvcc = _run(["nvcc", "--version"])
    m = re.search(r"release ([0-9.]+)", nvcc)
    return {"name": prop.name, "sm_count": prop.multi_processor_count,
            "compute_capability": "%d.%d" % (prop.major, prop.minor),
            "memory_gib": round(prop.total_memory / 2 ** 30, 1),
            "driver": driver.splitlines()[0] if driver else "unknown",
            "cuda_runtime_torch": torch.version.cuda or "unknown",
            "cuda_toolkit_libfa": m.group(1) if m else "unknown",
            "torch": torch.__version__,
            "cudnn": str(torch.backends.cudnn.version()),
            "libfa": os.path.relpath(fs.library_path(), REPO)}


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def synchronize(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def empty_cache(torch, device):
    if device == "cuda":
        torch.cuda.empty_cache()


class NvmlError(RuntimeError):
    """NVML missing, or one of its calls failing (the message names the call and NVML's
    error)."""


class NvmlEnergy:
    """NVML's counter of the energy one GPU has used since the driver loaded, in mJ (Volta and
    newer), read through ctypes on libnvidia-ml.so.1, which the driver installs: no pip
    package. Calling the object reads the counter; any failure raises NvmlError.

    The GPU is found by its PCI bus id, as PyTorch reports it: NVML numbers every GPU of the
    machine in PCI order, whereas CUDA's index counts only those of CUDA_VISIBLE_DEVICES, by
    default fastest first. Only where PyTorch gives no bus id is the CUDA index used as NVML's
    (then right only with every GPU visible in PCI order); `matched` says which it was."""

    def __init__(self, torch, device):
        if device != "cuda":
            raise NvmlError("no CUDA device (--device %s)" % device)
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise NvmlError("cannot load libnvidia-ml.so.1: %s" % e)
        lib.nvmlErrorString.restype = ctypes.c_char_p
        lib.nvmlErrorString.argtypes = [ctypes.c_int]
        lib.nvmlDeviceGetTotalEnergyConsumption.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong)]
        self.lib = lib
        self.check("nvmlInit_v2", lib.nvmlInit_v2())
        index = torch.cuda.current_device()
        prop = torch.cuda.get_device_properties(index)
        self.handle = ctypes.c_void_p()
        if all(hasattr(prop, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            bus = "%08X:%02X:%02X.0" % (prop.pci_domain_id, prop.pci_bus_id, prop.pci_device_id)
            self.check("nvmlDeviceGetHandleByPciBusId_v2", lib.nvmlDeviceGetHandleByPciBusId_v2(
                bus.encode(), ctypes.byref(self.handle)))
            self.matched = "PCI bus id " + bus
        else:
            self.check("nvmlDeviceGetHandleByIndex_v2", lib.nvmlDeviceGetHandleByIndex_v2(
                ctypes.c_uint(index), ctypes.byref(self.handle)))
            self.matched = "index %d (no PCI bus id from PyTorch)" % index
        self()  # Not Supported (pre-Volta, counter off) shows here, not amid the sweep

    def check(self, what, status):
        if status != 0:
            text = (self.lib.nvmlErrorString(status) or b"").decode("utf-8", "replace")
            raise NvmlError("%s: %s (NVML status %d)" % (what, text, status))

    def __call__(self):
        mj = ctypes.c_ulonglong()
        self.check("nvmlDeviceGetTotalEnergyConsumption",
                   self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)))
        return mj.value


class EnergyMeter:
    """--energy: a reader of a total-energy counter in mJ (NvmlEnergy(torch, device); tests
    put a fake in its place) that never stops the sweep. A reader that cannot be opened, or
    that fails later, is reported once on stderr and reads None from then on: the cells then
    get energy_mj_per_call = null and their timing as without --energy."""

    def __init__(self, torch, device):
        self.reader, self.error = None, ""
        try:
            self.reader = NvmlEnergy(torch, device)
        except Exception as e:
            self.fail(e)

    def fail(self, e):
        self.reader, self.error = None, describe_error(e)
        sys.stderr.write("compare.py: warning: --energy: no energy counter (%s); the rows get "
                         "energy_mj_per_call: null\n" % self.error)

    def describe(self):
        if self.reader is None:
            return "none"
        return "NVML's total energy consumption of the GPU, found by %s" % getattr(
            self.reader, "matched", "?")

    def read(self):
        """The counter in mJ, or None."""
        if self.reader is None:
            return None
        try:
            return float(self.reader())
        except Exception as e:
            self.fail(e)
            return None


WARMUP_BATCH_MS = 5.0  # fa::kWarmupBatchMs
WARMUP_MAX_BATCH = 4096  # fa::kWarmupMaxBatch


def warmup_batch(call_ms):
    """How many calls of `call_ms` ms each make a warm-up batch of about WARMUP_BATCH_MS (at
    least 1, at most WARMUP_MAX_BATCH; call_ms <= 0: the most), as fa::warmup_batch."""
    if not call_ms > 0:
        return WARMUP_MAX_BATCH
    return int(min(max(math.ceil(WARMUP_BATCH_MS / call_ms), 1), WARMUP_MAX_BATCH))


def warm_up(fn, sync, warmup, warmup_ms):
    """time_calls()'s warm-up (fa::time_step's): at least `warmup` calls of fn and more until
    `warmup_ms` ms have passed, queued back to back in batches of about WARMUP_BATCH_MS and
    sync() after each batch, so that the host clock measures GPU time. Returns the calls made."""
    t0 = time.perf_counter()
    done, batch = 0, max(1, warmup)
    while done < warmup or 1e3 * (time.perf_counter() - t0) < warmup_ms:
        b0 = time.perf_counter()
        for _ in range(batch):
            fn()
        sync()
        done += batch
        batch = warmup_batch(1e3 * (time.perf_counter() - b0) / batch)
    return done


def time_calls(torch, fn, warmup, repeats, device="cuda", warmup_ms=0.0, meter=None,
               energy_ms=0.0):
    """Harness timing (fa::time_step): warm-up, at least `warmup` calls and more for at least
    `warmup_ms` ms (the GPU in the power and clock state of a sustained load, whatever ran
    before), queued back to back in batches of about WARMUP_BATCH_MS, each synchronized
    (warmup_batch()); then CUDA events around each of `repeats` calls; median, min, max in
    ms. Calls are queued back to back (one synchronize at the end).

    With an EnergyMeter (--energy) the energy counter is also read just before the timed calls
    are queued and, once at least `energy_ms` have passed (see energy_of), after the last
    synchronize: the timing gains energy_mj_per_call, power_w and energy_calls."""
    if device != "cuda":  # CPU smoke tests: no clocks to settle
        warmup_ms = 0.0
    warm_up(fn, lambda: synchronize(torch, device), warmup, warmup_ms)
    if meter is not None:
        synchronize(torch, device)  # the warm-up's last calls stay out of the energy interval
        e0, t0 = meter.read(), time.perf_counter()
    if device == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for i in range(repeats):
            starts[i].record()
            fn()
            stops[i].record()
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in zip(starts, stops))
    else:  # CPU smoke tests only
        ms = []
        for _ in range(repeats):
            t1 = time.perf_counter()  # (t0 is the energy interval's start)
            fn()
            ms.append(1e3 * (time.perf_counter() - t1))
        ms.sort()
    timing = timing_of(ms)
    if meter is not None:
        timing.update(energy_of(torch, fn, device, meter, e0, t0, repeats, timing["median_ms"],
                                energy_ms))
    return timing


def energy_of(torch, fn, device, meter, e0, t0, calls, call_ms, energy_ms):
    """Closes the energy interval that time_calls opened (counter e0 mJ at perf_counter t0)
    before queuing `calls` calls of fn, which are done: energy per call (mJ), mean power (W)
    and the number of calls in the interval.

    NVML's counter moves only every 20-100 ms, so an interval as short as most cells' timed
    calls would read 0 or one whole update: until `energy_ms` have passed since t0, more calls
    are queued back to back after the timed ones (each batch sized by the median call_ms; the
    CUDA-event timing is already taken and stays as it was) and synchronized. The figures still
    carry up to about one update period of error at each end: energy_ms / 100 ms is the rough
    precision. Gaps between calls (a launch-bound cell) count too: energy per call is then more
    than power_w x median_ms."""
    nulls = {"energy_mj_per_call": None, "power_w": None, "energy_calls": 0}
    if e0 is None:
        return nulls
    while True:
        left = energy_ms - 1e3 * (time.perf_counter() - t0)
        if left <= 0:
            break
        n = int(math.ceil(left / max(call_ms, 1e-3)))
        for _ in range(n):
            fn()
        synchronize(torch, device)
        calls += n
    e1, t1 = meter.read(), time.perf_counter()
    if e1 is None:
        return nulls
    mj = e1 - e0
    return {"energy_mj_per_call": mj / calls,
            "power_w": mj / (1e3 * (t1 - t0)) if t1 > t0 else None,  # mJ / ms = W
            "energy_calls": calls}


def timing_of(ms):
    """Median, min, max and spread of timed runs (ms), and the sorted runs as "samples"."""
    ms = sorted(ms)
    mid = statistics.median(ms)
    return {"median_ms": mid, "min_ms": ms[0], "max_ms": ms[-1], "repeats": len(ms),
            "spread_pct": 100.0 * (ms[-1] - ms[0]) / mid if mid > 0 else 0.0,
            "samples": ms}


def pool_rounds(timings):
    """One timing from the runs of several rounds of the same cell (--rounds), as the bench's
    fa::pool_rounds: the median over every run, each round's own median in "round_ms".

    With --energy: energy per call and power are the medians over the rounds that have one
    (null if none has), each round's energy per call in "round_energy_mj", and energy_calls
    the calls of those rounds together."""
    pooled = timing_of([t for timing in timings for t in timing["samples"]])
    pooled["round_ms"] = [timing["median_ms"] for timing in timings]
    if "energy_mj_per_call" in timings[0]:
        known = [t for t in timings if t["energy_mj_per_call"] is not None]
        powers = [t["power_w"] for t in known if t["power_w"] is not None]
        pooled["energy_mj_per_call"] = (
            statistics.median([t["energy_mj_per_call"] for t in known]) if known else None)
        pooled["power_w"] = statistics.median(powers) if powers else None
        pooled["energy_calls"] = sum(t["energy_calls"] for t in known)
        pooled["round_energy_mj"] = [t["energy_mj_per_call"] for t in timings]
    return pooled


def error_stats(torch, out, ref):
    """max|out - ref| and ||out - ref|| / ||ref|| in float64 (inf if out has NaN/inf where ref
    is finite), plus max|ref| for the bound. Equal infinities (lse of empty rows) match."""
    out = out.double()
    ref = ref.double()
    same_inf = torch.isinf(ref) & (out == ref)
    out = torch.where(same_inf, torch.zeros_like(out), out)
    ref = torch.where(same_inf, torch.zeros_like(ref), ref)
    if not bool(torch.isfinite(out).all()) or not bool(torch.isfinite(ref).all()):
        return {"max_abs": float("inf"), "rel_l2": float("inf"), "ref_max": 0.0}
    err = (out - ref).abs()
    ref_norm = float(ref.norm())
    rel = float((out - ref).norm()) / ref_norm if ref_norm > 0 else (
        0.0 if float(err.max()) == 0 else float("inf"))
    return {"max_abs": float(err.max()), "rel_l2": rel, "ref_max": float(ref.abs().max())}


def within(stats, bound):
    c1, c2 = bound
    return (math.isfinite(stats["max_abs"]) and stats["max_abs"] <= c1 * max(stats["ref_max"], 1.0)
            and stats["rel_l2"] <= c2)


class Reference:
    """fp32 attention on upcast inputs for a few (batch, head) slices: O, lse, dQ, dK, dV.

    Rows that see no key (causal with Nq > Nk) get O = 0 and lse = +inf, like the steps.
    dK and dV are those of the one query head of the slice: right for H_kv = H (the sweep);
    under GQA a K/V head's gradient would also sum the other heads of its group."""

    def __init__(self, torch, q, k, v, d_o, causal, scale, slices, backward):
        self.slices = slices
        self.o, self.lse, self.dq, self.dk, self.dv = [], [], [], [], []
        Nq, Nk = q.shape[1], k.shape[1]
        group = q.shape[2] // k.shape[2]
        for b, h in slices:
            qh = q[b, :, h].float().requires_grad_(backward)
            kh = k[b, :, h // group].float().requires_grad_(backward)
            vh = v[b, :, h // group].float().requires_grad_(backward)
            with torch.set_grad_enabled(backward):
                s = (qh @ kh.t()) * scale
                if causal:
                    i = torch.arange(Nq, device=q.device)[:, None]
                    j = torch.arange(Nk, device=q.device)[None, :]
                    s = s.masked_fill(j > i + (Nk - Nq), float("-inf"))
                lse = torch.logsumexp(s, dim=-1)
                empty = torch.isinf(lse)
                p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse)[:, None])
                p = torch.where(empty[:, None], torch.zeros_like(p), p)
                o = p @ vh
            self.o.append(o.detach())
            self.lse.append(torch.where(empty, torch.full_like(lse, float("inf")), lse).detach())
            if backward:
                dq, dk, dv = torch.autograd.grad(o, (qh, kh, vh), d_o[b, :, h].float())
                self.dq.append(dq)
                self.dk.append(dk)
                self.dv.append(dv)
            del s, p

    def gather(self, t, group=1):
        """The same slices of a BSHD output, stacked (for K/V-shaped tensors: group > 1)."""
        return [t[b, :, h // group] for b, h in self.slices]


def stats_over(torch, outs, refs):
    """Error statistics over several slices at once."""
    return error_stats(torch, torch.cat([o.reshape(-1) for o in outs]),
                       torch.cat([r.reshape(-1) for r in refs]))


def sdpa_call(torch, backend, q, k, v, causal, scale):
    """SDPA forced to one backend on [B, H, N, d] views of BSHD tensors; returns BSHD.

    The mask is the steps' one, bottom-right aligned: is_causal for a square problem; none for
    a single query row (it sees every key); torch's causal_lower_right bias otherwise (SDPA's
    is_causal is top-left aligned when seqlen_q != seqlen_k). Fewer K/V heads than query heads
    (GQA, MQA) go through enable_gqa."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    nq, nk = q.shape[1], k.shape[1]
    extra = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
    if causal and nq != nk and nq > 1:
        from torch.nn.attention.bias import causal_lower_right

        extra["attn_mask"] = causal_lower_right(nq, nk)
        causal = False
    elif nq == 1:
        causal = False
    with sdpa_kernel(getattr(SDPBackend, backend)):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=bool(causal),
            scale=scale, **extra)
    return out.transpose(1, 2)


class Progress:
    """One progress line on stderr, rewritten in place on a terminal."""

    def __init__(self, total, log):
        self.total, self.done, self.log, self.t0 = total, 0, log, time.time()
        self.tty = sys.stderr.isatty()

    def show(self, text):
        self.done += 1
        line = "[%3d/%d %5.0fs] %s" % (self.done, self.total, time.time() - self.t0, text)
        sys.stderr.write(("\r\033[K" + line) if self.tty else line + "\n")
        sys.stderr.flush()
        self.log.append(line)

    def end(self):
        if self.tty:
            sys.stderr.write("\n")


def rotation_sets(kv, l2_bytes):
    """How many copies of a decode shape's tensors its calls rotate among: enough that together
    they take 4x the L2 cache (at most 64), so that no timed call finds its K and V in the cache
    where the previous repeat left them; 1 when K and V alone are that large or the cache size
    is unknown (0)."""
    if l2_bytes <= 0 or kv >= 4 * l2_bytes:
        return 1
    return int(min(64, math.ceil(4.0 * l2_bytes / kv)))


def draw_input(torch, gen, size, dtype, device, inputs="uniform", offset=0.0,
               chunk=1 << 28):
    """One random input tensor as the harness draws it (fa::inputs::value, fa/inputs.h):
    uniform in (-1, 1) plus `offset`, computed in fp32 and rounded to `dtype` once, so that
    every mantissa bit is as random as in the bench's inputs; or N(0, 1) (--inputs normal).
    Drawn `chunk` elements at a time, so that the fp32 draft of a decode shape's K or V (up to
    tens of GiB) never sits whole beside the tensor.

    Drawn in fp16 arithmetic instead (rand in fp16, * 2 - 1, + 0.5, as compare.py did before),
    8-12% of the values have their last mantissa bit set (the harness's: 50%), and a value has
    2.3-2.6 trailing zero mantissa bits on average (the harness's: 1.0): fewer bits toggle in
    the multipliers. On the H200, at its power cap, 09 and 10 timed 1.0-1.7% faster on such
    inputs than on the same draw rounded once (docs/measuring.md, "Rounds")."""
    if inputs != "uniform":
        return torch.randn(size, generator=gen, device=device, dtype=dtype)
    out = torch.empty(size, device=device, dtype=dtype)
    flat = out.view(-1)
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        u = torch.rand(n, generator=gen, device=device, dtype=torch.float32)
        flat[start:start + n] = u.mul_(2).sub_(1).add_(offset)  # exact in fp32; one rounding
    return out


def in_turn(fns):
    """One function that calls fns[0], fns[1], ... in turn, round and round."""
    if len(fns) == 1:
        return fns[0]
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def describe_error(e):
    text = str(e).strip().splitlines()
    return (type(e).__name__ + ": " + (text[0] if text else "")).strip()


def measure_shape(torch, fs, args, shape, steps, progress):
    """All rows of one shape: backends first (FLASH's outputs are the agreement baseline),
    then the steps."""
    dev = args.device
    d, causal, N = shape["head_dim"], shape["causal"], shape["seqlen_q"]
    Nk = shape["seqlen_k"]  # = N in the paper's sweep; the decode sweep has few rows, long keys
    B, H, Hkv = shape["batch"], shape["heads"], shape["heads_kv"]
    group = H // Hkv
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator(device=dev)
    gen.manual_seed(shape["seed"])
    def draw(*size, offset=0.0):
        return draw_input(torch, gen, size, dtype, dev, args.inputs, offset)

    q = draw(B, N, H, d)
    k = draw(B, Nk, Hkv, d)
    v = draw(B, Nk, Hkv, d, offset=V_OFFSET)
    d_o = draw(B, N, H, d, offset=V_OFFSET)
    want_fwd, want_bwd = "fwd" in args.directions, "bwd" in args.directions
    # Decode shapes that fit in the L2 cache: the timed forward calls rotate among copies.
    copies = []
    if args.decode and args.rotate and want_fwd:
        copies = [tuple(t.clone() for t in (q, k, v))
                  for _ in range(rotation_sets(kv_bytes(B, Hkv, Nk, d), args.l2_bytes) - 1)]
    sets = [(q, k, v)] + copies
    ref = None
    if not args.no_check:
        slices = sorted({(0, 0), (B - 1, H - 1)})
        ref = Reference(torch, q, k, v, d_o, causal, scale, slices, want_bwd)
    rows = []
    flash = {}  # FLASH's outputs: 'o', 'dq', 'dk', 'dv'

    def row(impl, kind, direction):
        r = dict(shape)
        r.update(impl=impl, kind=kind, direction=direction, checked=False, passed=False,
                 error="", flops=flops(direction, B, H, N, Nk, d, causal))
        if direction == "fwd":
            r["kv_bytes"] = kv_bytes(B, Hkv, Nk, d)
        return r

    heated = []  # the first measurement of the shape warms up for --heat-ms
    cells = []  # (row, function, [timing of each round]): the later rounds time them again

    def measure(fn, warmup_ms):  # one round of one cell; with --energy its energy too
        return time_calls(torch, fn, args.warmup, args.repeats, dev, warmup_ms, args.meter,
                          args.energy_ms)

    def timed(r, fn):
        warmup_ms = args.warmup_ms if heated else max(args.warmup_ms, args.heat_ms)
        heated.append(True)
        timing = measure(fn, warmup_ms)
        if args.rounds > 1:
            cells.append((r, fn, [timing]))
        return timing

    def rates(r, timing):
        r.update((key, val) for key, val in timing.items() if key != "samples")
        r["tflops"] = r["flops"] / (timing["median_ms"] * 1e-3) / 1e12
        if "kv_bytes" in r:
            r["gbps"] = r["kv_bytes"] / (timing["median_ms"] * 1e-3) / 1e9
            if args.copy_gbps:
                r["pct_copy"] = 100.0 * r["gbps"] / args.copy_gbps

    def finish(r, timing, checks, vs_flash):
        rates(r, timing)
        if checks:
            r["checked"] = True
            r["errors"] = checks
            r["passed"] = all(c["passed"] for c in checks.values())
            r["max_abs"] = max(c["max_abs"] for c in checks.values())
            r["rel_l2"] = max(c["rel_l2"] for c in checks.values())
        if vs_flash is not None:
            r["max_abs_vs_flash"] = vs_flash

    def check(outs, refs, quantity):
        st = stats_over(torch, outs, refs)
        st["passed"] = within(st, tolerance(args.dtype, quantity))
        return st

    def check_grads(dq, dk, dv):
        if ref is None:
            return None
        return {"dQ": check(ref.gather(dq), ref.dq, "gradient"),
                "dK": check(ref.gather(dk, group), ref.dk, "gradient"),
                "dV": check(ref.gather(dv, group), ref.dv, "gradient")}

    def versus_flash(pairs):
        if not all(key in flash for key, _ in pairs):
            return None
        return max(float((t.float() - flash[key].float()).abs().max()) for key, t in pairs)

    def report(r):
        rows.append(r)
        what = "%-15s %s d=%d %s N=%d" % (r["impl"], r["direction"], d,
                                          "causal" if causal else "full", N)
        if Nk != N or Hkv != H:
            what += " Nk=%d B=%d H=%d/%d" % (Nk, B, H, Hkv)
        if r["error"]:
            progress.show("%s  error: %s" % (what, r["error"]))
        else:
            progress.show("%s  %8.3f ms  %6.1f TFLOP/s  %s" % (
                what, r["median_ms"], r["tflops"],
                ("ok" if r["passed"] else "FAIL") if r["checked"] else "not checked"))

    # --- PyTorch backends ----------------------------------------------------------------
    for impl in args.backends:
        backend = dict(BACKENDS)[impl]
        if want_fwd:
            r = row(impl, "pytorch", "fwd")
            try:
                o = sdpa_call(torch, backend, q, k, v, causal, scale)
                synchronize(torch, dev)
                checks = {"O": check(ref.gather(o), ref.o, "output")} if ref else None
                vs = versus_flash([("o", o)])
                if impl == FLASH:
                    flash["o"] = o
                # Every name a timed function uses is bound now (default arguments): the later
                # rounds call it after the loop has moved on to other backends.
                calls = in_turn([(lambda s=s, b=backend: sdpa_call(torch, b, *s, causal, scale))
                                 for s in sets])
                finish(r, timed(r, calls), checks, vs)
                if len(sets) > 1:
                    r["rotated_sets"] = len(sets)
                del o
            except Exception as e:  # a backend that does not take this shape, OOM, ...
                r["error"] = describe_error(e)
            report(r)
        if want_bwd:
            r = row(impl, "pytorch", "bwd")
            try:
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                out = sdpa_call(torch, backend, *leaves, causal, scale)

                def grad(out=out, leaves=leaves):
                    return torch.autograd.grad(out, leaves, d_o, retain_graph=True)

                dq, dk, dv = grad()
                synchronize(torch, dev)
                checks = check_grads(dq, dk, dv)
                vs = versus_flash([("dq", dq), ("dk", dk), ("dv", dv)])
                if impl == FLASH:
                    flash.update(dq=dq, dk=dk, dv=dv)
                finish(r, timed(r, grad), checks, vs)
                del out, leaves, dq, dk, dv, grad
            except Exception as e:
                r["error"] = describe_error(e)
            report(r)
        empty_cache(torch, dev)

    # --- the steps -------------------------------------------------------------------------
    for step in steps:
        step_bwd = want_bwd and fs.has_backward(step)
        if not (want_fwd or step_bwd):
            continue
        o = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails the check
        lse = torch.full((B, H, N), float("nan"), device=dev, dtype=torch.float32)  # N = Nq
        r = row(step, "step", "fwd")
        try:
            launch = fs.prepare_forward(step, q, k, v, o, lse, causal, scale)
            launch()
            synchronize(torch, dev)
            checks = None
            if ref is not None:
                checks = {"O": check(ref.gather(o), ref.o, "output"),
                          "lse": check([lse[b, h] for b, h in ref.slices], ref.lse, "lse")}
            if want_fwd:
                calls = in_turn([launch] + [fs.prepare_forward(step, *s, o, lse, causal, scale)
                                            for s in sets[1:]])
                finish(r, timed(r, calls), checks,
                       versus_flash([("o", o)]))
                if len(sets) > 1:
                    r["rotated_sets"] = len(sets)
                del calls
            del launch
        except Exception as e:
            r["error"] = describe_error(e)
        if want_fwd:
            report(r)
        if step_bwd:
            fwd_error = r["error"]
            r = row(step, "step", "bwd")
            try:
                if fwd_error:
                    raise RuntimeError("no O and lse: the forward failed (%s)" % fwd_error)
                dq = torch.full_like(q, float("nan"))
                dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
                launch = fs.prepare_backward(step, q, k, v, o, lse, d_o, dq, dk, dv, causal,
                                             scale, args.deterministic)
                launch()
                synchronize(torch, dev)
                checks = check_grads(dq, dk, dv)
                finish(r, timed(r, launch), checks,
                       versus_flash([("dq", dq), ("dk", dk), ("dv", dv)]))
                del dq, dk, dv, launch
            except Exception as e:
                r["error"] = describe_error(e)
            report(r)
        if not cells:  # the later rounds need the outputs; without them they go now
            del o, lse
            empty_cache(torch, dev)

    # --- the later rounds (--rounds): every timed cell again, reversed every other round ------
    # Under the power cap the clocks drift a little through a shape; a cell timed right after
    # its neighbour in one round is timed before it in the next (README, "Burst or sustained").
    for rnd in range(1, args.rounds):
        for r, fn, timings in (reversed(cells) if rnd % 2 else cells):
            if r["error"]:
                continue
            try:
                timings.append(measure(fn, args.warmup_ms))
            except Exception as e:  # e.g. out of memory with every output of the shape alive
                r["error"] = describe_error(e)
                continue
            progress.show("%-15s %s d=%d %s N=%d  round %d  %8.3f ms" % (
                r["impl"], r["direction"], d, "causal" if causal else "full", N, rnd + 1,
                timings[-1]["median_ms"]))
    for r, fn, timings in cells:
        if not r["error"]:
            rates(r, pool_rounds(timings))
    del cells
    del flash, ref, q, k, v, d_o, sets, copies
    empty_cache(torch, dev)
    return rows


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def clean(x):
    """JSON has no NaN or inf: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def write_json(path, doc):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(clean(doc), f, indent=1, sort_keys=False, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def energy_cell(r):
    """The mJ/call column of --energy: 9 characters, '-' where the row has no figure."""
    mj = r.get("energy_mj_per_call")
    return " %9.2f" % mj if mj is not None else " %9s" % "-"


def table(rows, energy=False):
    """The rows as a text table, one shape after another, with the speed ratio to FLASH (and,
    with --energy, the energy per call)."""
    lines = ["%-15s %-3s %4s %-6s %6s %4s %3s %9s %7s %8s %8s%s %9s  %s" % (
        "impl", "dir", "d", "mask", "N", "B", "H", "ms", "spread", "TFLOP/s", "vs FLASH",
        " %9s" % "mJ/call" if energy else "", "max|err|", "check")]
    flash = {}
    for r in rows:
        if r["impl"] == FLASH and not r.get("error"):
            flash[key_of(r)] = r["median_ms"]
    for r in rows:
        head = "%-15s %-3s %4d %-6s %6d %4d %3d" % (
            r["impl"], r["direction"], r["head_dim"], "causal" if r["causal"] else "none",
            r["seqlen_q"], r["batch"], r["heads"])
        if r.get("error"):
            lines.append(head + "  error: " + r["error"])
            continue
        f = flash.get(key_of(r))
        lines.append(head + " %9.3f %6.1f%% %8.1f %8s%s %9s  %s" % (
            r["median_ms"], r["spread_pct"], r["tflops"],
            "%.2fx" % (f / r["median_ms"]) if f else "-", energy_cell(r) if energy else "",
            "%.1e" % r["max_abs"] if r.get("checked") and r.get("max_abs") is not None else "-",
            ("ok" if r["passed"] else "FAIL") if r.get("checked") else "not checked"))
    return "\n".join(lines)


def decode_table(rows, copy_gbps, energy=False):
    """The decode sweep's rows as a text table: time, TFLOP/s, GB/s of K and V and its share of
    the copy ceiling, the speed ratio to FLASH (and, with --energy, the energy per call)."""
    lines = ["copy ceiling: %.0f GB/s (device-to-device, bytes read + written / time)" % copy_gbps,
             "%-15s %3s %2s %-6s %3s %7s %6s %4s %9s %7s %8s %7s %6s %8s%s  %s" % (
                 "impl", "dir", "Nq", "mask", "B", "Nk", "H/kv", "d", "ms", "spread", "TFLOP/s",
                 "GB/s", "%copy", "vs FLASH", " %9s" % "mJ/call" if energy else "", "check")]
    flash = {key_of(r): r["median_ms"] for r in rows if r["impl"] == FLASH and not r.get("error")}
    for r in rows:
        head = "%-15s %3s %2d %-6s %3d %7d %6s %4d" % (
            r["impl"], r["direction"], r["seqlen_q"], "causal" if r["causal"] else "none",
            r["batch"], r["seqlen_k"], "%d/%d" % (r["heads"], r["heads_kv"]), r["head_dim"])
        if r.get("error"):
            lines.append(head + "  error: " + r["error"])
            continue
        f = flash.get(key_of(r))
        lines.append(head + " %9.4f %6.1f%% %8.2f %7.0f %6s %8s%s  %s" % (
            r["median_ms"], r["spread_pct"], r["tflops"], r.get("gbps", 0),
            "%.1f" % r["pct_copy"] if "pct_copy" in r else "-",
            "%.2fx" % (f / r["median_ms"]) if f else "-", energy_cell(r) if energy else "",
            ("ok" if r["passed"] else "FAIL") if r.get("checked") else "not checked"))
    return "\n".join(lines)


def measure_copy_gbps(torch, device="cuda", mib=1024, warmup=3, repeats=15):
    """The copy ceiling: torch's device-to-device copy_ between two buffers of `mib` MiB,
    (bytes read + written) over the median of `repeats` event-timed copies, in GB/s."""
    n = mib * 2 ** 20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = time_calls(torch, lambda: dst.copy_(src), warmup, repeats, device)
    del src, dst
    return 2.0 * n / (t["median_ms"] * 1e-3) / 1e9


def key_of(r):
    return (r["direction"], r["dtype"], r["batch"], r["heads"], r["heads_kv"], r["seqlen_q"],
            r["seqlen_k"], r["head_dim"], r["causal"])


def merge(paths, out):
    """Joins partial runs (same GPU) into one JSON: later files win for the same row."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    names = {d["gpu"]["name"] for d in docs}
    if len(names) > 1:
        sys.exit("compare.py: refusing to merge runs from different GPUs: %s" % sorted(names))
    merged = dict(docs[0])
    rows = {}
    for d in docs:
        for r in d["results"]:
            rows[(r["impl"],) + key_of(r)] = r
    merged["results"] = list(rows.values())
    merged["runs"] = [d["run"] for d in docs]
    merged["run"] = dict(docs[-1]["run"])
    merged["complete"] = all(d.get("complete") for d in docs)
    merged["merged_from"] = [os.path.basename(p) for p in paths]
    write_json(out, merged)
    print("compare.py: %d rows from %d files -> %s" % (len(rows), len(paths), out))
    return 0


def cpu_info(torch, fs):
    """Stand-in for gpu_info in CPU smoke tests (--device cpu)."""
    return {"name": "CPU smoke test", "sm_count": 0, "compute_capability": "", "driver": "",
            "cuda_runtime_torch": "", "cuda_toolkit_libfa": "", "torch": torch.__version__,
            "cudnn": "", "libfa": ""}


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    try:
        import torch
    except ImportError:
        sys.exit("compare.py: PyTorch is required (pip install torch)")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("compare.py: no CUDA GPU visible to PyTorch")
    import flash_steps as fs

    try:
        available = fs.steps()
    except fs.LibraryNotFound as e:
        sys.exit("compare.py: %s" % e)
    steps = available if not args.steps else [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in available]
    if unknown:
        sys.exit("compare.py: unknown step(s) %s (landed: %s)" % (", ".join(unknown),
                                                                  ", ".join(available)))
    if args.device == "cuda":  # a step built for another GPU (09, 10: sm_90a) is left out
        runnable = []
        for st in steps:
            try:
                fs.check_device(st)
                runnable.append(st)
            except fs.Unsupported as e:
                sys.stderr.write("compare.py: skipping %s: %s\n" % (st, e.message))
        steps = runnable
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    torch.backends.cudnn.allow_tf32 = False
    if args.seed == 0:
        args.seed = int(time.time() * 1000) % 1000000007
    gpu = gpu_info(torch, fs) if args.device == "cuda" else cpu_info(torch, fs)
    out = args.out or os.path.join(REPO, "docs", "results", gpu_slug(gpu["name"]) +
                                   ("-decode.json" if args.decode else ".json"))
    copy = None
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        copy = os.path.join(args.log_dir, os.path.basename(out))
        if os.path.abspath(copy) == os.path.abspath(out):
            copy = None
    shapes = decode_shapes(args) if args.decode else []
    for d in [] if args.decode else args.head_dims:
        for causal in args.causal:
            for N in args.seqlens:
                heads = max(1, args.hidden // d)
                shapes.append({"dtype": args.dtype, "batch": max(1, args.tokens // N),
                               "heads": heads, "heads_kv": heads, "seqlen_q": N, "seqlen_k": N,
                               "head_dim": d, "causal": bool(causal),
                               "seed": args.seed + len(shapes)})
    if not shapes:  # only a decode sweep can leave none
        sys.stderr.write("compare.py: no decode shape to run: a --heads-kv value must divide "
                         "--heads (%d), and a shape's K and V must fit in --max-kv-gib\n"
                         % args.heads)
        return 2
    per_shape = len(args.backends) * len(args.directions)
    for st in steps:
        per_shape += ("fwd" in args.directions) + ("bwd" in args.directions
                                                   and fs.has_backward(st))
    log = []
    progress = Progress(per_shape * len(shapes) * args.rounds, log)
    doc = {"gpu": gpu, "run": run_info(),
           "settings": {"dtype": args.dtype, "tokens": args.tokens, "hidden": args.hidden,
                        "seqlens": args.seqlens, "head_dims": args.head_dims,
                        "causal": [bool(c) for c in args.causal],
                        "directions": args.directions, "warmup": args.warmup,
                        "warmup_ms": args.warmup_ms, "heat_ms": args.heat_ms,
                        "repeats": args.repeats, "rounds": args.rounds, "seed": args.seed,
                        "checked": not args.no_check, "deterministic": args.deterministic,
                        "steps": steps, "backends": args.backends,
                        "inputs": "q, k, v, dO ~ %s in BSHD; SDPA gets [B, H, N, d] views"
                                  % ("N(0, 1)" if args.inputs == "normal" else
                                     "U(-1, 1), v and dO + %g, rounded once from fp32" % V_OFFSET),
                        "reference": "fp32 torch on upcast inputs, slices (b, h) = (0, 0) and "
                                     "(B-1, H-1); bounds of fa::tolerance()",
                        "timing": "CUDA events around each call, calls queued back to back, "
                                  "median of the repeats after the warm-up (queued in batches "
                                  "of ~%g ms), pooled over the rounds (every other round in "
                                  "reverse order)" % WARMUP_BATCH_MS},
           "complete": False, "results": []}
    if args.energy:  # only then: without --energy the JSON is what it was before the flag
        args.meter = EnergyMeter(torch, args.device)
        doc["settings"]["energy"] = {
            "energy_ms": args.energy_ms,
            "counter": args.meter.describe(),
            "method": "counter read before a cell's timed calls are queued and after the last "
                      "synchronize, calls run after the timed ones until energy_ms have passed; "
                      "energy_mj_per_call = energy / energy_calls, power_w = energy / wall "
                      "time; pooled over the rounds as the medians (round_energy_mj)"}
    if args.decode:
        if args.device == "cuda" and args.rotate:
            prop = torch.cuda.get_device_properties(torch.cuda.current_device())
            args.l2_bytes = int(getattr(prop, "L2_cache_size", 0) or 0)
        args.copy_gbps = measure_copy_gbps(torch, args.device,
                                           1024 if args.device == "cuda" else 16)
        doc["ceilings"] = {"copy_gbps": args.copy_gbps,
                           "copy": "torch copy_ of 1 GiB device to device, (bytes read + "
                                   "written) / median time of 15 after 3 warm-ups"}
        doc["settings"].update(decode=True, seqlens_q=args.seqlens_q, seqlens_k=args.seqlens_k,
                               batches=args.batches, heads=args.heads, heads_kv=args.heads_kv,
                               max_kv_gib=args.max_kv_gib,
                               bandwidth="gbps: K and V bytes (each read once) / median time",
                               rotate=("copies of q, k, v called in turn, together >= 4x the "
                                       "L2 cache of %d bytes (rows: rotated_sets)"
                                       % args.l2_bytes) if args.l2_bytes else "none")
        sys.stderr.write("compare.py: copy ceiling %.0f GB/s\n" % args.copy_gbps)

    def save():
        if args.meter is not None and args.meter.error:  # why the rows have null
            doc["settings"]["energy"]["error"] = args.meter.error
        write_json(out, doc)
        if copy:
            write_json(copy, doc)
            with open(os.path.join(args.log_dir, "compare.log"), "w") as f:
                f.write("\n".join(log) + "\n")

    sys.stderr.write("compare.py: %s, %d shapes x %d measurements, seed %d -> %s\n" % (
        gpu["name"], len(shapes), per_shape, args.seed, out))
    for shape in shapes:
        try:
            doc["results"] += measure_shape(torch, fs, args, shape, steps, progress)
        except Exception as e:  # e.g. a kernel fault left the CUDA context unusable
            progress.end()
            doc["aborted"] = "at %s: %s" % (json.dumps(shape), describe_error(e))
            log.append("compare.py: aborted " + doc["aborted"])
            save()
            sys.stderr.write("compare.py: aborted %s; rows so far are in %s\n"
                             % (doc["aborted"], out))
            return 1
        save()
    progress.end()
    doc["complete"] = True
    text = (decode_table(doc["results"], args.copy_gbps, args.energy) if args.decode
            else table(doc["results"], args.energy))
    bad = [r for r in doc["results"] if r["kind"] == "step" and
           (r["error"] or (r["checked"] and not r["passed"]))]
    summary = "compare.py: %d rows, %d step rows failed or errored -> %s" % (
        len(doc["results"]), len(bad), out)
    log += ["", text, summary]
    save()
    print(text)
    print(summary)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
