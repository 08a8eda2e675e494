"""The fp64 reference of flash_steps.attention's tests, and their pass rule (needs torch).

``reference`` is attention written out in fp64 with autograd: BSHD tensors, GQA by repeating
K/V heads (so dK and dV sum over the group), causal masking bottom-right aligned, and rows that
see no key giving O = 0 and no gradient, as the steps define them (docs/conformance.md).

``check`` applies two bounds to an output against the reference:

1. the harness's (fa::tolerance, through compare.tolerance): max|out - ref| <= c1 max(|ref|, 1)
   and ||out - ref|| / ||ref|| <= c2, with eps = 2^-10 (fp16) or 2^-7 (bf16);
2. the rounding floor: ||out - ref|| / ||ref|| <= ROUNDING_FACTOR x ||round(ref) - ref|| / ||ref||,
   where round(ref) is the exact answer rounded to the output dtype, the least error any kernel
   that writes that dtype can have. The kernels keep S, the softmax statistics and every
   accumulator in fp32 and round only P and dS to 16 bits, so they land close to that floor:
   a CPU model of exactly those roundings gives 1.3x to 1.5x on these tests' shapes, while a
   result 1% off gives 6x (bf16) and 48x (fp16). Bound 1 alone is loose for bf16 (4 eps = 3%
   for gradients: it would pass a 1% error).

and then checks that the check has teeth: the same output scaled by 1.01 must fail it.
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import compare  # noqa: E402  (tolerance, error_stats, within: the harness's bounds, one copy)
import flash_steps as fs  # noqa: E402

#: Bound 2: at most this many times the error of rounding the exact answer to the dtype.
ROUNDING_FACTOR = 3.0
#: A deliberately wrong answer (this factor times the output) must fail the check.
BROKEN_SCALE = 1.01

SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def reference(q, k, v, d_o=None, causal=False, scale=None):
    """fp64 attention of BSHD tensors q [B, Nq, H, d], k, v [B, Nk, Hkv, d] (any device).
    Returns (o, lse) and, when d_o is given, (o, lse, dq, dk, dv), all fp64."""
    with torch.enable_grad():  # also when called from a backward pass
        return _reference(q, k, v, d_o, causal, scale)


def _reference(q, k, v, d_o, causal, scale):
    B, Nq, H, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q64, k64, v64 = (t.detach().double().requires_grad_(d_o is not None) for t in (q, k, v))
    kk = k64.repeat_interleave(H // Hkv, dim=2)
    vv = v64.repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, kk) * scale
    if causal:
        i = torch.arange(Nq, device=q.device)[:, None]
        j = torch.arange(Nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + Nk - Nq, float("-inf"))
    empty = torch.isinf(s.amax(-1, keepdim=True))  # rows that see no key
    s = s.masked_fill(empty, 0.0)
    p = torch.softmax(s, -1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(empty.squeeze(-1), float("inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    if d_o is None:
        return o.detach(), lse.detach()
    o.backward(d_o.double())
    return o.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def rel_l2(out, ref):
    ref = ref.double()
    norm = float(ref.norm())
    err = float((out.double() - ref).norm())
    return err / norm if norm > 0 else (0.0 if err == 0 else math.inf)


def verdict(out, ref, dtype, quantity):
    """(passed, text) of both bounds for ``out`` against the fp64 ``ref``."""
    stats = compare.error_stats(torch, out, ref)
    c1, c2 = compare.tolerance(SHORT[dtype], quantity)
    floor = rel_l2(ref.to(dtype), ref)
    limit = min(c2, ROUNDING_FACTOR * floor)
    ok = compare.within(stats, (c1, c2)) and stats["rel_l2"] <= limit
    text = ("max|out-ref| %.2e (bound %.2e), rel_l2 %.2e (bound %.2e = min(harness %.2e, "
            "%g x rounding floor %.2e))" % (stats["max_abs"], c1 * max(stats["ref_max"], 1.0),
                                          stats["rel_l2"], limit, c2, ROUNDING_FACTOR, floor))
    return ok, text


def check(name, out, ref, dtype, quantity):
    """Asserts that ``out`` passes and that ``BROKEN_SCALE * out`` would not."""
    out = out.detach()
    ok, text = verdict(out, ref, dtype, quantity)
    assert ok, "%s: %s" % (name, text)
    broken_ok, broken_text = verdict(out.double() * BROKEN_SCALE, ref, dtype, quantity)
    assert not broken_ok, "%s: the check cannot tell a %gx output from a right one: %s" % (
        name, BROKEN_SCALE, broken_text)


# ---------------------------------------------------------------------------------------------
# Stand-in kernels for the CPU tests
# ---------------------------------------------------------------------------------------------

try:
    fs.load_library()
    HAVE_LIB = True  # then the stand-ins also run the C API's checks on what they are handed
    # A library built with some steps only (FA_ONLY_STEPS, a course pack) checks those; the
    # others are stood in for without checks, as without the library.
    REGISTERED = frozenset(fs.steps())
except fs.LibraryNotFound:
    if os.environ.get("FA_LIB"):
        raise  # ctest sets FA_LIB: a library that does not load is a failure
    HAVE_LIB = False
    REGISTERED = frozenset()


class AsCuda:
    """A CPU tensor as the C API's checks see it: its real address and strides, on 'cuda'."""

    def __init__(self, t):
        self.t, self.shape, self.dtype, self.device = t, t.shape, t.dtype, "cuda:0"

    def data_ptr(self):
        return self.t.data_ptr()

    def stride(self):
        return self.t.stride()


class StandIn:
    """forward_into / backward_into in fp64 on the CPU; records each call's tensors."""

    def __init__(self):
        self.calls = []

    def forward_into(self, step, q, k, v, o, lse, causal, scale):
        self.calls.append(("forward", step, dict(q=q, k=k, v=v, o=o, lse=lse)))
        if step in REGISTERED:
            fs.check_forward(step, *(AsCuda(t) for t in (q, k, v, o)),
                             AsCuda(lse) if lse is not None else None, causal, scale)
        out, l = reference(q, k, v, causal=causal, scale=scale)
        o.copy_(out)
        if lse is not None:
            lse.copy_(l)

    def backward_into(self, step, q, k, v, o, lse, d_o, dq, dk, dv, causal, scale,
                      deterministic):
        self.calls.append(("backward", step, dict(q=q, k=k, v=v, o=o, lse=lse, d_o=d_o)))
        if step in REGISTERED:
            fs.check_backward(step, *(AsCuda(t) for t in (q, k, v, o, lse, d_o, dq, dk, dv)),
                              causal, scale, deterministic)
        _, _, gq, gk, gv = reference(q, k, v, d_o, causal=causal, scale=scale)
        dq.copy_(gq)
        dk.copy_(gk)
        dv.copy_(gv)


def install_stand_in(monkeypatch):
    """Replaces the kernels of flash_steps.attention by a StandIn (and lets CPU tensors
    through) for one test; returns the StandIn."""
    from flash_steps import autograd

    s = StandIn()
    monkeypatch.setattr(autograd, "forward_into", s.forward_into)
    monkeypatch.setattr(autograd, "backward_into", s.backward_into)
    monkeypatch.setattr(autograd, "_check_device", lambda q, k, v: None)
    real_step_for = autograd.backward_step_for

    def backward_step_for(step, b=None):  # names the library lacks are not checked
        if step in REGISTERED and (b is None or b in REGISTERED):
            return real_step_for(step, b)
        return b or "07_backward"

    monkeypatch.setattr(autograd, "backward_step_for", backward_step_for)
    monkeypatch.setattr(fs, "backward_step_for", backward_step_for)  # train_gpt.py asks here
    return s
