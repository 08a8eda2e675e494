"""The fp64 reference of flash_steps.attention's tests, and their pass rule (needs torch).

``reference`` is attention written out in fp64 with autograd: BSHD tensors, GQA by repeating
K/V heads (so dK and dV sum over the group), causal masking bottom-right aligned, and rows that
see no key giving O = 0 and no gradient, as the steps define them (docs/conformance.md).

``check`` applies two bounds to an output against the reference:

1. the harness's (fa::tolerance, through compare.tolerance): max|out - ref| <= c1 max(|ref|, 1)
   and ||out - ref|| / ||ref|| <= c2, with eps = 2^-10 (fp16) or 2^-7 (bf16);
2. the rounding floor: ||out - ref|| / ||ref|| <= ROUNDING_FACTOR x ||round(ref) - ref|| / ||ref||,
   where round(ref) is the exact answer rounded to the output dtype, the least error any kernel
   that writes that dtype can have. The kernels keep S, P's row statistics and every
   accumulator in fp32, so they land close to that floor (an fp32 model of their roundings
   gives 1.1x); bound 1 alone is loose for bf16 (4 eps = 3% for gradients).

and then checks that the check has teeth: the same output scaled by 1.01 must fail it.
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import compare  # noqa: E402  (tolerance, error_stats, within: the harness's bounds, one copy)

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
    ok, text = verdict(out, ref, dtype, quantity)
    assert ok, "%s: %s" % (name, text)
    broken_ok, broken_text = verdict(out.double() * BROKEN_SCALE, ref, dtype, quantity)
    assert not broken_ok, "%s: the check cannot tell a %gx output from a right one: %s" % (
        name, BROKEN_SCALE, broken_text)
