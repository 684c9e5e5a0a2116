"""Matrix products of 16-bit floats on the CPU, computed from fp32 copies.

torch's CPU GEMMs in bfloat16 / float16 on a host without AVX-512 BF16 or AMX (an AVX2
machine, as CI's is) run far slower than fp32 ones of the same shape. On a 2-core AMD EPYC,
torch 2.13 (benchmarks/results/cpu_gemm.json): the lm head's dx [1024, 32000] @ [32000, 512]
49.2 s in bf16 against 0.27 s from fp32 copies, a projection's dx 1.91 s against 0.012 s,
the forward and dW products 5-17x slower. `moegraph verify --set run.device=cpu` on the
built-in default took 13 minutes, most of it in those products; 35 s with this module.

So a product here whose operands are 16-bit floats on the CPU is computed from fp32 copies
and rounded once to the operands' dtype: fp32 accumulation and one rounding, what a GPU's
bf16 GEMM does. Everywhere else (CUDA; fp32 or fp64 operands) these are torch's own ops,
unchanged. `linear` stays differentiable (its backward's products go through fp32 too, and it
saves the 16-bit operands, as F.linear does); the others are for backward code and no-grad
use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HALF = (torch.bfloat16, torch.float16)


def through_fp32(t: torch.Tensor) -> bool:
    """Whether products of `t` go through fp32 copies: a 16-bit float on the CPU."""
    return t.device.type == "cpu" and t.dtype in HALF


def _from_fp32(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


class _Linear16(torch.autograd.Function):
    """F.linear of 16-bit CPU operands, saving them (not fp32 copies) for its backward, so a
    layer holds the bytes F.linear holds (the planner's saved-bytes model)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _from_fp32(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = matmul(dy, w) if ctx.needs_input_grad[0] else None
        dw = matmul(dy2.t(), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        db = dy2.float().sum(0).to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] \
            else None
        return dx, dw, db


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b); differentiable, saving what F.linear saves."""
    if not through_fp32(x):
        return F.linear(x, w, b)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, b)):
        return _Linear16.apply(x, w, b)
    return _from_fp32(x, w, b)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (any batch dimensions, as torch.matmul)."""
    if not through_fp32(a):
        return a @ b
    return (a.float() @ b.float()).to(a.dtype)


def mm_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """torch.mm(a, b, out=out)."""
    if not through_fp32(out):
        return torch.mm(a, b, out=out)
    return out.copy_(torch.mm(a.float(), b.float()))


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c + a @ b (2-D) with beta = 1: fp32 accumulation and one rounding, into a new tensor."""
    if not through_fp32(c):
        return torch.addmm(c, a, b)
    return torch.addmm(c.float(), a.float(), b.float()).to(c.dtype)


def addmm_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c.addmm_(a, b): c + a @ b with beta = 1, one rounding into c."""
    if not through_fp32(c):
        return c.addmm_(a, b)
    return c.copy_(c.float().addmm_(a.float(), b.float()))
