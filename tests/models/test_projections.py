"""linear.projections (attention's q, k and v as one autograd node) against three Linears
under autograd: the same outputs and weight / bias gradients bit for bit, dx to fp32
rounding (one GEMM plus addmm_ accumulations instead of three GEMMs and two adds), and a
sink's gradient written into its `.grad`."""

import pytest
import torch

from moegraph_cli import grads
from moegraph_cli.models.common.linear import Linear, projections


def _setup(bias, seed=0):
    torch.manual_seed(seed)
    lins = [Linear(24, n, bias=bias) for n in (32, 8, 8)]
    x = torch.randn(2, 5, 24)
    dys = [torch.randn(2, 5, n) for n in (32, 8, 8)]
    return lins, x, dys


def _grads(lins, x, dys, fn):
    for lin in lins:
        lin.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    outs = fn(xr)
    torch.autograd.backward(outs, dys)
    return [o.detach() for o in outs], xr.grad, [(lin.weight.grad, lin.bias.grad if
                                                  lin.bias is not None else None)
                                                 for lin in lins]


@pytest.mark.parametrize("bias", [False, True])
def test_projections_match_separate_linears(bias):
    lins, x, dys = _setup(bias)
    want = _grads(lins, x, dys, lambda xr: tuple(lin(xr) for lin in lins))
    got = _grads(lins, x, dys, lambda xr: projections(xr, lins))
    for g, w in zip(got[0], want[0]):
        assert torch.equal(g, w)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for (gw, gb), (ww, wb) in zip(got[2], want[2]):
        assert torch.equal(gw, ww)
        assert (gb is None and wb is None) or torch.equal(gb, wb)


def test_unused_projection_and_no_grad():
    lins, x, dys = _setup(True)
    xr = x.clone().requires_grad_()
    q, k, v = projections(xr, lins)
    q.sum().backward()  # k and v unused: zero gradients for theirs
    assert torch.equal(lins[1].weight.grad, torch.zeros_like(lins[1].weight))
    with torch.no_grad():
        outs = projections(x, lins)
    assert all(not o.requires_grad for o in outs)


@pytest.mark.parametrize("accumulate", [False, True])
def test_sink_weights_get_their_gradient_written(accumulate):
    lins, x, dys = _setup(True, seed=1)
    want = _grads(lins, x, dys, lambda xr: tuple(lin(xr) for lin in lins))[2]
    start = [torch.randn_like(lin.weight) for lin in lins]
    for lin, s in zip(lins, start):
        lin.weight.grad = s.clone()
        grads.sink(lin.weight)
    xr = x.clone().requires_grad_()
    with grads.backward_pass(accumulate=accumulate):
        torch.autograd.backward(projections(xr, lins), dys)
    for lin, s, (ww, _) in zip(lins, start, want):
        expect = s + ww if accumulate else ww
        torch.testing.assert_close(lin.weight.grad, expect, rtol=1e-6, atol=1e-6)
