#!/usr/bin/env python3
"""Train a small GPT with PyTorch's attention, then with the repository's steps, and compare.

Usage (on a machine with an sm_80+ GPU, PyTorch, and flash_steps: `pip install -e .`, or a
built libfa with this script run from the repository):

    python3 common/python/train_gpt.py                 # SDPA (FLASH), then 06 forward + 07 backward
    python3 common/python/train_gpt.py --runs sdpa:flash,06_causal_skip+07_backward,05_split_q
    python3 common/python/train_gpt.py --steps 200     # a shorter run
    python3 common/python/train_gpt.py --help

The model is a GPT-2 style decoder (pre-LayerNorm blocks, causal self-attention with heads of
64, a 4x GELU MLP, tied embeddings), byte-level, trained on the public-domain text shipped in
common/python/data/shakespeare.txt (the first 300 KB of "tiny Shakespeare"): 90% to train,
10% held out. Every run starts from the same seed, so it gets the same initial weights and
sees the same batches in the same order for the same number of steps, under the same autocast
dtype (bf16 by default); the runs differ only in the attention call:

- ``sdpa[:backend]``: ``torch.nn.functional.scaled_dot_product_attention`` on ``[B, H, N, d]``
  views, forced to one backend (``flash`` is FlashAttention-2) or PyTorch's choice (``sdpa``);
- ``<forward step>[+<backward step>]``: ``flash_steps.attention`` on the ``[B, N, H, d]``
  slices of the packed QKV projection (no copy), forward through the first step, backward
  through the second (default: the step's own backward, else 07_backward).

Each run prints a progress bar on stderr and reports tokens per second (training steps only,
after a few warm-up steps, evaluation excluded). At the end: a table, a JSON of the loss curves
(``--out-json``, default docs/results/<gpu>_train.json) and a PNG of the curves overlaid
(``--out-png``, default docs/results/<gpu>_train.png; needs matplotlib). The first run is the
reference: the exit status is 0 when every other run's final training loss (the mean over the
last 5% of the steps) is within ``--tolerance`` (default 2%) of it, 1 otherwise; the final
held-out loss and its difference are reported beside it.
"""

import argparse
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import compare  # noqa: E402  (gpu_slug, run_info, gpu_info, write_json: one copy of each)

DEFAULT_TEXT = os.path.join(HERE, "data", "shakespeare.txt")
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a small GPT with SDPA and with the steps' attention; compare the "
                    "loss curves and tokens/s.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", default="sdpa:flash,06_causal_skip+07_backward",
                   help="comma-separated runs, the first is the reference: sdpa, "
                        "sdpa:<flash|cudnn|efficient|math>, or <step>[+<backward step>]")
    p.add_argument("--text", default=DEFAULT_TEXT, help="training text (bytes are the tokens)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--context", type=int, default=256, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64, help="d_model / head_dim heads")
    p.add_argument("--dropout", type=float, default=0.2,
                   help="dropout on the residual branches (not in attention)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--min-lr", type=float, default=1e-4, help="learning rate at the end")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps, then cosine")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                   help="autocast dtype (fp16 adds a gradient scaler)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-every", type=int, default=200, help="held-out loss every N steps")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches per eval")
    p.add_argument("--warmup-steps-untimed", type=int, default=10,
                   help="first steps left out of tokens/s (kernel loading, allocator)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="largest relative difference of the final training loss (the mean "
                        "over the last 5%% of the steps) to the first run's")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (sdpa only)")
    p.add_argument("--out-json", help="default docs/results/<gpu>_train.json")
    p.add_argument("--out-png", help="default docs/results/<gpu>_train.png ('' to skip)")
    args = p.parse_args(argv)
    args.runs = [parse_run(r) for r in args.runs.split(",") if r.strip()]
    if not args.runs:
        p.error("--runs is empty")
    if args.d_model % args.head_dim:
        p.error("--d-model must be a multiple of --head-dim")
    for name in ("steps", "batch", "context", "layers", "eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            p.error("--%s must be >= 1" % name.replace("_", "-"))
    return args


def parse_run(text):
    """'sdpa', 'sdpa:flash' or '<step>[+<backward step>]' -> dict(kind, name, ...)."""
    text = text.strip()
    if text == "sdpa" or text.startswith("sdpa:"):
        backend = text.split(":", 1)[1] if ":" in text else None
        if backend is not None and backend not in SDPA_BACKENDS:
            raise SystemExit("train_gpt.py: unknown SDPA backend %r (choose from %s)"
                             % (backend, ", ".join(SDPA_BACKENDS)))
        return {"kind": "sdpa", "name": text, "backend": backend}
    fwd, _, bwd = text.partition("+")
    return {"kind": "steps", "name": text, "step": fwd, "backward_step": bwd or None}


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def build_model(torch, vocab, args, attention):
    """A GPT-2 style decoder whose self-attention calls ``attention(q, k, v)`` on
    ``[B, N, H, d]`` tensors (causal) and gets ``[B, N, H, d]`` back."""
    nn, F = torch.nn, torch.nn.functional
    heads = args.d_model // args.head_dim

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = args.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.fc = nn.Linear(d, 4 * d, bias=False)
            self.fc_out = nn.Linear(4 * d, d, bias=False)
            self.drop = nn.Dropout(args.dropout)

        def forward(self, x):
            B, N, C = x.shape
            qkv = self.qkv(self.ln1(x)).view(B, N, 3, heads, args.head_dim)
            q, k, v = qkv.unbind(2)  # [B, N, H, d] views of the packed projection
            y = attention(q, k, v).reshape(B, N, C)
            x = x + self.drop(self.proj(y))
            return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, args.d_model)
            self.pos = nn.Embedding(args.context, args.d_model)
            self.drop = nn.Dropout(args.dropout)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.ln = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, vocab, bias=False)
            self.head.weight = self.tok.weight  # tied embeddings
            for name, p in self.named_parameters():
                if p.dim() == 2:  # GPT-2 init; residual projections scaled by depth
                    std = 0.02 / math.sqrt(2 * args.layers) if name.endswith(
                        ("proj.weight", "fc_out.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx, targets):
            N = idx.shape[1]
            x = self.drop(self.tok(idx) + self.pos(torch.arange(N, device=idx.device)))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT()


def attention_for(torch, run):
    """The attention function of a run and the context its forward passes run in."""
    import contextlib

    if run["kind"] == "sdpa":
        F = torch.nn.functional

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True).transpose(1, 2)

        if run["backend"] is None:
            return sdpa, contextlib.nullcontext
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, SDPA_BACKENDS[run["backend"]])
        return sdpa, lambda: sdpa_kernel(backend)

    import flash_steps

    step, bstep = run["step"], run["backward_step"]
    flash_steps.backward_step_for(step, bstep)  # unknown names fail here, not mid-run

    def steps_attention(q, k, v):
        return flash_steps.attention(q, k, v, causal=True, step=step, backward_step=bstep)

    return steps_attention, contextlib.nullcontext


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


class ProgressBar:
    """A bar on stderr: rewritten in place on a terminal, a line every 10% otherwise."""

    def __init__(self, name, total):
        self.name, self.total, self.t0 = name, total, time.time()
        self.tty = sys.stderr.isatty()
        self.last_draw, self.last_decile = 0.0, -1

    def update(self, done, loss_fn, tok_s):
        now = time.time()
        decile = 10 * done // self.total
        if self.tty:
            if now - self.last_draw < 0.2 and done < self.total:
                return
        elif decile == self.last_decile:
            return
        self.last_draw, self.last_decile = now, decile
        width = 24
        fill = width * done // self.total
        eta = (now - self.t0) / max(done, 1) * (self.total - done)
        line = "[%s] |%s%s| %d/%d  loss %.3f  %s tok/s  %.0fs, eta %.0fs" % (
            self.name, "#" * fill, "-" * (width - fill), done, self.total, loss_fn(),
            human(tok_s) if tok_s else "-", now - self.t0, eta)
        sys.stderr.write(("\r\033[K" + line) if self.tty else line + "\n")
        if self.tty and done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def human(x):
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return "%.2f%s" % (x / scale, unit)
    return "%.0f" % x


def lr_at(step, args):
    """Linear warm-up to --lr, then cosine decay to --min-lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - 1 - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def load_tokens(torch, path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 1024:
        raise SystemExit("train_gpt.py: %s is too short (%d bytes)" % (path, len(data)))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def train_run(torch, run, args, data, progress=True):
    """One training run; returns its curves, final losses and tokens/s."""
    device = args.device
    attention, context = attention_for(torch, run)
    low = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    N, B = args.context, args.batch
    train, held_out, offsets, held_out_offsets = data
    span = torch.arange(N + 1, device=device)

    def batch(source, starts):
        chunk = source[starts[:, None] + span].long()
        return chunk[:, :-1], chunk[:, 1:]

    torch.manual_seed(args.seed)  # the same weights and dropout generator in every run
    model = build_model(torch, 256, args, attention).to(device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), **(
                                {"fused": True} if device.startswith("cuda") else {}))
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=args.dtype == "fp16")

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def evaluate():
        model.eval()
        with torch.no_grad(), context(), torch.autocast(device.split(":")[0], dtype=low):
            total = sum(float(model(*batch(held_out, s))) for s in held_out_offsets)
        model.train()
        return total / len(held_out_offsets)

    bar = ProgressBar(run["name"], args.steps) if progress else None
    losses, evals = [], []
    timed_s, timed_steps, seg_start = 0.0, 0, None
    untimed = min(args.warmup_steps_untimed, args.steps - 1)
    t_run = time.time()
    for step in range(args.steps):
        if step == untimed:
            sync()
            seg_start = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        x, y = batch(train, offsets[step])
        with context(), torch.autocast(device.split(":")[0], dtype=low):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
        if step >= untimed:
            timed_steps += 1
        last = step == args.steps - 1
        if (step + 1) % args.eval_every == 0 or last:
            if seg_start is not None:
                sync()
                timed_s += time.perf_counter() - seg_start
            evals.append((step + 1, evaluate()))
            sync()
            seg_start = time.perf_counter() if not last else None
        if bar:  # the rate so far (without a synchronize: approximate while running)
            running = timed_s + (time.perf_counter() - seg_start if seg_start else 0.0)
            tok_s = timed_steps * B * N / running if running > 0 else 0.0
            bar.update(step + 1, lambda: float(losses[-1]), tok_s)
    train_loss = [float(v) for v in torch.stack(losses).float().cpu()]
    tail = max(1, args.steps // 20)
    if not all(math.isfinite(v) for v in train_loss):
        raise SystemExit("train_gpt.py: run %s diverged (non-finite loss)" % run["name"])
    return {"name": run["name"], "kind": run["kind"],
            "attention": describe_run(run),
            "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_s": timed_steps * B * N / timed_s if timed_s > 0 else None,
            "timed_steps": timed_steps, "timed_s": round(timed_s, 3),
            "wall_s": round(time.time() - t_run, 3),
            "final_val_loss": evals[-1][1],
            "final_train_loss": sum(train_loss[-tail:]) / tail,
            "train_loss": [round(v, 5) for v in train_loss],
            "val": [[s, round(v, 5)] for s, v in evals]}


def describe_run(run):
    if run["kind"] == "sdpa":
        return ("torch.nn.functional.scaled_dot_product_attention, backend %s"
                % (SDPA_BACKENDS[run["backend"]] if run["backend"] else "chosen by PyTorch"))
    import flash_steps

    return "flash_steps.attention: forward %s, backward %s" % (
        run["step"], flash_steps.backward_step_for(run["step"], run["backward_step"]))


def make_data(torch, args):
    """Train/held-out split, the batch start offsets of every step (drawn once from the seed,
    the same for every run) and fixed, evenly spaced held-out batches."""
    tokens = load_tokens(torch, args.text)
    split = int(0.9 * len(tokens))
    train, held_out = tokens[:split], tokens[split:]
    N, B = args.context, args.batch
    if len(held_out) < N + 2 or len(train) < N + 2:
        raise SystemExit("train_gpt.py: the text is too short for --context %d" % N)
    g = torch.Generator().manual_seed(args.seed)
    offsets = torch.randint(0, len(train) - N - 1, (args.steps, B), generator=g)
    held = torch.linspace(0, len(held_out) - N - 2, args.eval_batches * B).long()
    dev = args.device
    return (train.to(dev), held_out.to(dev), offsets.to(dev),
            held.view(args.eval_batches, B).to(dev))


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def ema(values, alpha=0.05):
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def plot(doc, path):
    """Loss curves overlaid (train loss smoothed, held-out loss as points), and each run's
    smoothed train loss relative to the first run's."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train_gpt.py: matplotlib not installed, no plot written", file=sys.stderr)
        return False
    runs = doc["runs"]
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    ref = ema(runs[0]["train_loss"])
    for i, r in enumerate(runs):
        color = "C%d" % i
        tok = ("%s tok/s" % human(r["tokens_per_s"])) if r["tokens_per_s"] else ""
        steps = range(1, len(r["train_loss"]) + 1)
        smooth = ema(r["train_loss"])
        ax.plot(steps, smooth, color=color, lw=1.4, ls="-" if i == 0 else "--",
                label="%s, train (%s)" % (r["name"], tok))
        ax.plot([s for s, _ in r["val"]], [v for _, v in r["val"]], "o", color=color, ms=4,
                label="%s, held out: %.4f" % (r["name"], r["final_val_loss"]))
        if i:
            rel.plot(steps, [100 * (a - b) / b for a, b in zip(smooth, ref)], color=color,
                     label="%s vs %s" % (r["name"], runs[0]["name"]))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    cfg = doc["config"]
    ax.set_title("GPT %.1fM params, %d layers, d_model %d, context %d, batch %d, %s autocast"
                 % (doc["params"] / 1e6, cfg["layers"], cfg["d_model"], cfg["context"],
                    cfg["batch"], cfg["dtype"]), fontsize=9)
    tol = 100 * doc["tolerance"]
    rel.axhspan(-tol, tol, color="0.9", label="+-%g%%" % tol)
    rel.axhline(0, color="0.5", lw=0.8)
    rel.set_xlabel("optimizer step")
    rel.set_ylabel("smoothed train loss vs %s (%%)" % runs[0]["name"])
    rel.grid(alpha=0.3)
    rel.legend(fontsize=8)
    fig.suptitle("%s on %s, commit %s" % (os.path.basename(doc["text"]), doc["gpu"]["name"],
                                          doc["commit"][:12]), fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def table(doc):
    """The runs side by side; differences are relative to the first run."""
    runs = doc["runs"]
    lines = ["%-28s %10s %8s %11s %8s %9s %8s" % (
        "run", "tokens/s", "time", "train loss", "diff", "held out", "diff")]
    for i, r in enumerate(runs):
        lines.append("%-28s %10s %7.1fs %11.4f %8s %9.4f %8s" % (
            r["name"], human(r["tokens_per_s"]) if r["tokens_per_s"] else "-", r["wall_s"],
            r["final_train_loss"], "%+.2f%%" % (100 * r["rel_diff"]) if i else "",
            r["final_val_loss"], "%+.2f%%" % (100 * r["rel_diff_val"]) if i else ""))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("train_gpt.py: PyTorch is required", file=sys.stderr)
        return 1
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("train_gpt.py: no CUDA GPU visible (use --device cpu for a smoke test of the "
              "sdpa runs)", file=sys.stderr)
        return 1
    if not args.device.startswith("cuda"):
        gpu = {"name": "cpu", "torch": torch.__version__}
    elif any(r["kind"] == "steps" for r in args.runs):
        import flash_steps

        gpu = compare.gpu_info(torch, flash_steps)  # with the libfa it loaded
    else:
        gpu = {"name": torch.cuda.get_device_name(), "torch": torch.__version__}
    slug = compare.gpu_slug(gpu["name"])
    out_json = args.out_json or os.path.join(REPO, "docs", "results", slug + "_train.json")
    out_png = args.out_png if args.out_png is not None else os.path.join(
        REPO, "docs", "results", slug + "_train.png")

    data = make_data(torch, args)
    info = compare.run_info()
    config = {k: getattr(args, k) for k in (
        "steps", "batch", "context", "layers", "d_model", "head_dim", "dropout", "lr", "min_lr",
        "warmup", "dtype", "seed", "eval_every", "eval_batches", "warmup_steps_untimed")}
    results = []
    for run in args.runs:
        results.append(train_run(torch, run, args, data))
        r = results[-1]
        print("[%s] %s: %s tokens/s, final training loss %.4f, held out %.4f, %.1fs"
              % (r["name"], r["attention"], human(r["tokens_per_s"] or 0),
                 r["final_train_loss"], r["final_val_loss"], r["wall_s"]), flush=True)
        ref, ok = results[0], True
        for r in results:
            for key, loss in (("rel_diff", "final_train_loss"),
                              ("rel_diff_val", "final_val_loss")):
                r[key] = (r[loss] - ref[loss]) / ref[loss]
            r["within_tolerance"] = abs(r["rel_diff"]) <= args.tolerance
            ok = ok and r["within_tolerance"]
        doc = {"what": "train_gpt.py: the same GPT trained with each attention", "gpu": gpu,
               "commit": info["commit"], "dirty": info["dirty"], "date": info["date"],
               "command": info["command"],
               "text": os.path.relpath(os.path.abspath(args.text), REPO),
               "params": ref["params"], "config": config, "tolerance": args.tolerance,
               "complete": len(results) == len(args.runs), "passed": ok, "runs": results}
        compare.write_json(out_json, doc)  # after every run: an interrupted one keeps its runs
    print(table(doc))
    print("final training loss of every run within %g%% of %s's: %s"
          % (100 * args.tolerance, ref["name"], "yes" if ok else "NO"))
    print("wrote %s" % os.path.relpath(out_json))
    if out_png and plot(doc, out_png):
        print("wrote %s" % os.path.relpath(out_png))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
