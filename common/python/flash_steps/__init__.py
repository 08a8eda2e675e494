"""flash_steps: run any step of flash-attention-steps on PyTorch tensors.

Usage, after ``pip install -e .`` at the repository root (which builds libfa into the
package), or from the repository root after ``cmake --workflow --preset default``
(then ``import sys; sys.path.insert(0, "common/python")`` first)::

    import torch, flash_steps

    print(flash_steps.steps())                      # ['01_naive', ..., '07_backward']
    q = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.float16)   # [B, N, H, d]
    k, v = torch.randn_like(q), torch.randn_like(q)
    o, lse = flash_steps.forward("05_split_q", q, k, v, causal=True)
    dq, dk, dv = flash_steps.backward("07_backward", q, k, v, o, lse, torch.randn_like(o),
                                      causal=True)

    # Differentiable, a drop-in for scaled_dot_product_attention on [B, H, N, d] tensors
    # (06 forward, 07 backward by default; autograd.py):
    y = flash_steps.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal=True, layout="bhsd")

Tensors are BSHD (``[batch, seqlen, heads, head_dim]``, the layout of FlashAttention, not
the ``[batch, heads, seqlen, head_dim]`` of ``torch.nn.functional.scaled_dot_product_attention``),
fp16 or bf16, with a contiguous last dimension. Every error of the C API is raised as a
subclass of :class:`FlashStepsError` carrying the C library's message. libfa is found through
``$FA_LIB``, in the package (pip install), or under ``build*/lib`` of the repository. See
docs/python.md.
"""

from ._lib import (
    ERROR_CLASSES,
    FA_BF16,
    FA_FP16,
    BwdArgs,
    CudaError,
    FaTensor,
    FlashStepsError,
    FwdArgs,
    InvalidArgument,
    LibraryNotFound,
    NoDevice,
    OutOfMemory,
    UnknownStep,
    Unsupported,
    as_fa_tensor,
    backward,
    backward_args,
    backward_into,
    check_backward,
    check_device,
    check_forward,
    forward,
    forward_args,
    forward_into,
    has_backward,
    library_path,
    load_library,
    prepare_backward,
    prepare_forward,
    step_summary,
    steps,
    supports_head_dim,
)
from .autograd import DEFAULT_BACKWARD_STEP, DEFAULT_STEP, attention, backward_step_for

__all__ = [
    "attention", "backward_step_for", "DEFAULT_STEP", "DEFAULT_BACKWARD_STEP",
    "steps", "step_summary", "has_backward", "supports_head_dim",
    "forward", "backward", "forward_into", "backward_into", "prepare_forward",
    "prepare_backward",
    "check_forward", "check_backward", "check_device", "forward_args", "backward_args",
    "as_fa_tensor",
    "load_library", "library_path",
    "FlashStepsError", "InvalidArgument", "Unsupported", "NoDevice", "OutOfMemory",
    "CudaError", "UnknownStep", "LibraryNotFound", "ERROR_CLASSES",
    "FaTensor", "FwdArgs", "BwdArgs", "FA_FP16", "FA_BF16",
]
