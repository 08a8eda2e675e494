"""``flash_steps.attention``: any step as a differentiable PyTorch operation.

A ``torch.autograd.Function`` around the C API: the forward pass runs the chosen step (saving
O and the logsumexp L), the backward pass runs a step that has a backward (the forward step's
own, else ``07_backward``) on the saved tensors. It drops into a model where
``torch.nn.functional.scaled_dot_product_attention`` was::

    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)            # q: [B, H, N, d]
    y = flash_steps.attention(q, k, v, causal=True, layout="bhsd")         # same, our kernels

Both layouts reach the kernels without a copy: the C API takes explicit strides, so the
``[B, H, N, d]`` tensors of SDPA are handed over as their ``[B, N, H, d]`` transposed views.
A copy is made only when a tensor's strides are ones the kernels cannot take (last dimension
not contiguous, rows not 16-byte aligned, broadcast dimensions). The output and the gradients
come back in the caller's layout (as views of BSHD tensors, like SDPA's FLASH backend).

torch is imported only when ``attention`` is called, so ``import flash_steps`` needs no torch.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from ._lib import (
    InvalidArgument,
    Unsupported,
    backward_into,
    dtype_name,
    forward_into,
    has_backward,
    steps,
)

#: The forward step used when none is named: the last forward of the chain (FA2's forward).
DEFAULT_STEP = "06_causal_skip"
#: The backward used for a step without one of its own.
DEFAULT_BACKWARD_STEP = "07_backward"
#: Tensor layouts ``attention`` accepts: FlashAttention's and SDPA's.
LAYOUTS = {
    "bshd": "[batch, seqlen, heads, head_dim]",
    "bhsd": "[batch, heads, seqlen, head_dim] (torch.nn.functional.scaled_dot_product_attention)",
}


@functools.lru_cache(maxsize=None)
def _backward_step_for(step: str, backward_step: Optional[str]) -> str:
    if backward_step is not None:
        if not has_backward(backward_step):  # raises UnknownStep for a name not registered
            raise Unsupported("backward_step %s has no backward pass (steps with one: %s)"
                              % (backward_step, ", ".join(s for s in steps() if has_backward(s))))
        return backward_step
    if has_backward(step):
        return step
    with_backward = [s for s in steps() if has_backward(s)]
    if DEFAULT_BACKWARD_STEP in with_backward:
        return DEFAULT_BACKWARD_STEP
    if with_backward:
        return with_backward[-1]
    raise Unsupported("step %s has no backward pass and no registered step has one (build "
                      "%s to train through the steps)" % (step, DEFAULT_BACKWARD_STEP))


def backward_step_for(step: str, backward_step: Optional[str] = None) -> str:
    """The step whose backward pass differentiates ``step``'s forward: ``backward_step`` if
    given (it must have a backward), else ``step`` itself if it has one, else
    ``07_backward`` (or, in a build without it, the last registered step with a backward).
    Raises UnknownStep for a name that is not registered, Unsupported if no step fits."""
    has_backward(step)  # UnknownStep for an unknown forward step, before anything is cached
    return _backward_step_for(step, backward_step)


def _kernel_ready(x: Any) -> bool:
    """True if the 4-D BSHD tensor ``x`` can go to the C API as it is: last dimension
    contiguous, 16-byte aligned start, the other strides non-negative multiples of 8 elements
    (16-byte aligned rows) and rows and heads that do not overlap (the C API's own rules,
    common/src/api/api.cpp, checked here only to decide whether a copy is needed)."""
    d = x.shape[3]
    sb, sn, sh, sd = x.stride()
    if d > 1 and sd != 1:
        return False
    if x.data_ptr() % 16 != 0:
        return False
    if any(s < 0 or s % 8 != 0 for s in (sb, sn, sh)):
        return False
    return sn >= d and sh >= d


def _to_bshd(t: Any, layout: str) -> Any:
    """The BSHD view of a tensor given in ``layout`` (a view: no copy)."""
    return t if layout == "bshd" else t.transpose(1, 2)


def _from_bshd(t: Any, layout: str) -> Any:
    """A BSHD tensor seen in ``layout`` (a view: no copy)."""
    return t if layout == "bshd" else t.transpose(1, 2)


def _kernel_view(t: Any, layout: str) -> Any:
    """``t`` (in ``layout``) as a BSHD tensor the kernels accept: the transposed view when
    its strides are legal, else a contiguous BSHD copy."""
    x = _to_bshd(t, layout)
    if _kernel_ready(x):
        return x
    import torch

    return x.clone(memory_format=torch.contiguous_format)


def _check_inputs(torch: Any, q: Any, k: Any, v: Any, layout: str):
    """Checks what the C API cannot see in SDPA's terms (layouts, devices, dtypes) and
    returns q, k, v in one 16-bit dtype (fp32 inputs are cast under autocast)."""
    if layout not in LAYOUTS:
        raise InvalidArgument("layout must be one of %s (got %r)"
                              % (", ".join(repr(n) for n in LAYOUTS), layout))
    for what, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument("%s must be a torch.Tensor (got %s)" % (what, type(t).__name__))
        if t.dim() != 4:
            raise InvalidArgument("%s must be 4-D %s in layout %r, got shape %s"
                                  % (what, LAYOUTS[layout], layout, list(t.shape)))
    if k.shape != v.shape:
        raise InvalidArgument("k has shape %s but v has %s: they must be equal"
                              % (list(k.shape), list(v.shape)))
    qb, kb = _to_bshd(q, layout), _to_bshd(k, layout)
    if qb.shape[0] != kb.shape[0] or qb.shape[3] != kb.shape[3]:
        raise InvalidArgument(
            "q %s and k %s (layout %r, %s) must have the same batch and head_dim"
            % (list(q.shape), list(k.shape), layout, LAYOUTS[layout]))
    low = (torch.float16, torch.bfloat16)
    cast = _autocast_dtype(torch)
    if cast is not None:  # as SDPA under autocast: fp32 and 16-bit inputs in autocast's dtype
        q, k, v = (t.to(cast) if t.dtype in low + (torch.float32,) and t.dtype != cast else t
                   for t in (q, k, v))  # differentiable casts
    for what, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in low:
            raise Unsupported(
                "%s has dtype %s; the steps take float16 or bfloat16 (cast the inputs, or run "
                "under torch.autocast('cuda', dtype=torch.bfloat16))" % (what, dtype_name(t.dtype)))
    if not q.dtype == k.dtype == v.dtype:
        raise InvalidArgument("q, k and v must have one dtype (got %s, %s, %s)"
                              % tuple(dtype_name(t.dtype) for t in (q, k, v)))
    _check_device(q, k, v)
    return q, k, v


def _check_device(q: Any, k: Any, v: Any) -> None:
    """q, k, v on one CUDA device."""
    for what, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise InvalidArgument("%s is on %s; flash_steps.attention runs on CUDA tensors "
                                  "(move it with %s.cuda())" % (what, t.device, what))
    if not q.device == k.device == v.device:
        raise InvalidArgument("q, k and v must be on one GPU (got %s, %s, %s)"
                              % (q.device, k.device, v.device))


def _autocast_dtype(torch: Any):
    """The 16-bit dtype CUDA autocast casts to, or None outside autocast."""
    try:
        enabled = torch.is_autocast_enabled("cuda")
    except TypeError:  # PyTorch < 2.4
        enabled = torch.is_autocast_enabled()
    if not enabled:
        return None
    try:
        return torch.get_autocast_dtype("cuda")
    except AttributeError:  # PyTorch < 2.4
        return torch.get_autocast_gpu_dtype()


def _function():
    """The autograd.Function class (built on first use so that torch is imported lazily)."""
    global _FUNCTION
    if _FUNCTION is not None:
        return _FUNCTION
    import torch
    from torch.autograd.function import once_differentiable

    class AttentionFunction(torch.autograd.Function):
        """Forward through one step, backward through a step with a backward pass."""

        @staticmethod
        def forward(ctx, q, k, v, causal, scale, step, backward_step, layout, deterministic):
            qb, kb, vb = (_kernel_view(t, layout) for t in (q, k, v))
            B, Nq, H, d = qb.shape
            o = torch.empty((B, Nq, H, d), dtype=qb.dtype, device=qb.device)
            lse = torch.empty((B, H, Nq), dtype=torch.float32, device=qb.device)
            forward_into(step, qb, kb, vb, o, lse, causal, scale)
            out = _from_bshd(o, layout)
            # The inputs and the output themselves (so that autograd sees any in-place change
            # of them) and the logsumexp; the BSHD views are taken again in backward.
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.settings = (causal, scale, backward_step, layout, deterministic)
            return out

        @staticmethod
        @once_differentiable
        def backward(ctx, grad_out):
            q, k, v, out, lse = ctx.saved_tensors
            causal, scale, backward_step, layout, deterministic = ctx.settings
            qb, kb, vb = (_kernel_view(t, layout) for t in (q, k, v))
            ob = _to_bshd(out, layout)
            if grad_out.dtype != ob.dtype:
                grad_out = grad_out.to(ob.dtype)
            d_o = _kernel_view(grad_out, layout)  # e.g. the stride-0 gradient of out.sum()
            dq = torch.empty(qb.shape, dtype=qb.dtype, device=qb.device)
            dk = torch.empty(kb.shape, dtype=kb.dtype, device=kb.device)
            dv = torch.empty(vb.shape, dtype=vb.dtype, device=vb.device)
            backward_into(backward_step, qb, kb, vb, ob, lse, d_o, dq, dk, dv, causal, scale,
                          deterministic)
            grads = tuple(_from_bshd(g, layout) for g in (dq, dk, dv))
            return grads + (None,) * 6

    _FUNCTION = AttentionFunction
    return _FUNCTION


_FUNCTION = None


def attention(q: Any, k: Any, v: Any, causal: bool = False, scale: Optional[float] = None,
              step: str = DEFAULT_STEP, layout: str = "bshd",
              backward_step: Optional[str] = None, deterministic: bool = False):
    """Attention through the repository's steps, differentiable like any PyTorch operation.

    - ``q``: ``[B, N_q, H, d]`` (``layout="bshd"``, FlashAttention's) or ``[B, H, N_q, d]``
      (``layout="bhsd"``, the one of ``torch.nn.functional.scaled_dot_product_attention``);
      ``k``, ``v``: the same with ``N_k`` and ``H_kv`` heads, ``H_kv`` dividing ``H`` (GQA).
      fp16 or bf16 CUDA tensors (fp32 ones are cast under ``torch.autocast``), d 64 or 128
      (or what the step supports).
    - ``causal``: bottom-right aligned when ``N_q != N_k`` (FlashAttention-2's convention; for
      ``N_q == N_k`` it is SDPA's ``is_causal``). ``scale`` defaults to ``1 / sqrt(d)``.
    - ``step``: the forward (default ``06_causal_skip``); ``backward_step``: the backward
      (default: ``step``'s own if it has one, else ``07_backward``); ``deterministic``: a
      backward with the same bits every run.

    Returns the output in the layout of ``q``. Runs on PyTorch's current stream and on the
    tensors' device. Errors are the :class:`FlashStepsError` subclasses of the C API.
    """
    import torch

    q, k, v = _check_inputs(torch, q, k, v, layout)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        bstep = backward_step_for(step, backward_step)
        return _function().apply(q, k, v, bool(causal), scale, step, bstep, layout,
                                 bool(deterministic))
    # Inference: no logsumexp, nothing saved.
    qb, kb, vb = (_kernel_view(t, layout) for t in (q, k, v))
    o = torch.empty(qb.shape, dtype=qb.dtype, device=qb.device)
    forward_into(step, qb, kb, vb, o, None, bool(causal), scale)
    return _from_bshd(o, layout)
