"""flash_steps.attention on the GPU: forward and gradients against fp64 references.

Skipped without torch or without a CUDA device (each with the reason). Every output (O, dQ,
dK, dV) must pass the harness's bounds and stay within 3x the error of rounding the exact
answer to the dtype, and each check first shows that it would fail a 1% wrong answer
(attention_reference.check). The matrix: fp16 and bf16, causal and not, both layouts, MHA and
GQA with ragged lengths (N_q != N_k), head dims 64 and 128; then every registered step's
forward trained through its backward, SDPA itself (fp64, math backend) as the reference,
output gradients of any strides, autocast, the deterministic backward, and errors.

Run: ``FA_LIB=build/lib/libfa.so python3 -m pytest -q common/python/tests/test_attention_gpu.py``
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU tests of flash_steps.attention do not run",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import flash_steps as fs  # noqa: E402
from attention_reference import check, reference  # noqa: E402

try:
    fs.load_library()
except fs.LibraryNotFound as e:
    if os.environ.get("FA_LIB"):
        raise
    pytest.skip("libfa not built (%s)" % e, allow_module_level=True)

SHAPES = {  # ragged lengths, not multiples of any block
    "mha": dict(B=2, Nq=193, Nk=193, H=4, Hkv=4),
    "gqa": dict(B=2, Nq=150, Nk=301, H=8, Hkv=2),
}
DTYPES = [torch.float16, torch.bfloat16]


def bshd(t, layout):
    return t if layout == "bshd" else t.transpose(1, 2)


def make_inputs(layout, B, Nq, Nk, H, Hkv, d, dtype, seed=0, dtype_in=None):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(n, h):
        shape = (B, n, h, d) if layout == "bshd" else (B, h, n, d)
        t = torch.randn(shape, generator=g, device="cuda")
        return t.to(dtype_in or dtype).requires_grad_()

    q, k, v = make(Nq, H), make(Nk, Hkv), make(Nk, Hkv)
    d_o = torch.randn(bshd(q, layout).shape, generator=g, device="cuda").to(dtype)
    return q, k, v, bshd(d_o, layout)


def check_all(name, layout, dtype, out, grads, q, k, v, d_o, causal):
    """O and the three gradients against the fp64 reference of the same 16-bit inputs."""
    ref = reference(*(bshd(t.to(dtype), layout) for t in (q, k, v)), bshd(d_o, layout),
                    causal=causal)
    o_ref, _, dq, dk, dv = ref
    check(name + " O", bshd(out, layout), o_ref, dtype, "output")
    for what, g, r in (("dQ", grads[0], dq), ("dK", grads[1], dk), ("dV", grads[2], dv)):
        check(name + " " + what, bshd(g, layout), r, dtype, "gradient")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_forward_and_gradients(dtype, causal, layout, shape, d):
    q, k, v, d_o = make_inputs(layout, d=d, dtype=dtype, **SHAPES[shape])
    out = fs.attention(q, k, v, causal=causal, layout=layout)
    assert out.shape == q.shape and out.dtype == dtype
    out.backward(d_o)
    check_all("default steps", layout, dtype, out, (q.grad, k.grad, v.grad), q, k, v, d_o,
              causal)


@pytest.mark.parametrize("step", fs.steps())
def test_every_step_trains(step):
    """Each forward through its backward (its own, else 07's), GQA, causal, SDPA's layout."""
    q, k, v, d_o = make_inputs("bhsd", d=64, dtype=torch.float16, **SHAPES["gqa"])
    out = fs.attention(q, k, v, causal=True, layout="bhsd", step=step)
    out.backward(d_o)
    check_all(step, "bhsd", torch.float16, out, (q.grad, k.grad, v.grad), q, k, v, d_o, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_rows_without_keys(dtype):
    """Causal with N_q > N_k: the first N_q - N_k rows see no key (O = 0, no gradient)."""
    q, k, v, d_o = make_inputs("bshd", B=1, Nq=300, Nk=100, H=4, Hkv=1, d=64, dtype=dtype)
    out = fs.attention(q, k, v, causal=True)
    out.backward(d_o)
    assert not out[:, :200].any() and not q.grad[:, :200].any()
    check_all("no-key rows", "bshd", dtype, out, (q.grad, k.grad, v.grad), q, k, v, d_o, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_drop_in_for_sdpa(dtype, causal):
    """Against scaled_dot_product_attention itself: its math backend in fp64 on the upcast
    inputs, [B, H, N, d], GQA by repeated K/V heads, N_q == N_k (where is_causal agrees)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, d_o = make_inputs("bhsd", B=2, Nq=256, Nk=256, H=8, Hkv=2, d=128, dtype=dtype)
    out = fs.attention(q, k, v, causal=causal, layout="bhsd")
    out.backward(d_o)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q64, k64.repeat_interleave(4, 1), v64.repeat_interleave(4, 1), is_causal=causal)
    ref.backward(d_o.double())
    check("sdpa O", out, ref.detach(), dtype, "output")
    for what, t, r in (("dQ", q, q64), ("dK", k, k64), ("dV", v, v64)):
        check("sdpa " + what, t.grad, r.grad, dtype, "gradient")


def test_output_gradients_of_any_strides():
    """out.sum() hands the backward a stride-0 gradient; a strided slice another layout."""
    q, k, v, _ = make_inputs("bhsd", d=64, dtype=torch.bfloat16, **SHAPES["gqa"])
    out = fs.attention(q, k, v, causal=True, layout="bhsd")
    (out.float().sum() + 3 * out[..., ::2].float().sum()).backward()
    d_o = torch.ones(out.shape, device="cuda")
    d_o[..., ::2] += 3
    check_all("strided dO", "bhsd", torch.bfloat16, out, (q.grad, k.grad, v.grad), q, k, v,
              d_o.bfloat16(), True)


def test_autocast_casts_fp32_inputs():
    """Under autocast, fp32 inputs run in the autocast dtype and get fp32 gradients back."""
    q, k, v, d_o = make_inputs("bhsd", d=64, dtype=torch.bfloat16, dtype_in=torch.float32,
                               **SHAPES["mha"])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fs.attention(q, k, v, causal=True, layout="bhsd")
    assert out.dtype == torch.bfloat16
    out.backward(d_o)
    assert q.grad.dtype == torch.float32
    check_all("autocast", "bhsd", torch.bfloat16, out, (q.grad, k.grad, v.grad), q, k, v, d_o,
              True)


def test_deterministic_backward_repeats_bit_for_bit():
    q, k, v, d_o = make_inputs("bshd", d=128, dtype=torch.float16, **SHAPES["gqa"])
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        fs.attention(q, k, v, causal=True, deterministic=True).backward(d_o)
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    check_all("deterministic", "bshd", torch.float16, fs.attention(q, k, v, causal=True),
              grads[0], q, k, v, d_o, True)


def test_inference_path_gives_the_same_output():
    q, k, v, _ = make_inputs("bshd", d=64, dtype=torch.float16, **SHAPES["gqa"])
    with torch.no_grad():
        out = fs.attention(q, k, v, causal=True)
    assert not out.requires_grad
    o_ref, _ = reference(q, k, v, causal=True)
    check("no_grad O", out, o_ref, torch.float16, "output")


def test_errors_of_the_c_api_surface():
    q, k, v, _ = make_inputs("bshd", B=1, Nq=64, Nk=64, H=4, Hkv=4, d=80, dtype=torch.float16)
    with pytest.raises(fs.Unsupported, match="head_dim 80 is not supported by step 06"):
        fs.attention(q, k, v)
    q, k, v, _ = make_inputs("bshd", B=1, Nq=64, Nk=64, H=4, Hkv=3, d=64, dtype=torch.float16)
    with pytest.raises(fs.InvalidArgument, match="multiple of heads_kv"):
        fs.attention(q, k, v)
    with pytest.raises(fs.InvalidArgument, match="is on cpu"):
        fs.attention(q.cpu(), k.cpu(), v.cpu())
