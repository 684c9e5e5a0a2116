"""linear_cross_entropy in row chunks (models/common/loss.py, overlap.py): the same loss and
gradients as one chunk, every chunk size (even, uneven, one row, more rows than tokens), in
place or not, into a sink; on CUDA the side stream's overlap against none, eager and captured,
bitwise.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moegraph_cli import grads
from moegraph_cli.models.common import loss as loss_mod
from moegraph_cli.models.common import overlap
from moegraph_cli.models.common.loss import linear_cross_entropy
from test_loss import IMPLS, _case, _close, _fused, _reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_row_bounds_cover_every_row_once():
    assert overlap.row_bounds(10, 0) == [(0, 10)]
    assert overlap.row_bounds(10, 10) == [(0, 10)]
    assert overlap.row_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert overlap.row_bounds(3, 1) == [(0, 1), (1, 2), (2, 3)]
    assert overlap.row_bounds(0, 4) == [(0, 0)]
    for n in range(1, 40):
        for c in (1, 3, 7, 16):
            rows = [r for a, b in overlap.row_bounds(n, c) for r in range(a, b)]
            assert rows == list(range(n))


def test_no_side_stream_off_cuda():
    assert overlap.side_stream(torch.device("cpu")) is None


@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 32, 64])
@pytest.mark.parametrize("impl", IMPLS)
def test_chunks_match_one_chunk_and_torch(impl, chunk_rows):
    x, w, labels = _case(33, 100, seed=11)
    one = _fused(x, w, labels, impl, chunk_rows=0)
    got = _fused(x, w, labels, impl, chunk_rows=chunk_rows)
    want = _reference(x, w, labels)
    for name, g, o, r in zip(["loss", "logits", "dx", "dw"], got, one, want):
        _close(g, r, name)
        _close(g, o, name + " against one chunk")
    assert torch.equal(got[0], one[0]), "the loss is a sum of the same per-row terms"


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_inplace_backward_and_grad_scale(impl):
    x, w, labels = _case(33, 257, seed=12)
    want = _reference(x, w, labels, grad_scale=3.0)
    got = _fused(x, w, labels, impl, grad_scale=3.0, chunk_rows=5, inplace_backward=True)
    for name, g, r in zip(["loss", "logits", "dx", "dw"], got, want):
        _close(g, r, name)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, logits = linear_cross_entropy(xl, wl, labels, impl=impl, inplace_backward=True,
                                        chunk_rows=5)
    logits_ref = logits.clone().requires_grad_()
    dlogits = torch.autograd.grad(F.cross_entropy(logits_ref, labels), logits_ref)[0]
    loss.backward()
    _close(logits, dlogits, "logits after a chunked in-place backward")


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_sink_weight_and_no_dx(impl):
    x, w, labels = _case(33, 100, seed=13)
    _, _, _, ref_dw = _reference(x, w, labels)
    wl = w.clone().requires_grad_()
    wl.grad = torch.full_like(wl, math.nan)
    grads.sink(wl)
    with grads.backward_pass(accumulate=False):
        loss, _ = linear_cross_entropy(x, wl, labels, impl=impl, chunk_rows=8)
        loss.backward()  # x needs no gradient: no dx GEMM
    _close(wl.grad, ref_dw, "written dw")


def test_module_default_applies(monkeypatch):
    x, w, labels = _case(33, 100, seed=14)
    calls = []
    real = overlap.row_bounds
    monkeypatch.setattr(overlap, "row_bounds", lambda n, c: calls.append(c) or real(n, c))
    monkeypatch.setattr(loss_mod, "CHUNK_ROWS", 9)
    _fused(x, w, labels, "reference")
    _fused(x, w, labels, "reference", chunk_rows=0)
    assert calls == [9, 0]


def _qwen_head(T, seed=0):
    V, H = 151936, 2048
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=gen)
    labels[::10] = -100
    return x, w, labels


def _step(x, w, labels, chunk_rows):
    """loss, dx and dW (into a sink, as the trainer's) of one chunked head + loss."""
    xl = x.detach().requires_grad_()
    with grads.backward_pass(accumulate=False):
        loss, _ = linear_cross_entropy(xl, w, labels, inplace_backward=True,
                                       chunk_rows=chunk_rows)
        (dx,) = torch.autograd.grad(loss, [xl])
    return loss.detach(), dx


@pytest.mark.cuda
def test_side_stream_overlap_is_bitwise_no_overlap_eager_and_captured(monkeypatch):
    x, w, labels = _qwen_head(4096 + 300)
    w = w.requires_grad_()
    w.grad = torch.zeros_like(w)
    grads.sink(w)
    ref = _reference(x.float(), w.detach().float(), labels)

    def run():
        loss, dx = _step(x, w, labels, 1024)
        return loss.clone(), dx.clone(), w.grad.clone()

    overlapped = run()
    again = run()
    graph_out = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    w.grad.fill_(math.nan)
    with torch.cuda.graph(graph):
        graph_out["loss"], graph_out["dx"] = _step(x, w, labels, 1024)
    w.grad.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    captured = (graph_out["loss"], graph_out["dx"], w.grad.clone())
    monkeypatch.setattr(overlap, "side_stream", lambda device: None)
    serial = run()
    for name, a, b, c, d in zip(["loss", "dx", "dw"], overlapped, again, captured, serial):
        assert torch.equal(a, b), f"{name}: two overlapped runs differ"
        assert torch.equal(a, c), f"{name}: the captured replay differs from eager"
        assert torch.equal(a, d), f"{name}: the side stream changed the result"
    assert abs(overlapped[0].item() - ref[0].item()) <= 1e-3 * abs(ref[0].item())
    for name, g, r in zip(["dx", "dw"], overlapped[1:], ref[2:]):
        rel = ((g.float() - r).norm() / r.norm()).item()
        assert rel < 1e-2, (name, rel)
