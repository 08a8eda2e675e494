"""Host tests of the ctypes wrapper (flash_steps): no torch, no GPU.

Run: ``FA_LIB=build/lib/libfa.so python3 -m pytest -q common/python/tests`` (ctest runs it
with label ``host``). Tensors are a tiny fake class with fake, never dereferenced device
pointers: only the C API's host-side checks (fa_check_forward / fa_check_backward) see them,
plus one fa_forward call that must stop at "no CUDA device" on a machine without a GPU.
"""

import ctypes
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flash_steps as fs  # noqa: E402
from flash_steps import _lib  # noqa: E402

try:
    fs.load_library()
except fs.LibraryNotFound as e:
    if os.environ.get("FA_LIB"):
        raise  # ctest sets FA_LIB: a library that does not load is a failure
    pytest.skip("libfa not built (%s)" % e, allow_module_level=True)

BASE = 0x7F0000000000  # fake device addresses, 16-byte aligned, never dereferenced


class FakeDtype:
    """Prints like a torch dtype."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return "torch." + self.name


class FakeTensor:
    """Just what the wrapper reads: shape, stride(), dtype, device, data_ptr()."""

    def __init__(self, shape, dtype="float16", ptr=None, strides=None, device="cuda:0"):
        global BASE
        self.shape = tuple(shape)
        if strides is None:
            strides, acc = [], 1
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= max(n, 1)
        self._strides = tuple(strides)
        self.dtype = FakeDtype(dtype)
        self.device = device
        if ptr is None:
            BASE += 1 << 32
            ptr = BASE
        self._ptr = ptr

    def data_ptr(self):
        return self._ptr

    def stride(self):
        return self._strides


def problem(B=2, Nq=100, Nk=200, H=8, Hkv=2, d=64, dtype="float16"):
    """A valid forward problem (GQA, Nq != Nk) as a dict of fake tensors."""
    return dict(q=FakeTensor((B, Nq, H, d), dtype), k=FakeTensor((B, Nk, Hkv, d), dtype),
                v=FakeTensor((B, Nk, Hkv, d), dtype), o=FakeTensor((B, Nq, H, d), dtype),
                lse=FakeTensor((B, H, Nq), "float32"))


def bwd_problem(**kw):
    p = problem(**kw)
    q, k = p["q"], p["k"]
    p.update(d_o=FakeTensor(q.shape, dtype=q.dtype.name), dq=FakeTensor(q.shape, q.dtype.name),
             dk=FakeTensor(k.shape, k.dtype.name), dv=FakeTensor(k.shape, k.dtype.name))
    return p


FIRST = "01_naive"


def backward_step():
    for s in fs.steps():
        if fs.has_backward(s):
            return s
    pytest.skip("no registered step has a backward pass")


def expect(exc, needle, step=FIRST, **changes):
    """Checks problem() with `changes` applied and expects `exc` with `needle` in the text."""
    p = problem()
    p.update(changes)
    scale = p.pop("scale", None)
    causal = p.pop("causal", True)
    with pytest.raises(exc) as info:
        fs.check_forward(step, scale=scale, causal=causal, **p)
    assert needle in str(info.value), str(info.value)
    assert info.value.message == str(info.value)
    return info.value


# --- steps --------------------------------------------------------------------------------


def test_steps_lists_01_naive_first_in_folder_order():
    names = fs.steps()
    assert names[0] == "01_naive"
    assert names == sorted(names) and len(set(names)) == len(names)
    for n in names:
        assert fs.step_summary(n)
        assert isinstance(fs.has_backward(n), bool)
        assert fs.supports_head_dim(n, 64) and fs.supports_head_dim(n, 128)


def test_unknown_step_everywhere():
    for call in (lambda: fs.step_summary("99_nope"), lambda: fs.has_backward("99_nope"),
                 lambda: fs.supports_head_dim("99_nope", 64)):
        with pytest.raises(fs.UnknownStep, match="unknown step '99_nope'"):
            call()
    err = expect(fs.UnknownStep, "unknown step '99_nope'", step="99_nope")
    assert "01_naive" in err.message  # the message lists what is registered
    assert err.status == 6 and err.status_name == "FA_ERR_UNKNOWN_STEP"
    assert isinstance(err, LookupError)


def test_step_name_must_be_text():
    with pytest.raises(fs.InvalidArgument, match="step must be a str"):
        fs.check_forward(1, **problem())


# --- valid problems pass ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_valid_forward_passes_every_step(dtype):
    for s in fs.steps():
        fs.check_forward(s, causal=True, **problem(dtype=dtype))
        p = problem(dtype=dtype)
        p["lse"] = None  # the logsumexp is optional for the forward
        fs.check_forward(s, **p)


def test_valid_backward_passes_or_says_no_backward():
    for s in fs.steps():
        if fs.has_backward(s):
            fs.check_backward(s, causal=True, deterministic=True, **bwd_problem())
        else:
            with pytest.raises(fs.Unsupported, match="step %s has no backward pass" % s):
                fs.check_backward(s, **bwd_problem())


def test_strides_pass_through_for_views():
    # q, k, v as views into one packed [B, N, 3, H, d] tensor: row stride 3*H*d.
    B, N, H, d = 2, 50, 4, 64
    packed = BASE
    strides = (N * 3 * H * d, 3 * H * d, d, 1)
    q = FakeTensor((B, N, H, d), ptr=packed, strides=strides)
    k = FakeTensor((B, N, H, d), ptr=packed + 2 * H * d, strides=strides)
    v = FakeTensor((B, N, H, d), ptr=packed + 4 * H * d, strides=strides)
    o = FakeTensor((B, N, H, d))
    a = fs.forward_args(q, k, v, o)
    assert (a.q.batch_stride, a.q.row_stride, a.q.head_stride) == strides[:3]
    assert a.k.ptr == packed + 2 * H * d
    assert (a.batch, a.seqlen_q, a.seqlen_k, a.heads, a.heads_kv, a.head_dim) == \
        (B, N, N, H, H, d)
    assert a.lse is None and a.causal == 0
    assert math.isclose(a.scale, 1 / 8)  # default 1/sqrt(d)
    for s in fs.steps():
        fs.check_forward(s, q, k, v, o)


# --- rejected parameters: checked by the C API, raised with its message ----------------------


def test_dtype():
    expect(fs.Unsupported, "q has dtype float32; the steps take float16 or bfloat16",
           q=FakeTensor((2, 100, 8, 64), "float32"))
    expect(fs.InvalidArgument, "k has dtype bfloat16 but q has float16",
           k=FakeTensor((2, 200, 2, 64), "bfloat16"))
    expect(fs.InvalidArgument, "o has dtype float32 but q has float16",
           o=FakeTensor((2, 100, 8, 64), "float32"))


@pytest.mark.parametrize("field,shape,needle", [
    ("batch", dict(B=0), "batch must be >= 1 (got 0)"),
    ("seqlen_q", dict(Nq=0), "seqlen_q must be >= 1 (got 0)"),
    ("seqlen_k", dict(Nk=0), "seqlen_k must be >= 1 (got 0)"),
    ("heads", dict(H=0), "heads must be >= 1 (got 0)"),
    ("heads_kv", dict(Hkv=0), "heads_kv must be >= 1 (got 0)"),
    ("head_dim", dict(d=0), "head_dim must be >= 1 (got 0)"),
])
def test_empty_sizes(field, shape, needle):
    p = problem(**shape)
    with pytest.raises(fs.InvalidArgument) as info:
        fs.check_forward(FIRST, **p)
    assert needle in str(info.value)
    assert info.value.status == 1 and info.value.status_name == "FA_ERR_INVALID_ARGUMENT"
    assert isinstance(info.value, ValueError)


def test_too_large_batch():
    p = problem(B=70000)
    with pytest.raises(fs.Unsupported, match="must be <= 65535"):
        fs.check_forward(FIRST, **p)


def test_heads_not_multiple_of_heads_kv():
    p = problem(H=8, Hkv=3)
    with pytest.raises(fs.InvalidArgument, match=r"heads \(8\) must be a multiple of heads_kv "
                                                 r"\(3\)"):
        fs.check_forward(FIRST, **p)


def test_unsupported_head_dim_every_step():
    for s in fs.steps():
        bad = next(d for d in list(range(8, 264, 8)) + [260] if not fs.supports_head_dim(s, d))
        p = problem(d=bad)
        with pytest.raises(fs.Unsupported) as info:
            fs.check_forward(s, **p)
        assert "head_dim %d is not supported by step %s" % (bad, s) in str(info.value)
        assert "supported:" in str(info.value)


@pytest.mark.parametrize("scale", [0.0, -0.0, -1.0, float("nan"), float("inf"), 1e-50, 1e-40,
                                   3e38])
def test_bad_scale(scale):
    # 0 is not "the default" (scale=None is); scale * log2(e) must be a normal fp32 number.
    expect(fs.InvalidArgument, "scale must be finite and > 0", scale=scale)


# --- outputs that share memory --------------------------------------------------------------


def test_output_that_is_an_input():
    p = problem()
    p["o"] = p["q"]  # forward_into(step, q, k, v, o=q)
    with pytest.raises(fs.InvalidArgument, match="o overlaps the input q in memory"):
        fs.check_forward(FIRST, causal=True, **p)
    p = problem(Nk=100, Hkv=8)
    with pytest.raises(fs.InvalidArgument, match="o overlaps the input q in memory"):
        fs.forward_into(FIRST, p["q"], p["q"], p["q"], p["q"])  # raised before any launch


def test_broadcast_output():
    # o = torch.empty(1, 100, 8, 64).expand(2, -1, -1, -1): batch stride 0.
    expect(fs.InvalidArgument, "o.batch_stride is 0 with batch = 2: an output cannot be broadcast",
           o=FakeTensor((2, 100, 8, 64), strides=(0, 8 * 64, 64, 1)))


def test_lse_inside_o():
    o = FakeTensor((2, 100, 8, 64))
    expect(fs.InvalidArgument, "o and lse overlap in memory", o=o,
           lse=FakeTensor((2, 8, 100), "float32", ptr=o.data_ptr() + 64))


def test_backward_outputs_that_share_memory():
    s = backward_step()

    def bexpect(needle, **changes):
        p = bwd_problem()
        p.update({k: (v(p) if callable(v) else v) for k, v in changes.items()})
        with pytest.raises(fs.InvalidArgument) as info:
            fs.check_backward(s, causal=True, **p)
        assert needle in str(info.value), str(info.value)

    bexpect("dq overlaps the input d_o", dq=lambda p: p["d_o"])
    bexpect("dq overlaps the input o", dq=lambda p: p["o"])
    bexpect("dk and dv overlap in memory", dv=lambda p: p["dk"])
    bexpect("dv overlaps the input v", dv=lambda p: p["v"])


def test_packed_gradients_are_accepted():
    # dq, dk, dv as views of one [B, N, H + 2 Hkv, d] buffer (a packed QKV gradient, GQA):
    # interleaved row by row, no byte shared.
    s = backward_step()
    B, N, H, Hkv, d = 2, 100, 8, 2, 64
    W = H + 2 * Hkv
    strides = (N * W * d, W * d, d, 1)
    base = FakeTensor((1,)).data_ptr()
    p = bwd_problem(Nq=N, Nk=N)
    p["dq"] = FakeTensor((B, N, H, d), ptr=base, strides=strides)
    p["dk"] = FakeTensor((B, N, Hkv, d), ptr=base + 2 * H * d, strides=strides)
    p["dv"] = FakeTensor((B, N, Hkv, d), ptr=base + 2 * (H + Hkv) * d, strides=strides)
    fs.check_backward(s, causal=True, **p)
    p["dv"] = FakeTensor((B, N, Hkv, d), ptr=base + 2 * (H + 1) * d, strides=strides)
    with pytest.raises(fs.InvalidArgument, match="dk and dv overlap in memory"):
        fs.check_backward(s, causal=True, **p)


@pytest.mark.parametrize("name", ["q", "k", "v", "o"])
def test_null_pointer(name):
    p = problem()
    t = p[name]
    expect(fs.InvalidArgument, "%s.ptr is NULL" % name, **{name: FakeTensor(t.shape, ptr=0)})


@pytest.mark.parametrize("name", ["q", "k", "v", "o"])
def test_misaligned_pointer(name):
    t = problem()[name]
    expect(fs.InvalidArgument, "%s.ptr" % name,
           **{name: FakeTensor(t.shape, ptr=BASE + 8)})
    expect(fs.InvalidArgument, "is not 16-byte aligned",
           **{name: FakeTensor(t.shape, ptr=BASE + 2)})


def test_misaligned_lse():
    expect(fs.InvalidArgument, "lse", lse=FakeTensor((2, 8, 100), "float32", ptr=BASE + 4))


def test_bad_strides():
    B, Nq, H, d = 2, 100, 8, 64
    shape = (B, Nq, H, d)
    expect(fs.InvalidArgument, "q.row_stride (516) must be a multiple of 8 elements",
           q=FakeTensor(shape, strides=(Nq * 516, 516, d, 1)))
    expect(fs.InvalidArgument, "k.batch_stride must be >= 0",
           k=FakeTensor((B, 200, 2, d), strides=(-8, 2 * d, d, 1)))
    expect(fs.InvalidArgument, "v.head_stride (32) is smaller than head_dim (64)",
           v=FakeTensor((B, 200, 2, d), strides=(200 * 2 * d, 2 * d, 32, 1)))
    expect(fs.InvalidArgument, "o.row_stride (56) is smaller than head_dim (64)",
           o=FakeTensor(shape, strides=(Nq * H * d, 56, d, 1)))


def test_last_dim_must_be_contiguous():
    q = FakeTensor((2, 100, 8, 64), strides=(100 * 8 * 128, 8 * 128, 128, 2))
    expect(fs.InvalidArgument, "q's last dimension (head_dim) must be contiguous (stride 1)",
           q=q)


# --- rejected parameters: checked in Python (what only the tensors show) ----------------------


def test_rank():
    expect(fs.InvalidArgument, "q must be 4-D [batch, seqlen_q, heads, head_dim] (BSHD), "
           "got shape [100, 8, 64]", q=FakeTensor((100, 8, 64)))
    expect(fs.InvalidArgument, "k must be 4-D", k=FakeTensor((2, 200, 2, 64, 1)))


def test_not_a_tensor():
    expect(fs.InvalidArgument, "v must be a tensor (got list)", v=[1, 2, 3])


def test_shapes_must_agree():
    expect(fs.InvalidArgument, "batch and head_dim must match", k=FakeTensor((3, 200, 2, 64)))
    expect(fs.InvalidArgument, "batch and head_dim must match", k=FakeTensor((2, 200, 2, 128)))
    expect(fs.InvalidArgument, "v has shape [2, 199, 2, 64] but k has [2, 200, 2, 64]",
           v=FakeTensor((2, 199, 2, 64)))
    expect(fs.InvalidArgument, "o has shape [2, 100, 4, 64] but q has [2, 100, 8, 64]",
           o=FakeTensor((2, 100, 4, 64)))


def test_devices():
    expect(fs.InvalidArgument, "k is on cpu; the steps run on CUDA tensors",
           k=FakeTensor((2, 200, 2, 64), device="cpu"))
    expect(fs.InvalidArgument, "o is on cuda:1 but q is on cuda:0",
           o=FakeTensor((2, 100, 8, 64), device="cuda:1"))


def test_lse_checks():
    expect(fs.InvalidArgument, "lse must have shape [batch, heads, seqlen_q] = [2, 8, 100]",
           lse=FakeTensor((2, 100, 8), "float32"))
    expect(fs.InvalidArgument, "lse must be float32, got float16",
           lse=FakeTensor((2, 8, 100), "float16"))
    expect(fs.InvalidArgument, "lse must be contiguous",
           lse=FakeTensor((2, 8, 100), "float32", strides=(1600, 200, 1)))


def test_sizes_beyond_c_int():
    big = 2**31
    expect(fs.InvalidArgument, "seqlen_k (2147483648) does not fit in a C int",
           k=FakeTensor((2, big, 2, 64)), v=FakeTensor((2, big, 2, 64)))


# --- backward -----------------------------------------------------------------------------


def test_backward_rejections():
    s = backward_step()

    def bexpect(exc, needle, **changes):
        p = bwd_problem()
        p.update(changes)
        with pytest.raises(exc) as info:
            fs.check_backward(s, causal=True, **p)
        assert needle in str(info.value), str(info.value)

    bexpect(fs.InvalidArgument, "lse is None: the backward needs the forward's logsumexp",
            lse=None)
    bexpect(fs.InvalidArgument, "dk.ptr is NULL", dk=FakeTensor((2, 200, 2, 64), ptr=0))
    bexpect(fs.InvalidArgument, "d_o.row_stride",
            d_o=FakeTensor((2, 100, 8, 64), strides=(100 * 8 * 64, 12, 64, 1)))
    bexpect(fs.InvalidArgument, "dq.ptr", dq=FakeTensor((2, 100, 8, 64), ptr=BASE + 6))
    bexpect(fs.InvalidArgument, "dv has shape [2, 200, 8, 64] but k has [2, 200, 2, 64]",
            dv=FakeTensor((2, 200, 8, 64)))
    bexpect(fs.InvalidArgument, "d_o has dtype bfloat16 but q has float16",
            d_o=FakeTensor((2, 100, 8, 64), "bfloat16"))
    bexpect(fs.InvalidArgument, "dq is on cpu", dq=FakeTensor((2, 100, 8, 64), device="cpu"))
    bexpect(fs.Unsupported, "head_dim", **{k: v for k, v in bwd_problem(d=260).items()})


# --- status -> exception mapping ----------------------------------------------------------


def test_every_status_maps_to_its_class():
    lib = fs.load_library()
    p = problem()
    p["scale"] = -1.0
    with pytest.raises(fs.InvalidArgument):
        fs.check_forward(FIRST, **p)  # leaves a message in fa_last_error()
    message = lib.fa_last_error().decode()
    assert "scale must be finite" in message
    expected = {1: fs.InvalidArgument, 2: fs.Unsupported, 3: fs.NoDevice, 4: fs.OutOfMemory,
                5: fs.CudaError, 6: fs.UnknownStep}
    assert fs.ERROR_CLASSES == expected
    for status, cls in expected.items():
        with pytest.raises(cls) as info:
            _lib._raise_for(status, lib)
        assert info.value.status == status
        assert info.value.status_name == lib.fa_status_name(status).decode()
        assert str(info.value) == message  # carries fa_last_error()
        assert isinstance(info.value, fs.FlashStepsError)
    with pytest.raises(fs.FlashStepsError) as info:
        _lib._raise_for(99, lib)
    assert type(info.value) is fs.FlashStepsError
    assert info.value.status_name == "FA_ERR_UNKNOWN_STATUS"
    _lib._raise_for(0, lib)  # FA_OK raises nothing
    assert issubclass(fs.OutOfMemory, MemoryError)


def _gpu_count():
    """CUDA devices seen by the libcudart that libfa loaded (None if it cannot be asked)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return None
    for path in paths:
        try:
            cudart = ctypes.CDLL(path)
            count = ctypes.c_int(0)
            err = cudart.cudaGetDeviceCount(ctypes.byref(count))
            return count.value if err == 0 else 0
        except (OSError, AttributeError):
            continue
    return None


def test_forward_without_gpu_raises_no_device():
    count = _gpu_count()
    if count is None or count > 0:
        pytest.skip("a GPU is present (or cannot be ruled out): fake pointers must not launch")
    with pytest.raises(fs.NoDevice, match="no CUDA device") as info:
        fs.forward_into(FIRST, causal=True, **problem())
    assert info.value.status == 3 and info.value.status_name == "FA_ERR_NO_DEVICE"


# --- finding the library ------------------------------------------------------------------


def test_library_search(monkeypatch, tmp_path):
    monkeypatch.setenv("FA_LIB", str(tmp_path))
    assert _lib.library_candidates() == [str(tmp_path / "libfa.so")]
    monkeypatch.setattr(_lib, "_LIB", None)
    monkeypatch.setattr(_lib, "_LIB_PATH", None)
    with pytest.raises(fs.LibraryNotFound, match="libfa.so not found"):
        fs.load_library()
    monkeypatch.delenv("FA_LIB")
    assert _lib.library_candidates()[0] == os.path.join(_lib.REPO_ROOT, "build", "lib",
                                                        "libfa.so")
