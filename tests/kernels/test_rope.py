"""kernels/rope.py (Triton, interpreter on CPU, fp32) against rope_ref (attention.py's torch
math) and its autograd: rope alone bitwise, with the per-head RMSNorm within fp32 ulps; the
sink modes of the autograd Function (models/common/fused.py); bf16 and graphs on CUDA.

q is a head view of a NaN-padded [B*S, N*D + pad] projection buffer, the rope tables have
NaN rows past S, and the dW scratch is NaN-filled, so any stray read or unwritten partial shows.
"""

import math

import pytest
import torch

from moegraph_cli import grads
from moegraph_cli.models.common import fused
from moegraph_cli.models.common.rope import rope_cos_sin
from moegraph_kernels import rmsnorm, rope as K

EPS = 1e-6
SHAPES = [  # B, S, N, D
    (1, 1, 1, 12),  # one row; half = 6, not a power of two
    (2, 5, 3, 20),
    (2, 33, 5, 16),  # many rows: several row blocks per backward program
    (1, 4, 2, 128),
    (3, 2, 4, 2),  # the smallest head
]


@pytest.fixture(autouse=True)
def poisoned_scratch(monkeypatch):
    monkeypatch.setattr(rmsnorm, "SCRATCH_FILL", math.nan)


def _inputs(B, S, N, D, seed=0, pad=5):
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((B * S, N * D + pad), math.nan)
    buf[:, :N * D] = torch.randn(B * S, N * D, generator=g) * 2
    x = buf[:, :N * D].view(B, S, N, D)
    cos, sin = rope_cos_sin(S, D, 1000.0, torch.float32, "cpu")
    tables = [torch.full((S + 3, D), math.nan) for _ in range(2)]
    tables[0][:S], tables[1][:S] = cos, sin
    w = torch.randn(D, generator=g)
    dy = torch.randn(B, N, S, D, generator=g)
    return x, tables[0], tables[1], w, dy


def _reference(x, cos, sin, w, dy):
    xr = x.clone().requires_grad_()
    wr = None if w is None else w.clone().requires_grad_()
    y = K.rope_ref(xr, cos, sin, wr, EPS)
    y.backward(dy)
    return y.detach(), xr.grad, None if w is None else wr.grad


def _close(got, want, name):
    assert torch.isfinite(got).all(), f"{name} has non-finite values"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("B,S,N,D", SHAPES)
def test_rope_alone_is_bitwise_torchs(B, S, N, D):
    x, cos, sin, _, dy = _inputs(B, S, N, D, seed=S * D)
    y_ref, dx_ref, _ = _reference(x, cos, sin, None, dy)
    y, rstd = K.rope_forward(x, cos, sin)
    assert rstd is None and y.shape == (B, N, S, D) and y.is_contiguous()
    assert torch.equal(y, y_ref)
    dx, dw = K.rope_backward(dy, None, cos, sin)
    assert dw is None and dx.shape == (B, S, N, D) and dx.is_contiguous()
    assert torch.equal(dx, dx_ref)


@pytest.mark.parametrize("B,S,N,D", SHAPES)
def test_bsnd_layout_holds_the_same_values(B, S, N, D):
    """layout="bsnd": the same y, as the [B, N, S, D] view of a contiguous [B, S, N, D]."""
    x, cos, sin, w, _ = _inputs(B, S, N, D, seed=S * N)
    for weight in (None, w):
        want, rstd_want = K.rope_forward(x, cos, sin, weight, EPS)
        got, rstd = K.rope_forward(x, cos, sin, weight, EPS, layout="bsnd")
        assert got.shape == (B, N, S, D) and got.transpose(1, 2).is_contiguous()
        assert torch.equal(got, want)
        assert (rstd is None) == (weight is None)
        assert rstd is None or torch.equal(rstd, rstd_want)


def test_unknown_layout_is_refused():
    x, cos, sin, _, _ = _inputs(1, 2, 1, 4)
    with pytest.raises(ValueError, match="layout must be one of"):
        K.rope_forward(x, cos, sin, layout="bshd")


@pytest.mark.parametrize("B,S,N,D", SHAPES)
def test_norm_then_rope_matches_reference_autograd(B, S, N, D):
    x, cos, sin, w, dy = _inputs(B, S, N, D, seed=S + D)
    y_ref, dx_ref, dw_ref = _reference(x, cos, sin, w, dy)
    y, rstd = K.rope_forward(x, cos, sin, w, EPS)
    _close(y, y_ref, "y")
    _close(rstd, torch.rsqrt(x.pow(2).mean(-1) + EPS).reshape(-1), "rstd")
    dx, dw = K.rope_backward(dy, x, cos, sin, w, rstd)
    _close(dx, dx_ref, "dx")
    _close(dw, dw_ref, "dw")


def test_strided_gradient_and_runs_are_bitwise_equal():
    """dy in another layout ([B, S, N, D] memory seen as [B, N, S, D]); two runs agree."""
    x, cos, sin, w, dy = _inputs(2, 33, 5, 16, seed=9)
    dy = dy.transpose(1, 2).contiguous().transpose(1, 2)
    _, dx_ref, dw_ref = _reference(x, cos, sin, w, dy)
    outs = []
    for _ in range(2):
        y, rstd = K.rope_forward(x, cos, sin, w, EPS)
        outs.append((y, rstd, *K.rope_backward(dy, x, cos, sin, w, rstd)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    _close(outs[0][2], dx_ref, "dx")
    _close(outs[0][3], dw_ref, "dw")


@pytest.mark.parametrize("rows,per_sm,warps", [(8, 1, 2), (16, 4, 4), (64, 1024, 8)])
def test_tilings_give_the_same_outputs(rows, per_sm, warps):
    """Another forward tile gives y and rstd within ulps (the sum of squares in another
    order), another backward tiling the same dx bitwise (from the same rstd) and dW within
    fp32 ulps, with dW summed per row lane or per block; the poisoned scratch shows an
    unwritten partial."""
    x, cos, sin, w, dy = _inputs(2, 33, 5, 16, seed=4)
    y, rstd = K.rope_forward(x, cos, sin, w, EPS)
    y2, rstd2 = K.rope_forward(x, cos, sin, w, EPS, rows=rows, num_warps=warps)
    _close(y2, y, "y")
    _close(rstd2, rstd, "rstd")
    dx, dw = K.rope_backward(dy, x, cos, sin, w, rstd)
    for lanes in (False, True):
        dx2, dw2 = K.rope_backward(dy, x, cos, sin, w, rstd, rows=rows, programs_per_sm=per_sm,
                                   num_warps=warps, dw_lanes=lanes)
        assert torch.equal(dx, dx2)
        _close(dw2, dw, "dw")


@pytest.mark.parametrize("accumulate", [False, True])
def test_sink_weight_grad_is_written_or_accumulated(accumulate):
    x, cos, sin, w, dy = _inputs(2, 9, 3, 12, seed=3)
    _, dx_ref, dw_ref = _reference(x, cos, sin, w, dy)
    weight = torch.nn.Parameter(w.clone())
    weight.grad = torch.full_like(w, 0.25 if accumulate else math.nan)
    grads.sink(weight)
    grad_ptr = weight.grad.data_ptr()
    xr = x.clone().requires_grad_()
    with grads.backward_pass(accumulate=accumulate):
        fused.rope(xr, cos, sin, weight, EPS).backward(dy)
    assert weight.grad.data_ptr() == grad_ptr
    _close(weight.grad, dw_ref + 0.25 if accumulate else dw_ref, "w.grad")
    _close(xr.grad, dx_ref, "dx")


def test_plain_parameter_and_rope_only_through_autograd():
    x, cos, sin, w, dy = _inputs(1, 6, 2, 8, seed=7)
    _, dx_ref, dw_ref = _reference(x, cos, sin, w, dy)
    weight = torch.nn.Parameter(w.clone())
    xr = x.clone().requires_grad_()
    fused.rope(xr, cos, sin, weight, EPS).backward(dy)
    _close(weight.grad, dw_ref, "w.grad")
    _close(xr.grad, dx_ref, "dx")
    _, dx_ref, _ = _reference(x, cos, sin, None, dy)
    xr = x.clone().requires_grad_()
    fused.rope(xr, cos, sin).backward(dy)
    assert torch.equal(xr.grad, dx_ref)


# -- CUDA (bf16), to run on a GPU -----------------------------------------------------------
def _cuda_inputs(B, S, N, D, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B * S, N * D, device="cuda", generator=g).to(dtype).view(B, S, N, D)
    cos, sin = rope_cos_sin(S, D, 1e6, dtype, "cuda")
    w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(dtype)
    dy = torch.randn(B, N, S, D, device="cuda", generator=g).to(dtype)
    return x, cos, sin, w, dy


@pytest.mark.cuda
@pytest.mark.parametrize("B,S,N,D", [(1, 1024, 32, 128), (1, 1024, 4, 128), (2, 37, 3, 64)])
def test_cuda_bf16_matches_unfused(B, S, N, D):
    x, cos, sin, w, dy = _cuda_inputs(B, S, N, D)
    y_ref, dx_ref, _ = _reference(x, cos, sin, None, dy)  # rope alone: torch's roundings
    y, _ = K.rope_forward(x, cos, sin)
    dx, _ = K.rope_backward(dy, None, cos, sin)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    y_bf, dx_bf, dw_bf = _reference(x, cos, sin, w, dy)
    exact = _reference(x.float(), cos.float(), sin.float(), w.float(), dy.float())
    y, rstd = K.rope_forward(x, cos, sin, w, EPS)
    dx, dw = K.rope_backward(dy, x, cos, sin, w, rstd)
    for name, got, unfused, ex in zip(("y", "dx", "dw"), (y, dx, dw), (y_bf, dx_bf, dw_bf),
                                      exact):
        err = (got.float() - ex).abs().max().item()
        err_unfused = (unfused.float() - ex).abs().max().item()
        assert err <= 2 * err_unfused + 1e-6, (name, err, err_unfused)
        torch.testing.assert_close(got, unfused, rtol=2 ** -7, atol=2 ** -7 * ex.abs().max())
    assert (y != y_bf).float().mean().item() < 0.01


@pytest.mark.cuda
def test_cuda_graph_replay_is_bitwise_eager():
    x, cos, sin, w, dy = _cuda_inputs(2, 256, 8, 128)
    weight = torch.nn.Parameter(w.clone())
    weight.grad = torch.zeros_like(weight)
    grads.sink(weight)

    def step():
        xr = x.detach().requires_grad_()
        with grads.backward_pass(accumulate=False):
            y = fused.rope(xr, cos, sin, weight, EPS)
            y.backward(dy)
        return y.detach(), xr.grad

    y_e, dx_e = step()
    dw_e = weight.grad.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, dx_g = step()
    weight.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_g, y_e) and torch.equal(dx_g, dx_e) and torch.equal(weight.grad, dw_e)
