"""flash_steps.attention on the CPU: the autograd plumbing with stand-in kernels.

Skipped without torch. The kernels cannot run here, so ``forward_into`` and ``backward_into``
are replaced by an fp64 stand-in (attention_reference.reference) that writes into the tensors
the autograd function allocated, and records what it was handed. Everything else is the real
code: argument checks, layouts, the choice between a strided view and a copy, saving for
backward, output-gradient handling, the GQA shapes of dK and dV. Where libfa is built, every
tensor handed to a stand-in also goes through the C API's own checks (fa_check_forward,
fa_check_backward) with its real address and strides, so a view that the real kernels would
refuse fails here. The GPU tests (test_attention_gpu.py) check the real kernels' numbers.
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import flash_steps as fs  # noqa: E402
from flash_steps import autograd  # noqa: E402
from attention_reference import install_stand_in, reference  # noqa: E402

@pytest.fixture
def stand_in(monkeypatch):
    return install_stand_in(monkeypatch)


def inputs(layout="bshd", B=2, Nq=37, Nk=53, H=4, Hkv=2, d=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(n, h):
        shape = (B, n, h, d) if layout == "bshd" else (B, h, n, d)
        return torch.randn(shape, generator=g).to(dtype).requires_grad_()

    return make(Nq, H), make(Nk, Hkv), make(Nk, Hkv)


def bshd(t, layout):
    return t if layout == "bshd" else t.transpose(1, 2)


def expected(q, k, v, layout, causal, d_o):
    """Reference output and gradients in the caller's layout."""
    o, _, dq, dk, dv = reference(*(bshd(t, layout) for t in (q, k, v)), bshd(d_o, layout),
                                 causal=causal)
    return [bshd(t, layout) for t in (o, dq, dk, dv)]


def close(a, b):
    """Equal up to a few roundings of a's dtype (the stand-in computes in fp64)."""
    tol = 4 * torch.finfo(a.dtype).eps if a.dtype in (torch.float16, torch.bfloat16) else 1e-6
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


# --- the autograd path --------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_and_gradients_in_the_callers_layout(stand_in, layout, causal, dtype):
    q, k, v = inputs(layout, dtype=dtype)
    out = fs.attention(q, k, v, causal=causal, layout=layout)
    assert out.shape == q.shape and out.dtype == dtype
    d_o = torch.randn(out.shape).to(dtype)
    out.backward(d_o)
    o_ref, dq, dk, dv = expected(q, k, v, layout, causal, d_o)
    assert close(out, o_ref)
    for name, t, ref in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        assert t.grad.shape == t.shape and t.grad.dtype == dtype, name
        assert close(t.grad, ref), name
    kinds = [c[0] for c in stand_in.calls]
    assert kinds == ["forward", "backward"]
    assert stand_in.calls[0][1] == fs.DEFAULT_STEP
    assert stand_in.calls[1][1] == autograd.backward_step_for(fs.DEFAULT_STEP)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_contiguous_inputs_reach_the_kernels_without_a_copy(stand_in, layout):
    q, k, v = inputs(layout)
    fs.attention(q, k, v, causal=True, layout=layout).sum().backward()
    for kind, _, seen in stand_in.calls:
        for name, t in (("q", q), ("k", k), ("v", v)):
            assert seen[name].data_ptr() == t.data_ptr(), (kind, name)
            assert seen[name].stride() == bshd(t, layout).stride(), (kind, name)


def test_packed_qkv_slices_are_views_not_copies(stand_in):
    B, N, H, d = 2, 40, 4, 64
    qkv = torch.randn(B, N, 3, H, d).half().requires_grad_()
    q, k, v = qkv.unbind(2)
    out = fs.attention(q, k, v, causal=True)
    seen = stand_in.calls[0][2]
    assert seen["k"].data_ptr() == qkv.data_ptr() + H * d * 2
    assert seen["q"].stride() == (N * 3 * H * d, 3 * H * d, d, 1)
    d_o = torch.randn(out.shape).half()
    out.backward(d_o)
    o_ref, dq, dk, dv = expected(q, k, v, "bshd", True, d_o)
    assert close(qkv.grad, torch.stack([dq, dk, dv], 2))


@pytest.mark.parametrize("make", [
    lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),  # last dim not contiguous
    lambda t: torch.randn(*t.shape[:3], t.shape[3] + 1).half()[..., 1:],  # rows 2-byte offset
    lambda t: t[:, :, :1].expand(t.shape),  # broadcast heads: head stride 0
], ids=["strided_last_dim", "misaligned", "broadcast"])
def test_illegal_strides_are_copied(stand_in, make):
    q, k, v = inputs(Hkv=4)
    k2 = make(k.detach())
    assert not autograd._kernel_ready(k2)
    out = fs.attention(q, k2, v, causal=False)
    d_o = torch.randn(out.shape).half()
    out.backward(d_o)
    for kind, _, seen in stand_in.calls:
        assert seen["k"].is_contiguous() and seen["k"].data_ptr() != k2.data_ptr(), kind
        assert torch.equal(seen["k"], k2), kind
    o_ref, dq, _, _ = expected(q, k2, v, "bshd", False, d_o)
    assert close(out, o_ref) and close(q.grad, dq)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_output_gradient_of_any_strides(stand_in, layout):
    """out.sum() gives a stride-0 gradient, out[..., ::2] a strided one: both must arrive as
    legal tensors with the right values."""
    q, k, v = inputs(layout)
    out = fs.attention(q, k, v, layout=layout)
    (out.sum() + 3 * out[..., ::2].float().sum()).backward()
    d_o = torch.ones(out.shape)
    d_o[..., ::2] += 3
    _, dq, dk, dv = expected(q, k, v, layout, False, d_o.half())
    for t, ref in ((q, dq), (k, dk), (v, dv)):
        assert close(t.grad, ref)
    assert stand_in.calls[1][2]["d_o"].stride()[3] == 1


def test_gqa_gradients_sum_over_the_group(stand_in):
    q, k, v = inputs(H=6, Hkv=2)
    out = fs.attention(q, k, v)
    d_o = torch.randn(out.shape).half()
    out.backward(d_o)
    assert k.grad.shape == k.shape and v.grad.shape == v.shape
    _, _, dk, dv = expected(q, k, v, "bshd", False, d_o)
    assert close(k.grad, dk) and close(v.grad, dv)


def test_only_some_inputs_require_grad(stand_in):
    q, k, v = inputs()
    k = k.detach()
    fs.attention(q, k, v).sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None


def test_inference_runs_the_forward_only_without_lse(stand_in):
    q, k, v = inputs()
    with torch.no_grad():
        out = fs.attention(q, k, v, causal=True)
    assert not out.requires_grad
    assert [c[0] for c in stand_in.calls] == ["forward"]
    assert stand_in.calls[0][2]["lse"] is None
    q2, k2, v2 = (t.detach() for t in (q, k, v))
    out2 = fs.attention(q2, k2, v2, causal=True)  # nothing requires grad: same path
    assert stand_in.calls[1][2]["lse"] is None and torch.equal(out, out2)


def test_steps_are_passed_through(stand_in):
    q, k, v = inputs()
    fs.attention(q, k, v, step="01_naive", backward_step="07_backward",
                 deterministic=True).sum().backward()
    assert [c[1] for c in stand_in.calls] == ["01_naive", "07_backward"]


def test_inplace_change_of_a_saved_input_is_caught(stand_in):
    q, k, v = inputs()
    q2 = q * 1  # non-leaf, so it may be changed in place
    out = fs.attention(q2, k, v)
    q2.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_no_double_backward(stand_in):
    q, k, v = inputs()
    out = fs.attention(q, k, v)
    w = torch.randn(out.shape).half().requires_grad_()
    (g,) = torch.autograd.grad(out, q, grad_outputs=w, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|twice"):
        g.float().sum().backward()


# --- argument checks (no kernel runs) -----------------------------------------------------


def test_cpu_tensors_are_refused_with_a_clear_message():
    q, k, v = inputs()
    with pytest.raises(fs.InvalidArgument, match="q is on cpu; .* CUDA tensors"):
        fs.attention(q, k, v)


def test_bad_layout():
    q, k, v = inputs()
    with pytest.raises(fs.InvalidArgument, match="layout must be one of 'bshd', 'bhsd'"):
        fs.attention(q, k, v, layout="BSHD")


def test_rank_and_type():
    q, k, v = inputs()
    with pytest.raises(fs.InvalidArgument, match="q must be 4-D"):
        fs.attention(q[0], k, v)
    with pytest.raises(fs.InvalidArgument, match="v must be a torch.Tensor"):
        fs.attention(q, k, v.tolist())


def test_shapes_must_agree():
    q, k, v = inputs()
    with pytest.raises(fs.InvalidArgument, match="k has shape .* but v has"):
        fs.attention(q, k, v[:, :-1])
    with pytest.raises(fs.InvalidArgument, match="same batch and head_dim"):
        fs.attention(q[:1], k, v)
    qh, kh, vh = inputs("bhsd")
    with pytest.raises(fs.InvalidArgument, match="layout 'bshd'"):
        fs.attention(qh, kh[:, :, :, :32], vh[:, :, :, :32])  # head_dim differs


def test_dtypes():
    q, k, v = inputs()
    with pytest.raises(fs.Unsupported, match="q has dtype float32; .*float16 or bfloat16"):
        fs.attention(q.float(), k, v)
    with pytest.raises(fs.Unsupported, match="k has dtype float64"):
        fs.attention(q, k.double(), v)
    with pytest.raises(fs.InvalidArgument, match="one dtype"):
        fs.attention(q, k.bfloat16(), v)


def test_layout_helpers():
    t = torch.zeros(2, 3, 4, 8)
    assert autograd._to_bshd(t, "bhsd").shape == (2, 4, 3, 8)
    assert autograd._from_bshd(autograd._to_bshd(t, "bhsd"), "bhsd").stride() == t.stride()
    assert autograd._kernel_ready(t.half())
    assert not autograd._kernel_ready(t.half()[:, :, :, 1:])  # misaligned and d=7
