"""kernels/cross_entropy_fused.py against the forward and backward kernels of
cross_entropy.py and against its pure-torch reference: under the Triton interpreter in fp32
on CPU (the same block as the forward kernel there, so the same lse bits), on a GPU in bf16
as well (tests/gpu/test_loss_fused_cuda.py)."""

import math

import pytest
import torch
import triton

from moegraph_kernels.cross_entropy import (cross_entropy_backward, cross_entropy_backward_ref,
                                            cross_entropy_forward, cross_entropy_forward_ref)
from moegraph_kernels.cross_entropy_fused import (cross_entropy_fused_,
                                                  cross_entropy_fused_ref_, scale_by_grad_,
                                                  scale_by_grad_ref_)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.float32


def _case(T, V, seed=0, ignore=(), stride_pad=0):
    """logits [T, V] (in a [T, V + stride_pad] buffer whose padding holds NaN) and labels
    with 0 and V - 1 present; rows in `ignore` get -100 and NaN logits (never to be read)."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((T, V + stride_pad), float("nan"), dtype=DT)
    buf[:, :V] = torch.randn(T, V, generator=gen, dtype=DT) * 3
    labels = torch.randint(0, V, (T,), generator=gen)
    labels[0] = V - 1
    if T > 1:
        labels[1] = 0
    for r in ignore:
        labels[r] = -100
        buf[r, :V] = float("nan")
    return buf.to(DEV)[:, :V], labels.to(DEV)


def _two_kernel(logits, labels, fwd=cross_entropy_forward, bwd=cross_entropy_backward):
    """(lse, loss, dlogits) of the forward kernel, then the backward's with grad 1."""
    lse, loss = fwd(logits, labels)
    n_valid = (labels != -100).sum()
    one = torch.ones((), device=logits.device)
    dl = bwd(logits, labels, lse, one, n_valid, out_TV=torch.empty_like(logits))
    return lse, loss, dl


def _forward_tile(V):
    """The forward kernel's one-program-a-row tile on a GPU (cross_entropy_forward), so the
    fused kernel sums in its order there; the interpreter's default already is."""
    if DEV != "cuda":
        return {}
    block = min(triton.next_power_of_2(V), 8192)
    return {"block_v": block, "num_warps": 8 if block >= 2048 else 4, "stages": 1}


def _fused(logits, labels, fn=cross_entropy_fused_, **kw):
    buf = logits.clone()
    lse, loss = fn(buf, labels, (labels != -100).sum(), **kw)
    return lse, loss, buf


def _equal(a, b):
    return torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("T,V,ignore", [
    (5, 100, (2,)),           # V not a power of two
    (1, 37, ()),              # one row, odd V
    (9, 256, (0, 4, 8)),      # a block exactly
    (4, 1000, ()),            # several blocks of the interpreter's 64... and one of 1024
])
def test_fused_equals_forward_then_backward(T, V, ignore):
    logits, labels = _case(T, V, ignore=ignore)
    want = _two_kernel(logits, labels)
    got = _fused(logits, labels, **_forward_tile(V))
    for name, a, b in zip(("lse", "loss", "dlogits"), got, want):
        assert _equal(a, b), name


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("block", [16, 64])
def test_fused_dlogits_are_the_backward_kernels_given_its_lse(block, reverse, stages):
    """Any block (its own lse bits): dlogits bitwise the backward kernel's on that lse."""
    logits, labels = _case(6, 203, seed=3, ignore=(3,))
    lse, loss, dl = _fused(logits, labels, block_v=block, reverse=reverse, stages=stages)
    n_valid = (labels != -100).sum()
    want = cross_entropy_backward(logits, labels, lse, torch.ones((), device=DEV), n_valid,
                                  out_TV=torch.empty_like(logits))
    assert torch.equal(dl, want)
    ref_lse, ref_loss = cross_entropy_forward_ref(logits, labels)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(dl[3], torch.zeros_like(dl[3]))  # the ignored row: zeros, never read


def test_fused_leaves_padding_columns_and_reads_no_ignored_row():
    logits, labels = _case(4, 50, ignore=(1,), stride_pad=14)
    full = logits.as_strided((4, 64), (64, 1))
    lse, loss = cross_entropy_fused_(logits, labels, (labels != -100).sum())
    assert full[:, 50:].isnan().all()  # padding untouched
    assert torch.isfinite(logits).all() and torch.equal(logits[1], torch.zeros(50, device=DEV))
    assert lse[1] == 0 and loss[1] == 0 and torch.isfinite(loss).all()


def test_fused_every_row_ignored_gives_zeros():
    logits, labels = _case(3, 40, ignore=(0, 1, 2))
    lse, loss, dl = _fused(logits, labels)
    assert not lse.any() and not loss.any() and not dl.any()


def test_fused_label_out_of_range_gives_nan_loss():
    logits, labels = _case(3, 40)
    labels[2] = 40
    lse, loss, dl = _fused(logits, labels)
    assert math.isnan(loss[2]) and torch.isfinite(loss[:2]).all()
    want = _two_kernel(logits, labels)[2]
    if DEV != "cuda":  # the same lse bits only in the interpreter at the default tile
        assert torch.equal(dl, want)


def test_fused_reference_matches_kernel():
    logits, labels = _case(7, 300, seed=5, ignore=(2, 5))
    got = _fused(logits, labels)
    want = _fused(logits, labels, fn=cross_entropy_fused_ref_)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ref_two = _two_kernel(logits, labels, cross_entropy_forward_ref, cross_entropy_backward_ref)
    for a, b in zip(want, ref_two):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fn", [scale_by_grad_, scale_by_grad_ref_])
def test_scale_by_grad(fn):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(1000, generator=gen) * 1e-3).to(DEV)
    x[7] = float("nan")
    for g in (1.0, 0.5, 0.3, -2.0):
        y = x.clone()
        fn(y, torch.tensor(g, device=DEV))
        want = x if g == 1.0 else (x * g)
        assert _equal(y, want), g
    assert fn(torch.empty(0, device=DEV), torch.tensor(0.5, device=DEV)).numel() == 0
    with pytest.raises(ValueError, match="contiguous"):
        scale_by_grad_(torch.zeros(4, 4, device=DEV).t(), torch.tensor(0.5, device=DEV))
