"""ctypes bridge to libfa, the C API of every step (common/include/fa/api.h).

Everything here goes through the same door as the C++ runner and the tests: the structs
``fa_tensor``, ``fa_fwd_args`` and ``fa_bwd_args``, and the functions ``fa_forward``,
``fa_backward``, ``fa_check_forward``, ``fa_check_backward`` and ``fa_last_error``.

Tensors are BSHD: ``q``, ``o``, ``d_o``, ``dq`` are ``[batch, seqlen_q, heads, head_dim]``,
``k``, ``v``, ``dk``, ``dv`` are ``[batch, seqlen_k, heads_kv, head_dim]``, and the logsumexp
``lse`` is fp32 ``[batch, heads, seqlen_q]``, contiguous. Only the last dimension has to be
contiguous: the other strides are handed to the kernels, so views such as
``x[:, :, ::2]`` or a slice of a packed QKV tensor work without a copy.

The tensor-to-``fa_tensor`` conversion (:func:`as_fa_tensor`) needs only ``data_ptr()``,
``stride()``, ``shape`` and ``dtype`` (and ``device`` if present), so the host tests use a
tiny fake tensor class and never import torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import math
import os
import sys
from typing import Any, List, Optional, Sequence, Tuple

# ---------------------------------------------------------------------------------------------
# Status codes and exceptions
# ---------------------------------------------------------------------------------------------

FA_OK = 0
FA_ERR_INVALID_ARGUMENT = 1
FA_ERR_UNSUPPORTED = 2
FA_ERR_NO_DEVICE = 3
FA_ERR_OUT_OF_MEMORY = 4
FA_ERR_CUDA = 5
FA_ERR_UNKNOWN_STEP = 6

FA_FP16 = 0
FA_BF16 = 1


class FlashStepsError(RuntimeError):
    """Base class of every error the wrapper raises.

    Attributes: ``status`` (the ``fa_status`` number, or None for errors found before the C
    API was called, e.g. a missing library), ``status_name`` (``"FA_ERR_UNSUPPORTED"``, ...)
    and ``message`` (``fa_last_error()``, or the wrapper's own message).
    """

    status: Optional[int] = None
    status_name = "FA_ERR"

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class InvalidArgument(FlashStepsError, ValueError):
    """A size, shape, stride, pointer or combination is invalid (FA_ERR_INVALID_ARGUMENT)."""

    status = FA_ERR_INVALID_ARGUMENT
    status_name = "FA_ERR_INVALID_ARGUMENT"


class Unsupported(FlashStepsError):
    """Valid input this step does not support, e.g. a head dim or a dtype (FA_ERR_UNSUPPORTED)."""

    status = FA_ERR_UNSUPPORTED
    status_name = "FA_ERR_UNSUPPORTED"


class NoDevice(FlashStepsError):
    """No CUDA device, or one older than sm_80 (FA_ERR_NO_DEVICE)."""

    status = FA_ERR_NO_DEVICE
    status_name = "FA_ERR_NO_DEVICE"


class OutOfMemory(FlashStepsError, MemoryError):
    """The problem does not fit in device memory (FA_ERR_OUT_OF_MEMORY)."""

    status = FA_ERR_OUT_OF_MEMORY
    status_name = "FA_ERR_OUT_OF_MEMORY"


class CudaError(FlashStepsError):
    """A CUDA or cuBLAS call failed (FA_ERR_CUDA)."""

    status = FA_ERR_CUDA
    status_name = "FA_ERR_CUDA"


class UnknownStep(FlashStepsError, LookupError):
    """No registered step has that name (FA_ERR_UNKNOWN_STEP)."""

    status = FA_ERR_UNKNOWN_STEP
    status_name = "FA_ERR_UNKNOWN_STEP"


class LibraryNotFound(FlashStepsError):
    """libfa.so could not be found or loaded (no C status: the library never ran)."""

    status_name = "LIBRARY_NOT_FOUND"


#: The exception class raised for each non-OK ``fa_status``.
ERROR_CLASSES = {
    FA_ERR_INVALID_ARGUMENT: InvalidArgument,
    FA_ERR_UNSUPPORTED: Unsupported,
    FA_ERR_NO_DEVICE: NoDevice,
    FA_ERR_OUT_OF_MEMORY: OutOfMemory,
    FA_ERR_CUDA: CudaError,
    FA_ERR_UNKNOWN_STEP: UnknownStep,
}

# ---------------------------------------------------------------------------------------------
# The C structs (field order and types exactly as in api.h)
# ---------------------------------------------------------------------------------------------


class FaTensor(ctypes.Structure):
    """``fa_tensor``: a device pointer and its strides in elements."""

    _fields_ = [
        ("ptr", ctypes.c_void_p),
        ("batch_stride", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
    ]


class FwdArgs(ctypes.Structure):
    """``fa_fwd_args``: everything a forward pass needs."""

    _fields_ = [
        ("dtype", ctypes.c_int),
        ("batch", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("heads_kv", ctypes.c_int),
        ("seqlen_q", ctypes.c_int),
        ("seqlen_k", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("causal", ctypes.c_int),
        ("q", FaTensor),
        ("k", FaTensor),
        ("v", FaTensor),
        ("o", FaTensor),
        ("lse", ctypes.c_void_p),
    ]


class BwdArgs(ctypes.Structure):
    """``fa_bwd_args``: the forward's arguments, dO and the three gradients."""

    _fields_ = [
        ("fwd", FwdArgs),
        ("d_o", FaTensor),
        ("dq", FaTensor),
        ("dk", FaTensor),
        ("dv", FaTensor),
        ("deterministic", ctypes.c_int),
    ]


# ---------------------------------------------------------------------------------------------
# Loading libfa
# ---------------------------------------------------------------------------------------------

#: The repository root (this file is common/python/flash_steps/_lib.py).
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

_LIB: Optional[ctypes.CDLL] = None
_LIB_PATH: Optional[str] = None


def library_candidates() -> List[str]:
    """Where libfa is looked for, in order: ``$FA_LIB`` (a file, or a folder holding
    libfa.so), then the one ``pip install`` put into this package, then
    ``build/lib/libfa.so`` under the repository root, then any other ``build*/lib/libfa.so``
    there, newest first."""
    env = os.environ.get("FA_LIB")
    if env:
        return [os.path.join(env, "libfa.so") if os.path.isdir(env) else env]
    # The package's folders: an editable install adds site-packages/flash_steps to __path__.
    package = sys.modules.get(__package__ or "")
    folders = list(getattr(package, "__path__", None) or [os.path.dirname(__file__)])
    installed = [os.path.join(f, "libfa.so") for f in folders]
    installed = [p for p in installed if os.path.isfile(p)]
    first = os.path.join(REPO_ROOT, "build", "lib", "libfa.so")
    others = [p for p in glob.glob(os.path.join(REPO_ROOT, "build*", "lib", "libfa.so"))
              if os.path.abspath(p) != first]
    others.sort(key=lambda p: os.path.getmtime(p), reverse=True)
    return installed + [first] + others


def load_library() -> ctypes.CDLL:
    """Loads libfa once (see :func:`library_candidates`) and declares its functions."""
    global _LIB, _LIB_PATH
    if _LIB is not None:
        return _LIB
    candidates = library_candidates()
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is None:
        raise LibraryNotFound(
            "libfa.so not found (looked at: %s). Build it with "
            "`cmake --workflow --preset default` (or `cmake --build build --target fa`), "
            "or point FA_LIB at it." % ", ".join(candidates))
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise LibraryNotFound("cannot load %s: %s" % (path, e)) from e
    c_char_p, c_int, c_void_p = ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p
    lib.fa_step_count.restype = c_int
    lib.fa_step_count.argtypes = []
    lib.fa_step_name.restype = c_char_p
    lib.fa_step_name.argtypes = [c_int]
    lib.fa_step_summary.restype = c_char_p
    lib.fa_step_summary.argtypes = [c_char_p]
    lib.fa_step_has_backward.restype = c_int
    lib.fa_step_has_backward.argtypes = [c_char_p]
    lib.fa_step_supports_head_dim.restype = c_int
    lib.fa_step_supports_head_dim.argtypes = [c_char_p, c_int]
    lib.fa_step_check_device.restype = c_int
    lib.fa_step_check_device.argtypes = [c_char_p]
    lib.fa_check_forward.restype = c_int
    lib.fa_check_forward.argtypes = [c_char_p, ctypes.POINTER(FwdArgs)]
    lib.fa_check_backward.restype = c_int
    lib.fa_check_backward.argtypes = [c_char_p, ctypes.POINTER(BwdArgs)]
    lib.fa_forward.restype = c_int
    lib.fa_forward.argtypes = [c_char_p, ctypes.POINTER(FwdArgs), c_void_p]
    lib.fa_backward.restype = c_int
    lib.fa_backward.argtypes = [c_char_p, ctypes.POINTER(BwdArgs), c_void_p]
    lib.fa_last_error.restype = c_char_p
    lib.fa_last_error.argtypes = []
    lib.fa_status_name.restype = c_char_p
    lib.fa_status_name.argtypes = [c_int]
    _LIB, _LIB_PATH = lib, path
    return lib


def library_path() -> str:
    """The path of the loaded libfa (loads it if needed)."""
    load_library()
    assert _LIB_PATH is not None
    return _LIB_PATH


def _raise_for(status: int, lib: ctypes.CDLL) -> None:
    """Raises the exception class of a non-OK status, carrying fa_last_error()."""
    if status == FA_OK:
        return
    message = (lib.fa_last_error() or b"").decode("utf-8", "replace")
    name = (lib.fa_status_name(status) or b"").decode()
    cls = ERROR_CLASSES.get(status, FlashStepsError)
    err = cls(message or name, status)
    if cls is FlashStepsError:
        err.status_name = name
    raise err


def _name(step: str) -> bytes:
    if not isinstance(step, str):
        raise InvalidArgument("step must be a str such as '01_naive' (got %r)" % (step,))
    return step.encode()


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


def steps() -> List[str]:
    """Names of the registered steps in folder order, e.g. ``['01_naive', ...]``."""
    lib = load_library()
    return [lib.fa_step_name(i).decode() for i in range(lib.fa_step_count())]


def step_summary(step: str) -> str:
    """One line on what a step adds. Raises UnknownStep for a name that is not registered."""
    text = load_library().fa_step_summary(_name(step))
    if text is None:
        raise UnknownStep("unknown step '%s' (registered: %s)" % (step, ", ".join(steps())))
    return text.decode()


def has_backward(step: str) -> bool:
    """True if the step has a backward pass. Raises UnknownStep for an unknown name."""
    r = load_library().fa_step_has_backward(_name(step))
    if r < 0:
        raise UnknownStep("unknown step '%s' (registered: %s)" % (step, ", ".join(steps())))
    return r == 1


def supports_head_dim(step: str, head_dim: int) -> bool:
    """True if the step's kernels handle this head dimension."""
    r = load_library().fa_step_supports_head_dim(_name(step), int(head_dim))
    if r < 0:
        raise UnknownStep("unknown step '%s' (registered: %s)" % (step, ", ".join(steps())))
    return r == 1


def check_device(step: str) -> None:
    """Returns if the step can run on the current CUDA device; raises NoDevice (no GPU, or one
    older than sm_80) or Unsupported (the step was built for one architecture, e.g. sm_90a for
    09 and 10, and this GPU is another), with the library's one-line message."""
    lib = load_library()
    _raise_for(lib.fa_step_check_device(_name(step)), lib)


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------

_INT_MAX = 2**31 - 1


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` -> ``"float16"``; works on torch dtypes, numpy dtypes and strings."""
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    return {"half": "float16", "float": "float32", "bfloat": "bfloat16"}.get(text, text)


def fa_dtype(dtype: Any, what: str = "q") -> int:
    """The ``fa_dtype`` of a tensor dtype: FA_FP16 or FA_BF16; anything else is Unsupported."""
    name = dtype_name(dtype)
    if name == "float16":
        return FA_FP16
    if name == "bfloat16":
        return FA_BF16
    raise Unsupported("%s has dtype %s; the steps take float16 or bfloat16" % (what, name))


def _device(t: Any) -> Optional[str]:
    """The tensor's device as text ('cuda:0', 'cpu'), or None if the object has none."""
    dev = getattr(t, "device", None)
    if dev is None:
        return None
    if getattr(dev, "type", None) == "cuda" and getattr(dev, "index", None) is None:
        return "cuda"
    return str(dev)


def _shape(t: Any, what: str, rank: int, layout: str) -> Tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in t.shape)
    except (AttributeError, TypeError):
        raise InvalidArgument("%s must be a tensor (got %s)" % (what, type(t).__name__)) from None
    if len(shape) != rank:
        raise InvalidArgument("%s must be %d-D %s, got shape %s" % (what, rank, layout,
                                                                    list(shape)))
    return shape


def as_fa_tensor(t: Any, what: str = "tensor") -> FaTensor:
    """Converts a 4-D BSHD tensor ``[batch, seqlen, heads, head_dim]`` to an ``fa_tensor``.

    Needs ``t.data_ptr()``, ``t.stride()`` and ``t.shape``. The last dimension must be
    contiguous (stride 1); the other three strides are passed through unchanged, so
    non-contiguous views need no copy. Alignment and stride rules are the C API's
    (fa_check_forward reports them), so they hold for every caller alike.
    """
    shape = _shape(t, what, 4, "[batch, seqlen, heads, head_dim] (BSHD)")
    stride = tuple(int(s) for s in t.stride())
    if shape[3] > 1 and stride[3] != 1:
        raise InvalidArgument(
            "%s's last dimension (head_dim) must be contiguous (stride 1), got strides %s; "
            "use %s.contiguous()" % (what, list(stride), what))
    return FaTensor(ctypes.c_void_p(int(t.data_ptr())), stride[0], stride[1], stride[2])


def _check_int(value: int, what: str) -> int:
    if value > _INT_MAX:
        raise InvalidArgument("%s (%d) does not fit in a C int" % (what, value))
    return value


def _same_device(named: Sequence[Tuple[str, Any]]) -> None:
    """Every tensor is on a CUDA device, and all on the same one."""
    first_name, first_dev = None, None
    for what, t in named:
        dev = _device(t)
        if dev is None:
            continue
        if not dev.startswith("cuda"):
            raise InvalidArgument(
                "%s is on %s; the steps run on CUDA tensors (move it with %s.cuda())"
                % (what, dev, what))
        if first_dev is None:
            first_name, first_dev = what, dev
        elif dev != first_dev:
            raise InvalidArgument("%s is on %s but %s is on %s; all tensors must be on one GPU"
                                  % (what, dev, first_name, first_dev))


def _check_lse(lse: Any, batch: int, heads: int, seqlen_q: int) -> None:
    shape = _shape(lse, "lse", 3, "[batch, heads, seqlen_q] fp32")
    if shape != (batch, heads, seqlen_q):
        raise InvalidArgument("lse must have shape [batch, heads, seqlen_q] = %s, got %s"
                              % ([batch, heads, seqlen_q], list(shape)))
    if dtype_name(lse.dtype) != "float32":
        raise InvalidArgument("lse must be float32, got %s" % dtype_name(lse.dtype))
    stride = tuple(int(s) for s in lse.stride())
    want = (heads * seqlen_q, seqlen_q, 1)
    if 0 not in shape and any(n > 1 and s != w for n, s, w in zip(shape, stride, want)):
        raise InvalidArgument("lse must be contiguous (strides %s), got strides %s"
                              % (list(want), list(stride)))


def forward_args(q: Any, k: Any, v: Any, o: Any, lse: Any = None, causal: bool = False,
                 scale: Optional[float] = None) -> FwdArgs:
    """Builds ``fa_fwd_args`` from tensors, checking what only Python can see: ranks, that
    the shapes of q, k, v, o agree, one dtype, one CUDA device, contiguous last dims, and the
    logsumexp's shape. Sizes, alignment, strides, head dims and the scale are left to the C
    API so that its messages are the same for every caller.

    ``scale`` defaults to ``1 / sqrt(head_dim)`` (``None``); an explicit value, 0 included,
    goes to the C API as it is. The C API also rejects outputs that share memory with an input,
    with each other or with themselves (``o`` is ``q``, a stride-0 ``expand``): see api.h.
    """
    B, Nq, H, d = _shape(q, "q", 4, "[batch, seqlen_q, heads, head_dim] (BSHD)")
    kb, Nk, Hkv, kd = _shape(k, "k", 4, "[batch, seqlen_k, heads_kv, head_dim] (BSHD)")
    vshape = _shape(v, "v", 4, "[batch, seqlen_k, heads_kv, head_dim] (BSHD)")
    oshape = _shape(o, "o", 4, "[batch, seqlen_q, heads, head_dim] (BSHD)")
    if (kb, kd) != (B, d):
        raise InvalidArgument(
            "k has shape %s but q has %s: batch and head_dim must match "
            "(q [batch, seqlen_q, heads, head_dim], k [batch, seqlen_k, heads_kv, head_dim])"
            % (list(k.shape), list(q.shape)))
    if vshape != (kb, Nk, Hkv, kd):
        raise InvalidArgument("v has shape %s but k has %s: they must be equal"
                              % (list(vshape), [kb, Nk, Hkv, kd]))
    if oshape != (B, Nq, H, d):
        raise InvalidArgument("o has shape %s but q has %s: they must be equal"
                              % (list(oshape), [B, Nq, H, d]))
    code = fa_dtype(q.dtype, "q")
    for what, t in (("k", k), ("v", v), ("o", o)):
        if dtype_name(t.dtype) != dtype_name(q.dtype):
            raise InvalidArgument("%s has dtype %s but q has %s; all must be the same"
                                  % (what, dtype_name(t.dtype), dtype_name(q.dtype)))
    named = [("q", q), ("k", k), ("v", v), ("o", o)] + ([("lse", lse)] if lse is not None else [])
    _same_device(named)
    if lse is not None:
        _check_lse(lse, B, H, Nq)
    for what, value in (("batch", B), ("seqlen_q", Nq), ("heads", H), ("head_dim", d),
                        ("seqlen_k", Nk), ("heads_kv", Hkv)):
        _check_int(value, what)
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    a = FwdArgs()
    a.dtype = code
    a.batch, a.heads, a.heads_kv = B, H, Hkv
    a.seqlen_q, a.seqlen_k, a.head_dim = Nq, Nk, d
    a.scale = float(scale)
    a.causal = 1 if causal else 0
    a.q = as_fa_tensor(q, "q")
    a.k = as_fa_tensor(k, "k")
    a.v = as_fa_tensor(v, "v")
    a.o = as_fa_tensor(o, "o")
    a.lse = int(lse.data_ptr()) if lse is not None else None
    return a


def backward_args(q: Any, k: Any, v: Any, o: Any, lse: Any, d_o: Any, dq: Any, dk: Any,
                  dv: Any, causal: bool = False, scale: Optional[float] = None,
                  deterministic: bool = False) -> BwdArgs:
    """Builds ``fa_bwd_args``: the forward's arguments (lse required) plus dO and the
    gradients, with the same Python-side checks as :func:`forward_args`."""
    if lse is None:
        raise InvalidArgument("lse is None: the backward needs the forward's logsumexp "
                              "(call forward(..., return_lse=True))")
    fwd = forward_args(q, k, v, o, lse, causal, scale)
    for what, t, like, like_name in (("d_o", d_o, q, "q"), ("dq", dq, q, "q"),
                                     ("dk", dk, k, "k"), ("dv", dv, k, "k")):
        shape = _shape(t, what, 4, "BSHD")
        if shape != tuple(int(s) for s in like.shape):
            raise InvalidArgument("%s has shape %s but %s has %s: they must be equal"
                                  % (what, list(shape), like_name, list(like.shape)))
        if dtype_name(t.dtype) != dtype_name(q.dtype):
            raise InvalidArgument("%s has dtype %s but q has %s; all must be the same"
                                  % (what, dtype_name(t.dtype), dtype_name(q.dtype)))
    _same_device([("q", q), ("d_o", d_o), ("dq", dq), ("dk", dk), ("dv", dv)])
    b = BwdArgs()
    b.fwd = fwd
    b.d_o = as_fa_tensor(d_o, "d_o")
    b.dq = as_fa_tensor(dq, "dq")
    b.dk = as_fa_tensor(dk, "dk")
    b.dv = as_fa_tensor(dv, "dv")
    b.deterministic = 1 if deterministic else 0
    return b


# ---------------------------------------------------------------------------------------------
# Calls
# ---------------------------------------------------------------------------------------------


def _is_torch_tensor(t: Any) -> bool:
    return type(t).__module__.startswith("torch")


def _stream_and_device(t: Any, stream: Optional[int]):
    """The stream to launch on (torch's current stream of t's device unless given) and a
    context that makes t's device current, so the C API sees the right GPU."""
    if not _is_torch_tensor(t):
        return (stream or 0), contextlib.nullcontext()
    import torch  # only when the caller already uses torch

    if stream is None:
        stream = torch.cuda.current_stream(t.device).cuda_stream
    return stream, torch.cuda.device(t.device)


def check_forward(step: str, q: Any, k: Any, v: Any, o: Any, lse: Any = None,
                  causal: bool = False, scale: Optional[float] = None) -> None:
    """Checks a forward problem without touching the GPU; raises what fa_forward would."""
    lib = load_library()
    a = forward_args(q, k, v, o, lse, causal, scale)
    _raise_for(lib.fa_check_forward(_name(step), ctypes.byref(a)), lib)


def check_backward(step: str, q: Any, k: Any, v: Any, o: Any, lse: Any, d_o: Any, dq: Any,
                   dk: Any, dv: Any, causal: bool = False, scale: Optional[float] = None,
                   deterministic: bool = False) -> None:
    """Checks a backward problem without touching the GPU; raises what fa_backward would."""
    lib = load_library()
    b = backward_args(q, k, v, o, lse, d_o, dq, dk, dv, causal, scale, deterministic)
    _raise_for(lib.fa_check_backward(_name(step), ctypes.byref(b)), lib)


def prepare_forward(step: str, q: Any, k: Any, v: Any, o: Any, lse: Any = None,
                    causal: bool = False, scale: Optional[float] = None,
                    stream: Optional[int] = None):
    """Checks a forward problem once and returns a zero-argument function that launches it
    (on ``stream``, default torch's current stream at this call) with almost no Python work:
    what a timing loop wants. Raises like :func:`forward_into`, at preparation or launch."""
    lib = load_library()
    name = _name(step)
    a = forward_args(q, k, v, o, lse, causal, scale)
    _raise_for(lib.fa_check_forward(name, ctypes.byref(a)), lib)
    stream, device = _stream_and_device(q, stream)
    args, handle, keep = ctypes.byref(a), ctypes.c_void_p(stream), (a, q, k, v, o, lse)

    def launch() -> None:
        with device:
            status = lib.fa_forward(name, args, handle)
        if status != FA_OK:
            _raise_for(status, lib)

    launch.keep = keep  # the args struct and the tensors live as long as the function
    return launch


def prepare_backward(step: str, q: Any, k: Any, v: Any, o: Any, lse: Any, d_o: Any, dq: Any,
                     dk: Any, dv: Any, causal: bool = False, scale: Optional[float] = None,
                     deterministic: bool = False, stream: Optional[int] = None):
    """Like :func:`prepare_forward`, for the backward pass."""
    lib = load_library()
    name = _name(step)
    b = backward_args(q, k, v, o, lse, d_o, dq, dk, dv, causal, scale, deterministic)
    _raise_for(lib.fa_check_backward(name, ctypes.byref(b)), lib)
    stream, device = _stream_and_device(q, stream)
    args, handle, keep = ctypes.byref(b), ctypes.c_void_p(stream), (b, q, k, v, o, lse, d_o,
                                                                     dq, dk, dv)

    def launch() -> None:
        with device:
            status = lib.fa_backward(name, args, handle)
        if status != FA_OK:
            _raise_for(status, lib)

    launch.keep = keep
    return launch


def forward_into(step: str, q: Any, k: Any, v: Any, o: Any, lse: Any = None,
                 causal: bool = False, scale: Optional[float] = None,
                 stream: Optional[int] = None) -> None:
    """Runs a step's forward into preallocated ``o`` (and ``lse`` if given), asynchronously
    on ``stream`` (default: torch's current stream). Raises on any non-OK status."""
    lib = load_library()
    a = forward_args(q, k, v, o, lse, causal, scale)
    stream, device = _stream_and_device(q, stream)
    with device:
        _raise_for(lib.fa_forward(_name(step), ctypes.byref(a), ctypes.c_void_p(stream)), lib)


def backward_into(step: str, q: Any, k: Any, v: Any, o: Any, lse: Any, d_o: Any, dq: Any,
                  dk: Any, dv: Any, causal: bool = False, scale: Optional[float] = None,
                  deterministic: bool = False, stream: Optional[int] = None) -> None:
    """Runs a step's backward into preallocated ``dq``, ``dk``, ``dv``, asynchronously on
    ``stream`` (default: torch's current stream). Raises on any non-OK status."""
    lib = load_library()
    b = backward_args(q, k, v, o, lse, d_o, dq, dk, dv, causal, scale, deterministic)
    stream, device = _stream_and_device(q, stream)
    with device:
        _raise_for(lib.fa_backward(_name(step), ctypes.byref(b), ctypes.c_void_p(stream)), lib)


def forward(step: str, q: Any, k: Any, v: Any, causal: bool = False,
            scale: Optional[float] = None, return_lse: bool = True):
    """Attention forward of one step on torch tensors.

    ``q`` is ``[B, N_q, H, d]``, ``k`` and ``v`` are ``[B, N_k, H_kv, d]`` (fp16 or bf16, on
    one GPU, last dim contiguous). Returns ``(o, lse)`` with ``o`` like ``q`` and ``lse``
    fp32 ``[B, H, N_q]``, or just ``o`` when ``return_lse`` is False. Runs on torch's current
    stream. ``scale`` defaults to ``1/sqrt(d)``; ``causal`` is bottom-right aligned.
    """
    import torch

    B, Nq, H, d = _shape(q, "q", 4, "[batch, seqlen_q, heads, head_dim] (BSHD)")
    if not isinstance(q, torch.Tensor):
        raise InvalidArgument("forward() allocates its outputs with torch; q must be a "
                              "torch.Tensor (use forward_into for other tensor types)")
    o = torch.empty((B, Nq, H, d), dtype=q.dtype, device=q.device)
    lse = (torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
           if return_lse else None)
    forward_into(step, q, k, v, o, lse, causal, scale)
    return (o, lse) if return_lse else o


def backward(step: str, q: Any, k: Any, v: Any, o: Any, lse: Any, d_o: Any,
             causal: bool = False, scale: Optional[float] = None,
             deterministic: bool = False):
    """Attention backward of one step on torch tensors: the forward's ``q, k, v, o, lse``
    and the output gradient ``d_o`` (like ``o``). Returns new ``(dq, dk, dv)``, shaped like
    ``q, k, v`` (``dk``, ``dv`` summed over the query heads of a GQA group). Runs on torch's
    current stream. ``deterministic`` avoids float atomics (same bits every run)."""
    import torch

    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise InvalidArgument("backward() allocates its outputs with torch; q and k must be "
                              "torch.Tensors (use backward_into for other tensor types)")
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    backward_into(step, q, k, v, o, lse, d_o, dq, dk, dv, causal, scale, deterministic)
    return dq, dk, dv
