"""`linear(x, w, b)`: F.linear whose weight gradient is written into `w.grad` by its GEMM.

The forward is F.linear. The backward computes dx = dy @ w as autograd does and the weight
gradient dW = dy^T @ x with `grads.mm_grad` (one GEMM writing, or accumulating with beta = 1,
into the sink's `.grad`; for a plain parameter the same product autograd forms, returned).
The bias gradient is the column sum of dy, deposited likewise.

`Linear(x, residual=r)`: r + F.linear(x, w) as one GEMM with beta = 1 (the residual add in the
GEMM's epilogue: fp32 accumulation and one rounding, where the add after the GEMM rounds
twice; torch.addmm copies r into its output first, so no pass over [rows, out] is saved); its
backward hands dy to the residual as it is. Without a bias only (with one, the add stays
separate); opt-in (MOEGRAPH_RESIDUAL_GEMM=1, measured below).

`projections(x, linears)`: several Linears of one input (attention's q, k and v) as one
autograd node. Forward: each F.linear, unchanged. Backward: dx = sum_i dy_i @ w_i as one GEMM
and then `addmm_` of the rest into its output (fp32 accumulation, one rounding a GEMM), where
autograd would write one [rows, in] gradient per projection and add them pairwise; the
weight and bias gradients as `linear` forms them.

Every product goes through moegraph_cli/matmul.py: torch's own ops, except 16-bit operands on
the CPU, which are multiplied from fp32 copies (torch's CPU bf16 GEMMs ran 5-180x slower there).
"""

from __future__ import annotations

import os

import torch

from ... import grads
from ...matmul import addmm, addmm_, linear as _plain, matmul


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        ctx.b = b
        return _plain(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = matmul(dy, w) if ctx.needs_input_grad[0] else None
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
        return _plain(x, w, b)
    return _Linear.apply(x, w, b)


# MOEGRAPH_RESIDUAL_GEMM=1: `Linear(x, residual=r)` adds r inside the GEMM (beta = 1). Off by
# default: r is added after the GEMM (two roundings), as before. On an H100 (loaded 4-layer
# Qwen3-30B step, whole_step_loaded_resid_{0,1}_a_h100.json) it removed the 4 attention residual
# adds (about 0.25 ms) but torch.addmm first copies r into its output (Memcpy DtoD, 0.19 ms) and
# the beta = 1 GEMM ran 0.17 ms longer than the plain one: no gain. Its CUDA tests pass with it on.
RESIDUAL_GEMM = os.environ.get("MOEGRAPH_RESIDUAL_GEMM", "0") not in ("0", "")


def _residual_mm(r, x, w):
    """r + x @ w^T over the last dimension, one GEMM (beta = 1)."""
    out = addmm(r.reshape(-1, r.shape[-1]), x.reshape(-1, x.shape[-1]), w.t())
    return out.view(r.shape)


class _ResidualLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, x, w):
        ctx.save_for_backward(x, w)
        return _residual_mm(r, x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = matmul(dy, w) if ctx.needs_input_grad[1] else None
        dw = None
        if ctx.needs_input_grad[2]:
            dw = grads.mm_grad(w, dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
        return dy if ctx.needs_input_grad[0] else None, dx, dw


def residual_linear(r: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                    b: torch.Tensor | None = None) -> torch.Tensor:
    """r + F.linear(x, w, b): one GEMM with beta = 1 where there is no bias (module
    docstring), the same for sink and plain weights (so a sharded run has the same bits)."""
    if b is not None or not RESIDUAL_GEMM or r.shape[:-1] != x.shape[:-1]:
        return r + linear(x, w, b)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (r, x, w)):
        return _ResidualLinear.apply(r, x, w)
    return _residual_mm(r, x, w)


class Linear(torch.nn.Linear):
    """nn.Linear through `linear` (same parameters, same state-dict keys); with `residual`,
    residual + the product (`residual_linear`)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            return residual_linear(residual, x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


# MOEGRAPH_QKV_ONE_BACKWARD=0: `projections` runs the Linears one by one (autograd's adds).
ONE_BACKWARD = os.environ.get("MOEGRAPH_QKV_ONE_BACKWARD", "1") not in ("0", "")


class _Projections(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, *weights_biases):
        ws, bs = weights_biases[:n], weights_biases[n:]
        ctx.save_for_backward(x, *ws)
        ctx.n = n
        ctx.bs = bs
        return tuple(_plain(x, w, b) for w, b in zip(ws, bs))

    @staticmethod
    def backward(ctx, *dys):
        x, *ws = ctx.saved_tensors
        n = ctx.n
        dys2 = [dy.reshape(-1, dy.shape[-1]) for dy in dys]
        dx = None
        if ctx.needs_input_grad[0]:
            dx2 = matmul(dys2[0], ws[0])
            for dy2, w in zip(dys2[1:], ws[1:]):
                addmm_(dx2, dy2, w)
            dx = dx2.view(*x.shape[:-1], x.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        need_w, need_b = ctx.needs_input_grad[2:2 + n], ctx.needs_input_grad[2 + n:]
        dws = [grads.mm_grad(w, dy2.t(), x2) if need else None
               for w, dy2, need in zip(ws, dys2, need_w)]
        dbs = [grads.deposit(b, dy2.sum(0)) if b is not None and need else None
               for b, dy2, need in zip(ctx.bs, dys2, need_b)]
        return (dx, None, *dws, *dbs)


def projections(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """(lin(x) for lin in linears), with one backward for all (module docstring)."""
    ws = [lin.weight for lin in linears]
    bs = [lin.bias for lin in linears]
    if not ONE_BACKWARD:
        return tuple(lin(x) for lin in linears)
    if not torch.is_grad_enabled():
        return tuple(_plain(x, w, b) for w, b in zip(ws, bs))
    return _Projections.apply(x, len(ws), *ws, *bs)
