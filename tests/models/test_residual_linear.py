"""Linear(x, residual=r) (linear.residual_linear: r + x @ w^T as one GEMM with beta = 1)
against the add after F.linear: the output within one rounding, dr = dy itself, dx and dW the
same products autograd forms, a sink weight's gradient written into its `.grad`; with a bias
or MOEGRAPH_RESIDUAL_GEMM off, the add after the GEMM, bit for bit."""

import pytest
import torch

import moegraph_cli.models.common.linear as lin_mod
from moegraph_cli import grads
from moegraph_cli.models.common.linear import Linear


@pytest.fixture(autouse=True)
def _fused(monkeypatch):
    monkeypatch.setattr(lin_mod, "RESIDUAL_GEMM", True)


def _case(bias=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = Linear(24, 16, bias=bias).to(dtype)
    x = torch.randn(2, 5, 24, dtype=dtype)
    r = torch.randn(2, 5, 16, dtype=dtype)
    dy = torch.randn(2, 5, 16, dtype=dtype)
    return lin, x, r, dy


def _run(lin, x, r, dy, fused: bool):
    lin.zero_grad(set_to_none=True)
    xr, rr = x.clone().requires_grad_(), r.clone().requires_grad_()
    out = lin(xr, residual=rr) if fused else rr + lin(xr)
    out.backward(dy)
    return out.detach(), xr.grad, rr.grad, lin.weight.grad


def test_the_residual_rides_the_gemm():
    lin, x, r, dy = _case(dtype=torch.float64)
    got, want = _run(lin, x, r, dy, True), _run(lin, x, r, dy, False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-14, atol=1e-14)
    assert torch.equal(got[2], dy)  # the residual's gradient is dy, not a copy's sum
    assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])


def test_bf16_on_the_cpu_rounds_once():
    lin, x, r, dy = _case(dtype=torch.bfloat16, seed=1)
    got = _run(lin, x, r, dy, True)[0]
    exact = r.double() + x.double() @ lin.weight.detach().double().t()
    once = (r.float() + x.float() @ lin.weight.detach().float().t()).to(torch.bfloat16)
    torch.testing.assert_close(got.double(), exact, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got, once, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("bias,switch", [(True, True), (False, False)])
def test_with_a_bias_or_switched_off_the_add_follows_the_gemm(bias, switch, monkeypatch):
    monkeypatch.setattr(lin_mod, "RESIDUAL_GEMM", switch)
    lin, x, r, dy = _case(bias=bias, seed=2)
    got, want = _run(lin, x, r, dy, True), _run(lin, x, r, dy, False)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_sink_weight_gets_its_gradient_written(accumulate):
    lin, x, r, dy = _case(seed=3)
    want = _run(lin, x, r, dy, True)[3]
    start = torch.randn_like(lin.weight)
    lin.weight.grad = start.clone()
    grads.sink(lin.weight)
    try:
        with grads.backward_pass(accumulate=accumulate):
            xr = x.clone().requires_grad_()
            lin(xr, residual=r).backward(dy)
    finally:
        grads.sink(lin.weight, False)
    torch.testing.assert_close(lin.weight.grad, want + start if accumulate else want,
                               rtol=1e-6, atol=1e-6)


def test_no_grad_gives_the_same_values():
    lin, x, r, _ = _case(seed=4)
    with torch.no_grad():
        got = lin(x, residual=r)
    assert not got.requires_grad
    assert torch.equal(got, lin(x, residual=r).detach())
