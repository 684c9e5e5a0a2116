"""linear_cross_entropy against F.cross_entropy(F.linear(x, w).float(), labels) (mean over
kept tokens), both paths: the Triton kernels (under the interpreter on CPU, fp32 only there)
and the chunked pure-torch one. Kernel-level tests poison everything a kernel must not read
or write (padding columns, ignored rows, the output buffer) with NaN.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moegraph_cli import grads
from moegraph_cli.models.common.loss import causal_shift, linear_cross_entropy
from moegraph_kernels.cross_entropy import (cross_entropy_backward, cross_entropy_backward_ref,
                                            cross_entropy_forward, cross_entropy_forward_ref)

IMPLS = ["triton", "reference"]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(T, V, H=16, seed=0, ignore_every=3):
    """x [T, H], w [V, H] fp32, labels [T] with 0 and V - 1 present and every
    `ignore_every`-th label (from the third) ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * 0.5
    labels = torch.randint(0, V, (T,), generator=gen)
    labels[0] = V - 1
    if T > 1:
        labels[1] = 0
    if ignore_every:
        labels[2::ignore_every] = -100
    return x.to(DEV), w.to(DEV), labels.to(DEV)


def _reference(x, w, labels, grad_scale=1.0):
    """(loss, logits, dx, dw) of the fp32 torch path today's model uses."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = F.linear(x, w)
    loss = F.cross_entropy(logits.float(), labels, ignore_index=-100)
    dx, dw = torch.autograd.grad(loss * grad_scale, [x, w])
    return loss.detach(), logits.detach(), dx, dw


def _fused(x, w, labels, impl, grad_scale=1.0, **kw):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, logits = linear_cross_entropy(x, w, labels, impl=impl, **kw)
    assert not logits.requires_grad and loss.dtype == torch.float32 and loss.dim() == 0
    logits = logits.clone()  # before an in-place backward overwrites them
    dx, dw = torch.autograd.grad(loss * grad_scale, [x, w])
    return loss.detach(), logits, dx, dw


def _close(got, want, name):
    assert torch.isfinite(got).all(), f"{name} has non-finite values"
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale,
                               msg=lambda m: f"{name}: {m}")


def _assert_matches(got, want):
    for name, g, r in zip(["loss", "logits", "dx", "dw"], got, want):
        _close(g, r, name)


@pytest.mark.parametrize("V", [5, 100, 257])
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_torch_cross_entropy(impl, T, V):
    x, w, labels = _case(T, V, seed=T * 1000 + V)
    got = _fused(x, w, labels, impl)
    want = _reference(x, w, labels)
    assert torch.equal(got[1], want[1]), "logits are not F.linear's"
    _assert_matches(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_token_labels_at_both_ends_and_int32(impl):
    for label in (0, 99):
        x, w, _ = _case(1, 100, seed=label)
        labels = torch.tensor([label], dtype=torch.int32, device=DEV)
        _assert_matches(_fused(x, w, labels, impl), _reference(x, w, labels.long()))


@pytest.mark.parametrize("impl", IMPLS)
def test_every_label_ignored_gives_nan_and_zero_grads_as_torch(impl):
    x, w, labels = _case(7, 100)
    labels[:] = -100
    loss, _, dx, dw = _fused(x, w, labels, impl)
    ref_loss, _, ref_dx, ref_dw = _reference(x, w, labels)
    assert math.isnan(loss.item()) and math.isnan(ref_loss.item())
    assert torch.equal(dx, ref_dx) and torch.equal(dw, ref_dw) and not dx.any()


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_loss_scales_the_gradients(impl):
    x, w, labels = _case(33, 257, seed=3)
    _assert_matches(_fused(x, w, labels, impl, grad_scale=3.0),
                    _reference(x, w, labels, grad_scale=3.0))


@pytest.mark.parametrize("impl", IMPLS)
def test_batched_hidden_states_with_causal_shift_match_causal_lm_loss(impl):
    B, S, V, H = 2, 9, 100, 16
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(B, S, H, generator=gen).to(DEV)
    w = torch.randn(V, H, generator=gen).to(DEV)
    labels = torch.randint(0, V, (B, S), generator=gen).to(DEV)
    labels[0, 3] = -100
    shifted = causal_shift(labels)
    assert torch.equal(shifted[:, :-1], labels[:, 1:]) and (shifted[:, -1] == -100).all()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, logits = linear_cross_entropy(xl, wl, shifted, impl=impl)
    assert logits.shape == (B, S, V)
    got = [loss.detach(), logits, *torch.autograd.grad(loss, [xl, wl])]
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_logits = F.linear(xr, wr)  # causal_lm_loss, spelled out
    ref = F.cross_entropy(ref_logits.float().reshape(-1, V), shifted.reshape(-1),
                          ignore_index=-100)
    want = [ref.detach(), ref_logits.detach(), *torch.autograd.grad(ref, [xr, wr])]
    _assert_matches(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_sink_weight_gradient_is_written_then_accumulated(impl):
    x, w, labels = _case(33, 100, seed=5)
    _, _, ref_dx, ref_dw = _reference(x, w, labels)
    xl = x.clone().requires_grad_()
    wl = w.clone().requires_grad_()
    flat = torch.full((wl.numel() + 8,), math.nan, device=DEV)  # the optimizer's flat buffer
    wl.grad = flat[4:4 + wl.numel()].view_as(wl)
    grads.sink(wl)
    with grads.backward_pass(accumulate=False):
        loss, _ = linear_cross_entropy(xl, wl, labels, impl=impl)
        dx, dw = torch.autograd.grad(loss, [xl, wl], allow_unused=True)
    assert dw is None, "a sink's gradient was handed to autograd"
    _close(dx, ref_dx, "dx")
    _close(wl.grad, ref_dw, "written dw")  # NaN before: written, not added
    assert wl.grad.data_ptr() == flat[4:].data_ptr() and flat[:4].isnan().all()
    with grads.backward_pass(accumulate=True):
        loss, _ = linear_cross_entropy(xl, wl, labels, impl=impl)
        loss.backward()
    _close(wl.grad, 2 * ref_dw, "accumulated dw")
    _close(xl.grad, ref_dx, "dx via .backward()")


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_tied_embedding_gets_both_gradients(impl, sink):
    T, V, H = 7, 100, 16
    ids = torch.tensor([3, 0, 99, 3, 50, 7, 1], device=DEV)
    w = (torch.randn(V, H, generator=torch.Generator().manual_seed(6)) * 0.5).to(DEV)
    labels = causal_shift(ids[None])[0]

    def run(head, sink):
        wl = w.clone().requires_grad_()
        if sink:
            wl.grad = torch.full_like(wl, math.nan)
            grads.sink(wl)
        with grads.backward_pass(accumulate=False):
            x = F.embedding(ids, grads.through(wl)) * 1.5
            loss = head(x, wl)
            loss.backward()
        return loss.detach(), wl.grad

    got = run(lambda x, wl: linear_cross_entropy(x, wl, labels, impl=impl)[0], sink)
    want = run(lambda x, wl: F.cross_entropy(F.linear(x, wl).float(), labels), False)
    _close(got[0], want[0], "loss")
    _close(got[1], want[1], "dw (embedding + head)")


@pytest.mark.parametrize("impl", IMPLS)
def test_inplace_backward_overwrites_logits_with_dlogits(impl):
    x, w, labels = _case(7, 100, seed=7)
    want = _reference(x, w, labels)
    _assert_matches(_fused(x, w, labels, impl, inplace_backward=True), want)

    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, logits = linear_cross_entropy(xl, wl, labels, impl=impl, inplace_backward=True)
    logits_before = logits.clone()
    logits_ref = logits_before.clone().requires_grad_()
    dlogits = torch.autograd.grad(F.cross_entropy(logits_ref, labels), logits_ref)[0]
    loss.backward(retain_graph=True)
    _close(logits, dlogits, "logits after an in-place backward")
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()

    loss, logits = linear_cross_entropy(xl, wl, labels, impl=impl)  # default: kept
    loss.backward()
    assert torch.equal(logits, logits_before)


FWD = {"triton": cross_entropy_forward, "reference": cross_entropy_forward_ref}
BWD = {"triton": cross_entropy_backward, "reference": cross_entropy_backward_ref}


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_kernels_never_touch_padding_or_ignored_rows(impl, inplace):
    T, V, pad = 33, 257, 7
    _, _, labels = _case(T, V, seed=8)
    ignored = labels == -100
    logits = torch.randn(T, V, generator=torch.Generator().manual_seed(8)).to(DEV) * 3
    buf = torch.full((T, V + pad), math.nan, device=DEV)  # a row stride past V
    buf[:, :V] = logits
    buf[ignored] = math.nan
    padded = buf[:, :V]
    ref_loss = F.cross_entropy(logits, labels, reduction="none")
    logits_ref = logits.clone().requires_grad_()
    ref_dlogits = torch.autograd.grad(F.cross_entropy(logits_ref, labels) * 2.0, logits_ref)[0]

    lse, loss = FWD[impl](padded, labels)
    _close(loss, ref_loss, "loss per row")
    _close(lse[~ignored], torch.logsumexp(logits, -1)[~ignored], "lse")
    assert (lse[ignored] == 0).all() and (loss[ignored] == 0).all()

    grad_loss = torch.tensor(2.0, device=DEV)
    n_valid = (~ignored).sum()
    if inplace:
        out = padded
    else:
        out = torch.full((T, V + 3), math.nan, device=DEV)[:, :V]
    dlogits = BWD[impl](padded, labels, lse, grad_loss, n_valid, out_TV=out)
    assert dlogits.data_ptr() == out.data_ptr()
    _close(dlogits, ref_dlogits, "dlogits")
    assert (dlogits[ignored] == 0).all()
    assert buf[:, V:].isnan().all(), "a padding column was written"
    if not inplace:
        assert torch.equal(buf[~ignored][:, :V], logits[~ignored]), "logits were written"


@pytest.mark.parametrize("impl", IMPLS)
def test_ignored_rows_of_nan_hidden_states_do_not_leak(impl):
    x, w, labels = _case(33, 100, seed=9)
    ignored = labels == -100
    x_nan = x.clone()
    x_nan[ignored] = math.nan
    loss, _, dx, _ = _fused(x_nan, w, labels, impl)
    ref_loss, _, ref_dx, _ = _reference(x, w, labels)
    _close(loss, ref_loss, "loss")
    _close(dx, ref_dx, "dx")  # dW = dlogits^T x is NaN here, as torch's: 0 * NaN


@pytest.mark.parametrize("impl", IMPLS)
def test_label_out_of_range_gives_nan_loss_without_a_sync(impl):
    logits = torch.randn(3, 10, device=DEV)
    labels = torch.tensor([1, 10, -100], device=DEV)
    _, loss = FWD[impl](logits, labels)
    assert loss[0].isfinite() and loss[1].isnan() and loss[2] == 0


def test_shape_errors_name_the_argument():
    x, w, labels = _case(7, 100)
    with pytest.raises(ValueError, match="labels has shape"):
        linear_cross_entropy(x, w, labels[:5])
    with pytest.raises(ValueError, match="weight has shape"):
        linear_cross_entropy(x, w[:, :8], labels)
    with pytest.raises(ValueError, match="impl must be"):
        linear_cross_entropy(x, w, labels, impl="fast")


def _max_err(got, want):
    return (got.float() - want).abs().max().item()


@pytest.mark.cuda
def test_bf16_qwen3_head_on_gpu_matches_fp32_and_uses_less_memory():
    T, V, H = 1024, 151936, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=gen)
    labels[::10] = -100
    labels[1], labels[2] = 0, V - 1

    ref_loss, _, ref_dx, ref_dw = _reference(x.float(), w.float(), labels)  # fp32 truth
    ref32 = (ref_loss, ref_dx, ref_dw)

    def peak(fn):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn(xl, wl)
        dx, dw = torch.autograd.grad(loss, [xl, wl])
        torch.cuda.synchronize()
        return loss.detach(), dx, dw, torch.cuda.max_memory_allocated() - base

    *bf16, peak_bf16 = peak(lambda xl, wl: F.cross_entropy(F.linear(xl, wl).float(), labels))
    *fused, peak_fused = peak(lambda xl, wl: linear_cross_entropy(xl, wl, labels)[0])

    assert abs(fused[0].item() - ref32[0].item()) <= 1e-3 * abs(ref32[0].item())
    for name, g, b, r in zip(["dx", "dw"], fused[1:], bf16[1:], ref32[1:]):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        # No worse than twice today's bf16-logits path against the fp32 truth.
        assert _max_err(g, r) <= 2 * _max_err(b, r) + 1e-6, (name, _max_err(g, r),
                                                             _max_err(b, r))
        rel = ((g.float() - r).norm() / r.norm()).item()
        assert rel < 1e-2, (name, rel)
    assert peak_fused < peak_bf16, (peak_fused, peak_bf16)


@pytest.mark.parametrize("chunk", [64, 128, 192])
def test_row_chunks_match_one_program_a_row_and_skip_padding_and_ignored_rows(chunk):
    """cross_entropy_forward(chunk=...): each row over cdiv(V, chunk) programs, combined;
    the same lse and loss as one program a row within a few ulps, ignored rows zero, NaN in
    the padding columns and the ignored rows never read."""
    T, V, pad = 33, 257, 7
    _, _, labels = _case(T, V, seed=10)
    ignored = labels == -100
    logits = torch.randn(T, V, generator=torch.Generator().manual_seed(10)).to(DEV) * 3
    buf = torch.full((T, V + pad), math.nan, device=DEV)
    buf[:, :V] = logits
    buf[ignored] = math.nan
    lse, loss = cross_entropy_forward(buf[:, :V], labels, block_v=64, chunk=chunk)
    one_lse, one_loss = cross_entropy_forward(logits, labels, block_v=64)
    _close(lse, one_lse, "lse")
    _close(loss, one_loss, "loss")
    _close(loss, F.cross_entropy(logits, labels, reduction="none"), "loss per row")
    assert (lse[ignored] == 0).all() and (loss[ignored] == 0).all()
    again = cross_entropy_forward(buf[:, :V], labels, block_v=64, chunk=chunk)
    assert torch.equal(again[0], lse) and torch.equal(again[1], loss)


def test_row_chunk_not_a_multiple_of_the_block_is_refused():
    logits = torch.randn(3, 100, device=DEV)
    with pytest.raises(ValueError, match="multiple of the block"):
        cross_entropy_forward(logits, torch.zeros(3, dtype=torch.long, device=DEV),
                              block_v=64, chunk=96)
