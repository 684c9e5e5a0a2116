"""The one-pass loss (cross_entropy_fused, linear_cross_entropy's grad_scale, the trainers'
loss_grad) against the two-kernel path it replaces: the same bits where the backward gets the
gradient the forward was told of, the same values otherwise. Both paths: the Triton kernel
(under the interpreter on CPU, fp32 only there) and the pure-torch one."""

import math

import pytest
import torch

from moegraph_cli import grads
from moegraph_cli.models.common.loss import linear_cross_entropy
from moegraph_kernels.cross_entropy import (cross_entropy_backward, cross_entropy_backward_ref,
                                            cross_entropy_forward, cross_entropy_forward_ref,
                                            cross_entropy_fused, cross_entropy_fused_ref)

from test_loss import DEV, IMPLS, _case, _close, _reference

FWD = {"triton": cross_entropy_forward, "reference": cross_entropy_forward_ref}
BWD = {"triton": cross_entropy_backward, "reference": cross_entropy_backward_ref}


def _fused_kernel(impl, logits, labels, n_valid, scale, programs):
    if impl == "reference":
        return cross_entropy_fused_ref(logits, labels, n_valid, scale)
    return cross_entropy_fused(logits, labels, n_valid, scale, block_v=64, programs=programs)


@pytest.mark.parametrize("programs", [1, 5, 33])
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_kernel_is_the_two_kernels_bits_and_touches_nothing_else(impl, programs):
    T, V, pad = 33, 257, 7
    _, _, labels = _case(T, V, seed=11)
    ignored = labels == -100
    logits = torch.randn(T, V, generator=torch.Generator().manual_seed(11)).to(DEV) * 3
    n_valid = (~ignored).sum()
    scale = 0.25

    want_logits = logits.clone()
    kw = {} if impl == "reference" else {"block_v": 64}
    want_lse, want_loss = FWD[impl](want_logits, labels, **kw)
    want = BWD[impl](want_logits, labels, want_lse, torch.tensor(scale, device=DEV), n_valid,
                     **kw)

    buf = torch.full((T, V + pad), math.nan, device=DEV)  # a row stride past V
    buf[:, :V] = logits
    buf[ignored] = math.nan  # an ignored row is never read
    lse, loss = _fused_kernel(impl, buf[:, :V], labels, n_valid, scale, programs)
    assert torch.equal(lse, want_lse) and torch.equal(loss, want_loss)
    assert torch.equal(buf[:, :V], want), "dlogits differ from the backward kernel's"
    assert (buf[ignored][:, :V] == 0).all()
    assert buf[:, V:].isnan().all(), "a padding column was written"


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_kernel_on_no_rows_and_a_label_out_of_range(impl):
    lse, loss = _fused_kernel(impl, torch.empty(0, 10, device=DEV),
                              torch.empty(0, dtype=torch.long, device=DEV),
                              torch.tensor(0, device=DEV), 1.0, 1)
    assert lse.shape == loss.shape == (0,)
    logits = torch.randn(3, 10, device=DEV)
    labels = torch.tensor([1, 10, -100], device=DEV)
    _, loss = _fused_kernel(impl, logits, labels, torch.tensor(2, device=DEV), 1.0, 2)
    assert loss[0].isfinite() and loss[1].isnan() and loss[2] == 0


def _grads(x, w, labels, impl, backward_grad, **kw):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = linear_cross_entropy(x, w, labels, impl=impl, **kw)
    dx, dw = torch.autograd.grad(loss * backward_grad, [x, w])
    return loss.detach(), dx, dw


@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
@pytest.mark.parametrize("impl", IMPLS)
def test_grad_scale_named_rightly_gives_the_in_place_paths_bits(impl, scale):
    x, w, labels = _case(33, 257, seed=12)
    got = _grads(x, w, labels, impl, scale, grad_scale=scale)
    want = _grads(x, w, labels, impl, scale, inplace_backward=True)
    for name, g, r in zip(["loss", "dx", "dw"], got, want):
        assert torch.equal(g, r), name


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_scale_named_wrongly_still_applies_the_real_gradient(impl):
    x, w, labels = _case(33, 257, seed=13)
    loss, dx, dw = _grads(x, w, labels, impl, 3.0, grad_scale=1.0)
    ref_loss, _, ref_dx, ref_dw = _reference(x, w, labels, grad_scale=3.0)
    _close(loss, ref_loss, "loss")
    _close(dx, ref_dx, "dx")
    _close(dw, ref_dw, "dw")


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_scale_sink_weight_gradient_is_written_then_accumulated(impl):
    x, w, labels = _case(33, 100, seed=14)
    _, _, ref_dx, ref_dw = _reference(x, w, labels)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    wl.grad = torch.full_like(wl, math.nan)
    grads.sink(wl)
    for accumulate in (False, True):
        with grads.backward_pass(accumulate=accumulate):
            loss, _ = linear_cross_entropy(xl, wl, labels, impl=impl, grad_scale=1.0)
            loss.backward()
    _close(wl.grad, 2 * ref_dw, "written then accumulated dw")
    _close(xl.grad, 2 * ref_dx, "dx")


@pytest.mark.parametrize("impl", IMPLS)
def test_every_label_ignored_gives_nan_and_zero_grads(impl):
    x, w, labels = _case(7, 100)
    labels[:] = -100
    loss, dx, dw = _grads(x, w, labels, impl, 1.0, grad_scale=1.0)
    assert math.isnan(loss.item()) and not dx.any() and not dw.any()


@pytest.mark.parametrize("bad", [0.0, math.nan, math.inf])
def test_grad_scale_must_be_finite_and_nonzero(bad):
    x, w, labels = _case(7, 100)
    with pytest.raises(ValueError, match="grad_scale must be finite and nonzero"):
        linear_cross_entropy(x, w, labels, grad_scale=bad)


@pytest.mark.cuda
def test_bf16_qwen3_vocab_fused_kernel_is_the_two_kernels_bits_on_gpu():
    T, V = 300, 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(T, V, device="cuda", generator=gen) * 4).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=gen)
    labels[::7] = -100
    labels[1], labels[2] = 0, V - 1
    n_valid = (labels != -100).sum()
    want = logits.clone()
    want_lse, want_loss = cross_entropy_forward(want, labels)
    cross_entropy_backward(want, labels, want_lse, torch.tensor(0.5, device="cuda"), n_valid,
                           out_TV=want)
    for programs in (None, 1, 7, T):
        got = logits.clone()
        lse, loss = cross_entropy_fused(got, labels, n_valid, 0.5, programs=programs)
        assert torch.equal(lse, want_lse) and torch.equal(loss, want_loss), programs
        assert torch.equal(got, want), programs


def test_the_one_pass_switch_off_runs_the_two_kernels(monkeypatch):
    """MOEGRAPH_CE_ONE_PASS=0 (read into ONE_PASS): grad_scale then changes nothing."""
    from moegraph_kernels import cross_entropy as ce

    calls = []
    fused = ce.cross_entropy_fused_ref
    monkeypatch.setattr(ce, "cross_entropy_fused_ref", lambda *a: calls.append(1) or fused(*a))
    x, w, labels = _case(9, 50, seed=15)
    on = _grads(x, w, labels, "reference", 1.0, grad_scale=1.0)
    assert calls == [1]
    monkeypatch.setattr(ce, "ONE_PASS", False)
    off = _grads(x, w, labels, "reference", 1.0, grad_scale=1.0)
    assert calls == [1]
    for g, r in zip(on, off):
        assert torch.equal(g, r)


@pytest.mark.cuda
def test_bf16_head_with_grad_scale_gives_the_in_place_paths_bits_on_gpu():
    T, V, H = 300, 151936, 256
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.05).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=gen)
    labels[::9] = -100
    for scale in (1.0, 0.5):
        got = _grads(x, w, labels, "auto", scale, grad_scale=scale)
        want = _grads(x, w, labels, "auto", scale, inplace_backward=True)
        for name, g, r in zip(["loss", "dx", "dw"], got, want):
            assert torch.equal(g, r), (scale, name)
