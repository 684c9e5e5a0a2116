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

FAST (a constexpr of every helper; the kernels pass GemmConfig.fast_act, True on a GPU): the
same formulas without the range fix-ups Triton wraps around its fp32 `exp` and `/` (each a
compare and predicated scalings an element, about a fifth of dA's epilogue instructions):
`1 + exp(-x)` as 1 + ex2.approx.ftz(x * -log2 e) (one multiply: (-x) * c is x * (-c) in every
rounding) and `a / e` as a * rcp.approx.ftz(e). The bits are the plain path's wherever
e = 1 + exp(-x) <= 2**126, that is x >= -87.33 (SwiGLU's gate; alpha * gc for the clamped
one): Triton's exp is ex2.approx of the same product and differs from the ftz one only by a
result below 2**-126, which 1 + it rounds away, and its div.full.f32 is a * rcp.approx(b) for
|b| <= 2**126. Below -87.33 the sigmoid (< 2**-126) and silu flush to zero where the plain
path gives values under 1e-35 in magnitude. The interpreter has no inline assembly: CPU
launches pass FAST = False.

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


# The FAST path's instructions, also spelled out by the Gluon FC1 (fc1_swiglu_ws.py): 2 ** y
# and 1 / y without denormal handling, and the factor that makes x * NEG_LOG2E = -x * log2 e
# (the fp32 log2 e of Triton's own exp).
EX2_FTZ = tl.constexpr("ex2.approx.ftz.f32 $0, $1;")
RCP_FTZ = tl.constexpr("rcp.approx.ftz.f32 $0, $1;")
NEG_LOG2E = tl.constexpr(-1.4426950216293334961)


@triton.jit
def _one_plus_exp_neg(x, FAST: tl.constexpr):
    """1 + exp(-x), fp32 (see FAST in the module docstring)."""
    if FAST:
        return 1.0 + tl.inline_asm_elementwise(EX2_FTZ, "=f,f", [x * NEG_LOG2E],
                                               dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 + tl.exp(-x)


@triton.jit
def _recip(e):
    """1 / e for e >= 1, the factor a / e is a times on the FAST path (see the module
    docstring); the plain path divides."""
    return tl.inline_asm_elementwise(RCP_FTZ, "=f,f", [e], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def swiglu_forward(g, u, p, FAST: tl.constexpr = False):
    """fp32 [BM, BN] gate and up tiles, p [BM, 1]: silu(g) * u * p (torch's silu formula)."""
    e = _one_plus_exp_neg(g, FAST)
    if FAST:
        return g * _recip(e) * u * p
    else:
        return g / e * u * p


@triton.jit
def swiglu_backward(da, g, u, p, FAST: tl.constexpr = False):
    """fp32 tiles; returns (dg, du, dp_part) with dp_part the [BM] sum over this tile's columns."""
    e = _one_plus_exp_neg(g, FAST)
    if FAST:
        sig = _recip(e)
        silu_g = g * sig
    else:
        sig = 1.0 / e
        silu_g = g / e
    dg = da * p * u * (sig * (1.0 + g * (1.0 - sig)))
    du = da * p * silu_g
    dp_part = tl.sum(da * (silu_g * u), axis=1)
    return dg, du, dp_part


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    """1 / (1 + exp(-x)), fp32."""
    e = _one_plus_exp_neg(x, FAST)
    if FAST:
        return _recip(e)
    else:
        return 1.0 / e


@triton.jit
def clamped_swiglu_forward(g, u, p, alpha, limit, FAST: tl.constexpr = False):
    """fp32 tiles: (clamp(u, -limit, limit) + 1) * gc * sigmoid(alpha * gc) * p, gc = min(g,
    limit)."""
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    return (uc + 1.0) * (gc * _sigmoid(alpha * gc, FAST)) * p


@triton.jit
def clamped_swiglu_backward(da, g, u, p, alpha, limit, FAST: tl.constexpr = False):
    """fp32 tiles; returns (dg, du, dp_part) as swiglu_backward, for the clamped variant."""
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    sig = _sigmoid(alpha * gc, FAST)
    glu = gc * sig
    dap = da * p
    dg = tl.where(g <= limit, dap * (uc + 1.0) * (sig + alpha * gc * sig * (1.0 - sig)), 0.0)
    du = tl.where((u >= -limit) & (u <= limit), dap * glu, 0.0)
    dp_part = tl.sum(da * ((uc + 1.0) * glu), axis=1)
    return dg, du, dp_part


@triton.jit
def gated_forward(g, u, p, alpha, limit, CLAMPED: tl.constexpr, FAST: tl.constexpr = False):
    """The forward the kernels call: swiglu_forward, or clamped_swiglu_forward if CLAMPED."""
    if CLAMPED:
        return clamped_swiglu_forward(g, u, p, alpha, limit, FAST)
    else:
        return swiglu_forward(g, u, p, FAST)


@triton.jit
def gated_backward(da, g, u, p, alpha, limit, CLAMPED: tl.constexpr,
                   FAST: tl.constexpr = False):
    """The backward the kernels call: swiglu_backward, or clamped_swiglu_backward if CLAMPED."""
    if CLAMPED:
        return clamped_swiglu_backward(da, g, u, p, alpha, limit, FAST)
    else:
        return swiglu_backward(da, g, u, p, FAST)
