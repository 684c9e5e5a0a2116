"""The gated activation (SwiGLU times the route probability), as GEMM-epilogue helpers.

There is no standalone activation kernel: the forward activation rides the FC1 epilogue and
its backward rides the epilogue of the dA gather-GEMM (both in gather_gemm.py), so no pass over
an [S, F] tensor is spent on it. These helpers are the one place the math lives.

Contract (per slot s and column f < F, Y1 = [gate | up] of width 2F in the input dtype):
- forward: A = silu(g) * u * p, computed in fp32 from g, u already rounded to the input dtype
  (the values stored in Y1), then rounded to the input dtype by the caller. Backward recomputes
  A from the stored Y1 with the same helper, so it gets bitwise the forward's A.
- backward, given dA (rounded to the input dtype, as autograd would hand it):
  dg = dA * p * u * silu'(g), du = dA * p * silu(g), and dp = sum_f dA * silu(g) * u, all fp32.
  silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))), as torch's silu_backward.
- p is the route's top-k weight in fp32; padding slots carry p = 0 and g = u = 0.
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
