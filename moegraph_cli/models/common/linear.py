"""`linear(x, w, b)`: F.linear whose weight gradient is written into `w.grad` by its GEMM.

The forward is F.linear. The backward computes dx = dy @ w as autograd does and the weight
gradient dW = dy^T @ x with `grads.mm_grad` (one GEMM writing, or accumulating with beta = 1,
into the sink's `.grad`; for a plain parameter the same product autograd forms, returned).
The bias gradient is the column sum of dy, deposited likewise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import grads


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        ctx.b = b
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dy.matmul(w) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = grads.mm_grad(w, dy2.t(), x.reshape(-1, x.shape[-1]))
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grads.deposit(ctx.b, dy2.sum(0))
        return dx, dw, db


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a sink weight (see grads.py) gets its gradient written by the GEMM."""
    if not torch.is_grad_enabled() or not (grads.marked(w) or grads.marked(b)):
        return F.linear(x, w, b)
    return _Linear.apply(x, w, b)


class Linear(torch.nn.Linear):
    """nn.Linear through `linear` (same parameters, same state-dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
