"""Gradients written, not added: where each parameter gradient lands, and how.

A parameter marked as a *sink* (`sink(p)`; the single-process trainer marks every trainable
parameter, whose `.grad` is a fixed view into the optimizer's flat gradient buffer) never gets
its gradient from autograd's AccumulateGrad (which adds a fresh tensor into `.grad`, and needs
`.grad` zeroed first). Instead the op that computes the gradient writes it into `.grad` itself
and hands autograd `None`:
- the first (or only) micro-batch of a step *writes* (`torch.mm(..., out=p.grad)`, a kernel
  storing its tile, `copy_`);
- later micro-batches *accumulate* (`addmm_`, a kernel adding its tile, `add_`).
No zeroing pass exists. The mode is a process-wide switch set by the trainer around each
micro-batch's backward (`backward_pass(accumulate=True)`); captured backward graphs bake the mode they were
captured in, so a graphed scope keeps one backward graph per mode it replays in. Within one
backward pass a parameter used twice (tied embeddings: the embedding and the lm head) is
written by the first op and added to by the second: `backward_pass()` starts the record of
what was written.

Three ways in, by cost:
- `mm_grad(p, a, b)`: one GEMM writes (or, accumulating, adds with beta = 1) `a @ b` into
  `p.grad` (the linear layers, the lm head);
- a kernel that takes `out=p.grad` and an accumulate flag (the expert weight gradients,
  `target(p)` says where and how);
- `through(p)`: an identity on `p` whose backward deposits whatever gradient reaches it
  (`copy_`, or `add_`): for the small parameters (norm weights) and the embedding, whose
  gradient some torch op has already materialised.

Parameters that are not sinks (a distributed run's FSDP2 parameters, whose unsharded `.grad`
FSDP2 pops and reduce-scatters) keep the standard contract: the gradient is returned.
"""

from __future__ import annotations

import contextlib

import torch

from . import matmul

_ATTR = "_moegraph_grad_sink"
_accumulate = False
_written: set[int] = set()  # ids of the sinks written in this backward pass


def sink(p: torch.Tensor, on: bool = True) -> None:
    """Mark `p`: its gradient is written into `p.grad` (which must exist) by the op itself."""
    setattr(p, _ATTR, on)


def marked(p: torch.Tensor | None) -> bool:
    """`p` was marked a sink (its `.grad` may not exist yet)."""
    return p is not None and getattr(p, _ATTR, False)


def is_sink(p: torch.Tensor) -> bool:
    return getattr(p, _ATTR, False) and p.grad is not None


def accumulating_now() -> bool:
    return _accumulate


@contextlib.contextmanager
def backward_pass(accumulate: bool):
    """One backward pass (a micro-batch's, or one captured backward graph's): gradients are
    added to `.grad` (`accumulate`) or overwrite it, each sink's first write starting fresh."""
    global _accumulate, _written
    before = (_accumulate, _written)
    _accumulate, _written = accumulate, set()
    try:
        yield
    finally:
        _accumulate, _written = before


def target(p: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """Where a kernel writes p's gradient: (p.grad, accumulate?) for a sink, else None (the
    caller allocates and returns the gradient). Marks p written."""
    if not is_sink(p):
        return None
    acc = _accumulate or id(p) in _written
    _written.add(id(p))
    return p.grad, acc


def deposit(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """Hand parameter `p` its gradient `g`: into `.grad` for a sink (returns None), otherwise
    returned for autograd."""
    where = target(p)
    if where is None:
        return g
    grad, acc = where
    with torch.no_grad():
        if acc:
            grad.add_(g.view_as(grad))
        else:
            grad.copy_(g.view_as(grad))
    return None


def mm_grad(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The gradient `a @ b` of the 2-D parameter `p`: for a sink one GEMM writes it into (or,
    accumulating, adds it to, with beta = 1 in the same GEMM) `p.grad` and None is returned;
    otherwise the product is returned."""
    where = target(p)
    if where is None:
        return matmul.matmul(a, b)
    grad, acc = where
    with torch.no_grad():
        if acc:
            matmul.addmm_(grad, a, b)
        else:
            matmul.mm_out(a, b, grad)
    return None


class _Through(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p):
        ctx.p = p
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        return deposit(ctx.p, g)


def through(p: torch.Tensor) -> torch.Tensor:
    """`p` itself for the forward; the gradient reaching it is deposited (sinks) or returned.
    A plain parameter passes untouched (no autograd node)."""
    if not marked(p) or not torch.is_grad_enabled():
        return p
    return _Through.apply(p)
