"""The Triton paths of the norms and the rope: RMSNorm (kernels/rmsnorm.py) and the per-head
q/k RMSNorm + rope, as [B, N, S, D] (kernels/rope.py), as autograd Functions.

Used on CUDA tensors only: the CPU path stays the torch one in norm.py / rope.py, bitwise
transformers' (the parity tests). `ENABLED = False` (or MOEGRAPH_FUSED=0 in the environment)
turns the kernels off everywhere; `ON_CPU = True` (tests) runs them on CPU too, which works only
under TRITON_INTERPRET=1 and in fp32. The rounding points are torch's (see the kernel files):
the rope is torch's bitwise, the norms differ only in the order of their fp32 sums.

Both Functions give the norm weight's gradient the sink treatment of grads.py: written (or
accumulated) by the reduction kernel into `.grad` for a sink, returned otherwise. Forward and
backward allocate only static shapes and never sync with the host, so a CUDA graph captures
them; the weight gradient is a fixed-order reduction of per-program partials, so replays are
bitwise eager.
"""

from __future__ import annotations

import os

import torch
from torch.autograd.function import once_differentiable

from ... import grads

ENABLED = os.environ.get("MOEGRAPH_FUSED", "1") not in ("0", "")
ON_CPU = False
# A norm whose input also feeds a skip connection adds the skip's gradient in its backward
# kernel (`rms_norm_skip`) instead of a separate add: MOEGRAPH_NORM_SKIP=0 turns it off.
NORM_SKIP = os.environ.get("MOEGRAPH_NORM_SKIP", "1") not in ("0", "")
# A norm output read by two consumers (the MoE layer's router and experts) hands each its own
# output, and the backward kernel sums their gradients (`rms_norm_fork`) instead of autograd's
# separate add: MOEGRAPH_NORM_FORK=0 turns it off.
NORM_FORK = os.environ.get("MOEGRAPH_NORM_FORK", "1") not in ("0", "")
# The rope's output layout (kernels/rope.py): "bsnd" (default) or "bnsd", MOEGRAPH_ROPE_LAYOUT.
ROPE_LAYOUT = os.environ.get("MOEGRAPH_ROPE_LAYOUT", "bsnd")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def active(x: torch.Tensor) -> bool:
    """Whether the kernels take x: switched on, on CUDA (or forced on CPU), a kernel dtype."""
    return ENABLED and (x.is_cuda or ON_CPU) and x.dtype in _DTYPES


def _grad_target(weight: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """(p.grad to write into, accumulate?) for a sink, else (None, False)."""
    where = grads.target(weight)
    return (None, False) if where is None else where


def _norm_forward(ctx, x, weight, eps):
    from moegraph_kernels.rmsnorm import rms_norm_forward

    y, rstd = rms_norm_forward(x, weight, eps)
    ctx.save_for_backward(x, weight, rstd)
    return y


def _norm_backward(ctx, dy, dres=None, dy2=None):
    """(dx, dW, None) of the norm, dres (a skip connection's gradient) added to dx, dy2 (the
    second consumer's gradient of y) summed with dy first."""
    from moegraph_kernels.rmsnorm import rms_norm_backward

    x, weight, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[1]
    dw_out, acc = _grad_target(weight) if need_dw else (None, False)
    dx, dw = rms_norm_backward(dy, x, weight, rstd, need_dw=need_dw, dw_out=dw_out,
                               accumulate=acc, dres=dres, dy2=dy2)
    return (dx if ctx.needs_input_grad[0] else None), dw, None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        return _norm_forward(ctx, x, weight, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return _norm_backward(ctx, dy)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm.rms_norm by kernels/rmsnorm.py: y [..., D] contiguous."""
    return _RMSNorm.apply(x, weight, eps)


class _RMSNormSkip(torch.autograd.Function):
    """(y, x): the norm and its input, for a skip connection. The backward gets both
    gradients and adds the skip's to dx in the norm's kernel: the same bits as autograd's
    add of the two, one pass fewer over [rows, D]."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        return _norm_forward(ctx, x, weight, eps), x

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dskip):
        return _norm_backward(ctx, dy, dskip.to(ctx.saved_tensors[0].dtype))


def rms_norm_skip(x: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm.rms_norm(x), x as the skip connection's operand), the skip's gradient added in
    the norm's backward kernel."""
    return _RMSNormSkip.apply(x, weight, eps)


class _RMSNormFork(torch.autograd.Function):
    """(y, y', x): the norm twice (y' a view of y) and its input, for two consumers of the
    norm and a skip connection. The backward gets the three gradients and sums the first two
    in the norm's kernel, the same bits as autograd's add of them (an fp32 sum rounded to y's
    dtype: commutative, so their order of arrival does not matter), one pass fewer over
    [rows, D]."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y = _norm_forward(ctx, x, weight, eps)
        return y, y.view_as(y), x

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dy2, dskip):
        return _norm_backward(ctx, dy, dskip.to(ctx.saved_tensors[0].dtype), dy2.to(dy.dtype))


def rms_norm_fork(x: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(norm.rms_norm(x) for a first consumer, the same values for a second, x as the skip
    connection's operand): the three gradients summed in the norm's backward kernel."""
    return _RMSNormFork.apply(x, weight, eps)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSND, weight, cos_SD, sin_SD, eps):
        from moegraph_kernels.rope import rope_forward

        y, rstd = rope_forward(x_BSND, cos_SD, sin_SD, weight, eps, ROPE_LAYOUT)
        # x is read back only by the norm's backward.
        ctx.save_for_backward(x_BSND if weight is not None else None, weight, rstd, cos_SD,
                              sin_SD)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_BNSD):
        from moegraph_kernels.rope import rope_backward

        x_BSND, weight, rstd, cos_SD, sin_SD = ctx.saved_tensors
        need_dw = weight is not None and ctx.needs_input_grad[1]
        dw_out, acc = _grad_target(weight) if need_dw else (None, False)
        dx, dw = rope_backward(dy_BNSD, x_BSND, cos_SD, sin_SD, weight, rstd, need_dw=need_dw,
                               dw_out=dw_out, accumulate=acc)
        return dx, dw, None, None, None


def rope(x_BSND: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
         weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """apply_rope(norm(x).transpose(1, 2)) in one kernel: x [B, S, N, D] (any strides, last
    one 1), the per-head RMSNorm only with `weight`; returns [B, N, S, D] in ROPE_LAYOUT."""
    return _Rope.apply(x_BSND, weight, cos_SD, sin_SD, eps)


def rope_active(x_BSND: torch.Tensor, cos_SD: torch.Tensor,
                weight: torch.Tensor | None = None) -> bool:
    """Whether `rope` takes x: `active`, one dtype for x, the tables and the weight, even D."""
    return (active(x_BSND) and x_BSND.stride(-1) == 1 and x_BSND.shape[-1] % 2 == 0
            and cos_SD.dtype == x_BSND.dtype
            and (weight is None or weight.dtype == x_BSND.dtype))
