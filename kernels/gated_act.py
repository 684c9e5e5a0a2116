"""The gated activation (SwiGLU times the route probability), as GEMM-epilogue helpers.

There is no standalone activation kernel: the forward activation rides the FC1 epilogue and
its backward rides the epilogue of the dA gather-GEMM (fc1_swiglu.py, dact_swiglu.py), so no
pass over an [S, F] tensor is spent on it. These helpers are the one place the math lives.

Contract (per slot s and column f < F, Y1 = [gate | up] of width 2F in the input dtype):
- forward: A = silu(g) * u * p, computed in fp32 from g, u already rounded to the input dtype
  (the values stored in Y1), then rounded to the input dtype by the caller. Backward recomputes
  A from the stored Y1 with the same helper, so it gets bitwise the forward's A.
- backward, given dA (rounded to the input dtype, as autograd would hand it):
  dg = dA * p * u * silu'(g), du = dA * p * silu(g), and dp = sum_f dA * silu(g) * u, all fp32.
  silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))), as torch's silu_backward.
- p is the route's top-k weight in fp32; padding slots carry p = 0 and g = u = 0.

Clamped SwiGLU (GPT-OSS), picked by the CLAMPED constexpr of `gated_forward` /
`gated_backward` (the kernels call those two; alpha and limit are fp32 runtime scalars):
- forward: gc = min(g, limit), uc = clamp(u, -limit, limit),
  A = (uc + 1) * (gc * sigmoid(alpha * gc)) * p.
- backward: s = sigmoid(alpha * gc), glu = gc * s;
  dg = dA * p * (uc + 1) * (s + alpha * gc * s * (1 - s)) where g <= limit, else 0;
  du = dA * p * glu where -limit <= u <= limit, else 0 (torch's clamp backward: the gradient
  passes at the bounds); dp = sum_f dA * (uc + 1) * glu.
"""

import triton
import triton.language as tl


@triton.jit
def swiglu_forward(g, u, p):
    """fp32 [BM, BN] gate and up tiles, p [BM, 1]: silu(g) * u * p (torch's silu formula)."""
    return g / (1.0 + tl.exp(-g)) * u * p


@triton.jit
def swiglu_backward(da, g, u, p):
    """fp32 tiles; returns (dg, du, dp_part) with dp_part the [BM] sum over this tile's columns."""
    e = 1.0 + tl.exp(-g)
    sig = 1.0 / e
    silu_g = g / e
    dg = da * p * u * (sig * (1.0 + g * (1.0 - sig)))
    du = da * p * silu_g
    dp_part = tl.sum(da * (silu_g * u), axis=1)
    return dg, du, dp_part


@triton.jit
def clamped_swiglu_forward(g, u, p, alpha, limit):
    """fp32 tiles: (clamp(u, -limit, limit) + 1) * gc * sigmoid(alpha * gc) * p, gc = min(g,
    limit)."""
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    return (uc + 1.0) * (gc * (1.0 / (1.0 + tl.exp(-alpha * gc)))) * p


@triton.jit
def clamped_swiglu_backward(da, g, u, p, alpha, limit):
    """fp32 tiles; returns (dg, du, dp_part) as swiglu_backward, for the clamped variant."""
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    sig = 1.0 / (1.0 + tl.exp(-alpha * gc))
    glu = gc * sig
    dap = da * p
    dg = tl.where(g <= limit, dap * (uc + 1.0) * (sig + alpha * gc * sig * (1.0 - sig)), 0.0)
    du = tl.where((u >= -limit) & (u <= limit), dap * glu, 0.0)
    dp_part = tl.sum(da * ((uc + 1.0) * glu), axis=1)
    return dg, du, dp_part


@triton.jit
def gated_forward(g, u, p, alpha, limit, CLAMPED: tl.constexpr):
    """The forward the kernels call: swiglu_forward, or clamped_swiglu_forward if CLAMPED."""
    if CLAMPED:
        return clamped_swiglu_forward(g, u, p, alpha, limit)
    else:
        return swiglu_forward(g, u, p)


@triton.jit
def gated_backward(da, g, u, p, alpha, limit, CLAMPED: tl.constexpr):
    """The backward the kernels call: swiglu_backward, or clamped_swiglu_backward if CLAMPED."""
    if CLAMPED:
        return clamped_swiglu_backward(da, g, u, p, alpha, limit)
    else:
        return swiglu_backward(da, g, u, p)
