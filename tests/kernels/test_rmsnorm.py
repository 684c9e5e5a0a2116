"""kernels/rmsnorm.py (Triton, interpreter on CPU, fp32) against rms_norm_ref and its autograd;
the sink modes of the autograd Function (models/common/fused.py); bf16 on CUDA.

Inputs are column slices of NaN-filled buffers and the dW scratch is NaN-filled
(`SCRATCH_FILL`), so a padding column read, or a partial left unwritten, shows as non-finite.
"""

import math

import pytest
import torch

from moegraph_cli import grads
from moegraph_cli.models.common import fused
from moegraph_kernels import rmsnorm as K

EPS = 1e-6
SHAPES = [  # leading dims, D
    ((1,), 33),  # one row, odd D
    ((7,), 64),
    ((2, 3, 5), 100),  # [..., D], not a power of two
    ((300,), 24),  # many rows: several row blocks per backward program
    ((5,), 2048),
    ((3,), 8192),
]


@pytest.fixture(autouse=True)
def poisoned_scratch(monkeypatch):
    monkeypatch.setattr(K, "SCRATCH_FILL", math.nan)


def _inputs(lead, D, seed=0, pad=3):
    g = torch.Generator().manual_seed(seed)
    rows = math.prod(lead)
    buf = torch.full((rows, D + pad), math.nan)
    buf[:, :D] = torch.randn(rows, D, generator=g) * 2
    x = buf[:, :D].view(*lead, D)  # row stride D + pad; NaN past D
    w = torch.randn(D, generator=g)
    dy = torch.randn(*lead, D, generator=g)
    return x, w, dy


def _reference(x, w, dy):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = K.rms_norm_ref(xr, wr, EPS)
    y.backward(dy)
    return y.detach(), xr.grad, wr.grad


def _close(got, want, name):
    assert torch.isfinite(got).all(), f"{name} has non-finite values"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("lead,D", SHAPES)
def test_forward_backward_match_reference_autograd(lead, D):
    x, w, dy = _inputs(lead, D, seed=D)
    y_ref, dx_ref, dw_ref = _reference(x, w, dy)
    y, rstd = K.rms_norm_forward(x, w, EPS)
    assert y.shape == x.shape and y.is_contiguous()
    _close(y, y_ref, "y")
    _close(rstd, torch.rsqrt(x.pow(2).mean(-1) + EPS).reshape(-1), "rstd")
    dx, dw = K.rms_norm_backward(dy, x, w, rstd)
    _close(dx, dx_ref, "dx")
    _close(dw, dw_ref, "dw")


def test_rounding_points_are_torchs_in_fp32():
    """A power-of-two D small enough that the sums agree: y comes out bitwise."""
    x, w, dy = _inputs((9,), 4, seed=1)
    y, _ = K.rms_norm_forward(x, w, EPS)
    assert torch.equal(y, _reference(x, w, dy)[0])


def test_runs_are_bitwise_equal():
    x, w, dy = _inputs((300,), 24, seed=4)
    outs = []
    for _ in range(2):
        y, rstd = K.rms_norm_forward(x, w, EPS)
        outs.append((y, rstd, *K.rms_norm_backward(dy, x, w, rstd)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_backward_without_weight_grad_and_with_no_rows():
    x, w, dy = _inputs((4,), 10)
    _, dx_ref, _ = _reference(x, w, dy)
    y, rstd = K.rms_norm_forward(x, w, EPS)
    dx, dw = K.rms_norm_backward(dy, x, w, rstd, need_dw=False)
    assert dw is None
    _close(dx, dx_ref, "dx")
    empty = torch.empty(0, 10)
    y0, rstd0 = K.rms_norm_forward(empty, w, EPS)
    dx0, dw0 = K.rms_norm_backward(empty, empty, w, rstd0)
    assert y0.shape == (0, 10) and dx0.shape == (0, 10) and torch.equal(dw0, torch.zeros(10))


@pytest.mark.parametrize("accumulate", [False, True])
def test_sink_weight_grad_is_written_or_accumulated(accumulate):
    x, w, dy = _inputs((2, 13), 40, seed=3)
    _, dx_ref, dw_ref = _reference(x, w, dy)
    weight = torch.nn.Parameter(w.clone())
    weight.grad = torch.full_like(w, 0.25 if accumulate else math.nan)
    grads.sink(weight)
    grad_ptr = weight.grad.data_ptr()
    xr = x.clone().requires_grad_()
    with grads.backward_pass(accumulate=accumulate):
        fused.rms_norm(xr, weight, EPS).backward(dy)
    assert weight.grad.data_ptr() == grad_ptr  # written in place, never replaced
    _close(weight.grad, dw_ref + 0.25 if accumulate else dw_ref, "w.grad")
    _close(xr.grad, dx_ref, "dx")


def test_sink_used_twice_in_one_pass_adds_the_second():
    x, w, dy = _inputs((6,), 24, seed=5)
    _, _, dw_ref = _reference(x, w, dy)
    weight = torch.nn.Parameter(w.clone())
    weight.grad = torch.full_like(w, math.nan)
    grads.sink(weight)
    with grads.backward_pass(accumulate=False):
        (fused.rms_norm(x, weight, EPS) + fused.rms_norm(x, weight, EPS)).backward(dy)
    _close(weight.grad, 2 * dw_ref, "w.grad")


def test_plain_parameter_gets_autograds_gradient():
    x, w, dy = _inputs((5,), 24, seed=6)
    _, dx_ref, dw_ref = _reference(x, w, dy)
    weight = torch.nn.Parameter(w.clone())
    xr = x.clone().requires_grad_()
    fused.rms_norm(xr, weight, EPS).backward(dy)
    _close(weight.grad, dw_ref, "w.grad")
    _close(xr.grad, dx_ref, "dx")


# -- CUDA (bf16), to run on a GPU -----------------------------------------------------------
@pytest.mark.parametrize("lead,D", SHAPES)
def test_skip_gradient_is_added_as_autograd_adds_it(lead, D):
    """dres (a skip connection's gradient, here a strided view) is added to dx in the kernel:
    the same bits as dx rounded to x's dtype plus dres (torch's add), every element written."""
    x, w, dy = _inputs(lead, D, seed=D + 1)
    dres = _inputs(lead, D, seed=D + 2)[0]
    _, rstd = K.rms_norm_forward(x, w, EPS)
    dx, dw = K.rms_norm_backward(dy, x, w, rstd)
    dx_res, dw_res = K.rms_norm_backward(dy, x, w, rstd, dres=dres)
    assert torch.equal(dx_res, dx + dres) and torch.equal(dw_res, dw)
    with pytest.raises(ValueError, match="dres is"):
        K.rms_norm_backward(dy, x, w, rstd, dres=dres.double())


@pytest.mark.parametrize("lead,D", SHAPES)
def test_second_gradient_is_summed_as_autograd_sums_it(lead, D):
    """dy2 (a second consumer's gradient of y, a strided view) is summed with dy in the kernel:
    the same bits as the backward of torch's dy + dy2, with or without a skip's dres."""
    x, w, dy = _inputs(lead, D, seed=D + 3)
    dy2 = _inputs(lead, D, seed=D + 4)[0] * 3
    dres = _inputs(lead, D, seed=D + 5)[0]
    _, rstd = K.rms_norm_forward(x, w, EPS)
    for res in (None, dres):
        dx, dw = K.rms_norm_backward(dy + dy2, x, w, rstd, dres=res)
        dx2, dw2 = K.rms_norm_backward(dy, x, w, rstd, dres=res, dy2=dy2)
        assert torch.isfinite(dx2).all() and torch.equal(dx2, dx) and torch.equal(dw2, dw)
    with pytest.raises(ValueError, match="dy2 is"):
        K.rms_norm_backward(dy, x, w, rstd, dy2=dy2.double())
    with pytest.raises(ValueError, match="dy2 is"):
        K.rms_norm_backward(dy, x, w, rstd, dy2=dy2[..., :-1])


@pytest.mark.parametrize("fork_on", [True, False])
@pytest.mark.parametrize("used", ["both", "first", "second"])
def test_norm_fork_matches_the_norm_and_autograds_adds(fork_on, used, monkeypatch):
    """norm.rms_norm_fork on the kernels: both outputs y, and x.grad / w.grad of
    `x + f(y) + g(y')`, bitwise those of the norm alone with autograd summing the three
    gradients (an unused output contributes nothing); MOEGRAPH_NORM_FORK=0 the same bits."""
    from moegraph_cli.models.common import norm
    monkeypatch.setattr(fused, "ON_CPU", True)
    monkeypatch.setattr(fused, "NORM_SKIP", True)
    x, w, _ = _inputs((4, 6), 48, seed=5)
    gen = torch.Generator().manual_seed(6)
    d1, d2 = torch.randn(4, 6, 48, generator=gen), torch.randn(4, 6, 48, generator=gen)

    def run(fn):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y1, y2, skip = fn(xr, wr)
        out = skip + (y1 * d1 if used != "second" else 0) + (y2.exp() if used != "first" else 0)
        out.backward(torch.ones_like(out))
        return y1.detach(), y2.detach(), xr.grad, wr.grad

    def plain(xr, wr):
        y = norm.rms_norm(xr, wr, EPS)
        return y, y, xr

    want = run(plain)
    monkeypatch.setattr(fused, "NORM_FORK", fork_on)
    got = run(lambda xr, wr: norm.rms_norm_fork(xr, wr, EPS))
    for g, w_ in zip(got, want):
        assert torch.equal(g, w_)
    with pytest.raises(ValueError, match="fork=True needs skip=True"):
        norm.RMSNorm(48, EPS)(x, fork=True)


@pytest.mark.parametrize("skip_used", [True, False])
def test_norm_with_skip_matches_the_norm_and_autograds_add(skip_used, monkeypatch):
    """norm.rms_norm_skip on the kernels: y, and x.grad / w.grad of `x + f(norm(x))`, bitwise
    those of the norm alone with autograd adding the skip's gradient (and with an unused skip,
    the norm's gradient alone)."""
    from moegraph_cli.models.common import norm
    monkeypatch.setattr(fused, "ON_CPU", True)
    x, w, dy = _inputs((4, 6), 48, seed=3)
    dout = torch.randn(4, 6, 48, generator=torch.Generator().manual_seed(4))

    def run(fn):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, skip = fn(xr, wr)
        out = (y * 1.5 + skip) if skip_used else y * 1.5
        out.backward(dout)
        return y.detach(), xr.grad, wr.grad

    want = run(lambda xr, wr: (norm.rms_norm(xr, wr, EPS), xr))
    monkeypatch.setattr(fused, "NORM_SKIP", True)
    got = run(lambda xr, wr: norm.rms_norm_skip(xr, wr, EPS))
    for g, w_ in zip(got, want):
        assert torch.equal(g, w_)
    monkeypatch.setattr(fused, "NORM_SKIP", False)
    off = run(lambda xr, wr: norm.rms_norm_skip(xr, wr, EPS))
    for g, w_ in zip(off, want):
        assert torch.equal(g, w_)


@pytest.mark.cuda
@pytest.mark.parametrize("rows,D", [(1024, 2048), (32768, 128), (777, 8192), (5, 100)])
def test_cuda_bf16_matches_unfused(rows, D):
    """The kernel's bf16 error against the fp32 reference is at most about the unfused bf16
    path's, and the two differ in at most a bf16 ulp or so (the sums' order)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, D, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(rows, D, device="cuda", generator=g).bfloat16()
    y_bf, dx_bf, dw_bf = _reference(x, w, dy)
    y32, dx32, dw32 = _reference(x.float(), w.float(), dy.float())
    y, rstd = K.rms_norm_forward(x, w, EPS)
    dx, dw = K.rms_norm_backward(dy, x, w, rstd)
    for name, got, unfused, exact in (("y", y, y_bf, y32), ("dx", dx, dx_bf, dx32),
                                      ("dw", dw, dw_bf, dw32)):
        err = (got.float() - exact).abs().max().item()
        err_unfused = (unfused.float() - exact).abs().max().item()
        assert err <= 2 * err_unfused + 1e-6, (name, err, err_unfused)
        torch.testing.assert_close(got, unfused, rtol=2 ** -7, atol=2 ** -7 * exact.abs().max())
    # y: the same roundings; only r's sum order differs, which moves few elements.
    assert (y != y_bf).float().mean().item() < 0.01


@pytest.mark.cuda
def test_cuda_graph_replay_is_bitwise_eager():
    x = torch.randn(1024, 2048, device="cuda").bfloat16()
    dy = torch.randn_like(x)
    weight = torch.nn.Parameter(torch.randn(2048, device="cuda").bfloat16())
    weight.grad = torch.zeros_like(weight)
    grads.sink(weight)

    def step():
        xr = x.detach().requires_grad_()
        with grads.backward_pass(accumulate=False):
            y = fused.rms_norm(xr, weight, EPS)
            y.backward(dy)
        return y.detach(), xr.grad

    y_e, dx_e = step()
    dw_e = weight.grad.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, dx_g = step()
    weight.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_g, y_e) and torch.equal(dx_g, dx_e) and torch.equal(weight.grad, dw_e)
