"""AdamW over flat buffers: one pass that reads p, g, m, v once and writes p, m, v once.

Layout contract:
- p, g, m, v: contiguous 1-D buffers of the same length n, m and v in p's dtype (as
  torch.optim.AdamW keeps them); bf16, fp16 or fp32, g in p's dtype. n may pass 2**31 (offsets
  are int64). Every element in [0, n) is updated, padding included: the update is elementwise,
  so a padding element (zero grad, whatever value) never reaches a real one. Buffers whose
  base and length are multiples of 16 elements get full-width (16-byte) vector accesses.
- lr: a 1-element fp32 or fp64 device tensor, read inside the kernel, so a CUDA graph that
  captured the launch uses whatever `lr.fill_(x)` wrote last.
- bias: a 5-element fp64 device tensor, for the (already advanced) step t,
  [1 - beta1**t, 1 - beta2**t, (1 - beta2**t) ** 0.5] from doubles (the single-tensor
  formulas) and [1 - b1**t, 1 - b2**t] from b1 = fp32(beta1), b2 = fp32(beta2) in fp32 (the
  fused ones), written on the device by `bias_correction_` from the device step count: no
  host sync.
- beta1, beta2, eps, weight_decay: plain kernel arguments, passed as fp64 (the "fp64"
  annotation; this module must not use `from __future__ import annotations`, which would turn
  the annotation into a string Triton ignores and pass them as fp32).

Two formula sets, each one torch implementation's op order; loads and stores are the same.

fp32 params (`FUSED_MATH=False`): torch.optim.AdamW's single-tensor path (foreach=False,
capturable=False; torch 2.11 and 2.13 CPU builds, x86 AVX512), bitwise, found by comparing on
random values (signs, magnitudes 1e-20..1e5, zeros) until no bit differed:
    p <- p * fp32(1 - lr*wd)                          param.mul_(1 - lr * wd); exact if wd == 0
    m <- fma(w1, g - m, m)  if |w1| < 0.5              exp_avg.lerp_(g, w1), w1 = fp32(1 - beta1):
         fma(w1 - 1, g - m, g)  otherwise              the vectorised lerp, one rounding
    v <- fma(w2 * g, g, v * fp32(beta2))              .mul_(beta2).addcmul_(g, g, value=w2):
                                                      the compiler contracts self + w2*t1*t2
    denom <- sqrt(v) / fp32(bc2 ** 0.5) + fp32(eps)   (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    p <- p + (fp32(-(lr / bc1)) * m) / denom           param.addcdiv_(m, denom, value=-step)
  - torch forms each scalar as a Python double and its CPU kernels round it to fp32 once. Here
    the lr-dependent ones are formed in fp64 from the device lr and rounded once. The powers
    must be libm's pow bitwise (pow(x, 0.5) differs from sqrt(x) about once in 1000), which
    no Triton backend offers in the interpreter, so `bias_correction_` forms them with
    torch.pow on the device (libm's pow on CPU): a few tiny ops, captured with the kernel.
  - sqrt and division are the IEEE-rounded ones (`sqrt_rn`, `div_rn`; Triton's fp32 `/` is
    approximate on GPUs). torch's CPU `sqrt` is MKL's vsSqrt, which is NOT IEEE-rounded (about
    1 fp32 value in 5 is 1 ulp off on an AVX512 host, and the pattern is MKL's and the ISA
    path's); it is not emulated, so the parameters are bitwise torch's run with an IEEE sqrt
    (exp_avg, exp_avg_sq bitwise plain torch's). The pure-torch path in moegraph_cli/train/optim.py
    is bitwise plain torch's.
  - fma: on GPUs `tl.fma`, and fp-contraction is off (`enable_fp_fusion=False`), so no other
    mul/add pair is fused: fp32 on a GPU gives the interpreter's bits. Under TRITON_INTERPRET,
    Triton 3.6's interpreter evaluates tl.fma as a*b + c with two roundings (3.9's is fused), so
    there it is emulated (`EMULATE_FMA`): a product of fp32 values is exact in fp64, the fp64
    sum is made round-to-odd with its TwoSum error, and rounding that to fp32 is then correct
    (53 >= 24 + 2 bits, Boldo and Melquiond's argument); tests compare it bitwise with torch.

bf16 / fp16 params (`FUSED_MATH=True`): torch's fused CUDA AdamW (`_fused_adamw_`), as
measured on an H200 with torch 2.11 (2.13's CUDA build not checked): candidate formulas were
compared bitwise with it on 16M-67M elements per step (the textbook beta1 * m + (1 - beta1) * g
in fp64 missed 1.7% of m, bias corrections in fp64 0.4% of p, lr / bc1 in fp64 4e-5 of p; the
lines below missed none, and 3 steps over 0.22e9 parameters came out bitwise).
Values in fp32, b1 = fp32(beta1), b2 = fp32(beta2):
    p <- fp32(p - (lr*wd) * p)                        in fp64 (skipped for wd == 0)
    m <- fma(b1, m, fma(-b1, g, g))                   the two-fma lerp
    v <- fma(b2, v, fma(-b2, g*g, g*g))
    bc1 <- 1 - b1**t, bc2 <- 1 - b2**t                fp32 (powf on the device)
    step <- fp32(lr) / bc1;  bc2_sqrt <- sqrt(bc2)    fp32
    denom <- fp32(fp32(sqrt(v) / bc2_sqrt) + eps)     the sum in fp64
    p <- p - step * m / denom                          fp32; then p, m, v rounded to the dtype
  sqrt and division are the IEEE ones (as nvcc's defaults); `PRECISE=False` takes the
  approximate fp32 ones instead (1% faster on an H200, and a few fp32 ulps that the bf16
  rounding mostly hides). A GradScaler's grad_scale / found_inf have no counterpart here.
"""

import torch
import triton
import triton.language as tl

from .env import interpreting

# H200 sweep (benchmarks/optimizer.py --sweep, bf16): 1024 elements x 4 warps moved 4.24 TB/s
# against a 4.30 TB/s copy; 4096 x 4 fell to 2.9 TB/s.
BLOCK_GPU = 1024
NUM_WARPS_GPU = 4
BLOCK_INTERPRET = 1024


@triton.jit
def _fma_rn_fp32(a, b, c):
    """fp32 a * b + c with one rounding, from fp64 arithmetic only (see EMULATE_FMA above)."""
    prod = a.to(tl.float64) * b.to(tl.float64)  # 48 significant bits: exact
    c64 = c.to(tl.float64)
    s = prod + c64
    bb = s - prod
    err = (prod - (s - bb)) + (c64 - bb)  # TwoSum: prod + c == s + err exactly
    bits = s.to(tl.int64, bitcast=True)
    # Round to odd: an inexact s with an even last bit moves one ulp toward the exact sum.
    # err is NaN only when s is infinite or NaN, which stays as it is.
    fix = (err != 0) & (err == err) & ((bits & 1) == 0)
    step = tl.where((err > 0) == (s > 0), 1, -1).to(tl.int64)
    bits = tl.where(fix, bits + step, bits)
    return bits.to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def _fma(a, b, c, EMULATE_FMA: tl.constexpr):
    if EMULATE_FMA:
        return _fma_rn_fp32(a, b, c)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _single_tensor_math(p, g, m, v, lr, bc1, bc2_pow_half, beta1, beta2, eps, weight_decay,
                        EMULATE_FMA: tl.constexpr):
    one = tl.full([], 1.0, tl.float64)
    decay = (one - lr * weight_decay).to(tl.float32)
    neg_step = (-(lr / bc1)).to(tl.float32)
    w1 = (one - beta1).to(tl.float32)
    w1_small = tl.abs(w1) < 0.5
    p = p * decay
    m = _fma(tl.where(w1_small, w1, w1 - 1.0), g - m, tl.where(w1_small, m, g), EMULATE_FMA)
    v = _fma((one - beta2).to(tl.float32) * g, g, v * beta2.to(tl.float32), EMULATE_FMA)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_pow_half.to(tl.float32)) + eps.to(tl.float32)
    p = p + tl.div_rn(neg_step * m, denom)
    return p, m, v


@triton.jit
def _fused_math(p, g, m, v, lr, bc1, bc2, beta1, beta2, eps, weight_decay,
                PRECISE: tl.constexpr, EMULATE_FMA: tl.constexpr):
    lr_wd = lr * weight_decay
    p64 = p.to(tl.float64)
    p = tl.where(weight_decay != 0, (p64 - lr_wd * p64).to(tl.float32), p)
    b1 = beta1.to(tl.float32)
    b2 = beta2.to(tl.float32)
    g2 = g * g
    m = _fma(b1, m, _fma(-b1, g, g, EMULATE_FMA), EMULATE_FMA)
    v = _fma(b2, v, _fma(-b2, g2, g2, EMULATE_FMA), EMULATE_FMA)
    step = tl.div_rn(lr.to(tl.float32), bc1.to(tl.float32))
    bc2_sqrt = tl.sqrt_rn(bc2.to(tl.float32))
    if PRECISE:
        denom = (tl.div_rn(tl.sqrt_rn(v), bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
        p = p - tl.div_rn(step * m, denom)
    else:
        denom = ((tl.sqrt(v) / bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
        p = p - step * m / denom
    return p, m, v


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, lr_ptr, bias_ptr, n,
    beta1: "fp64", beta2: "fp64", eps: "fp64", weight_decay: "fp64",
    BLOCK: tl.constexpr, FUSED_MATH: tl.constexpr, PRECISE: tl.constexpr,
    EMULATE_FMA: tl.constexpr,
):
    # tl.full keeps a Python float (the interpreter's argument) in fp64; on a GPU the
    # arguments are fp64 scalars already.
    beta1 = tl.full([], beta1, tl.float64)
    beta2 = tl.full([], beta2, tl.float64)
    eps = tl.full([], eps, tl.float64)
    weight_decay = tl.full([], weight_decay, tl.float64)
    lr = tl.load(lr_ptr).to(tl.float64)

    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    if FUSED_MATH:
        p, m, v = _fused_math(p, g, m, v, lr, tl.load(bias_ptr + 3), tl.load(bias_ptr + 4),
                              beta1, beta2, eps, weight_decay, PRECISE, EMULATE_FMA)
    else:
        p, m, v = _single_tensor_math(p, g, m, v, lr, tl.load(bias_ptr), tl.load(bias_ptr + 2),
                                      beta1, beta2, eps, weight_decay, EMULATE_FMA)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def bias_correction_(step: torch.Tensor, pow_consts: torch.Tensor, pow_consts32: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """out (fp64 [5]) <- the bias corrections of the contract above, on the device.

    pow_consts: fp64 [beta1, beta2, 0.5]; pow_consts32: fp32 [4], [fp32(beta1), fp32(beta2)]
    then scratch; step: a 1-element int64 tensor. torch.pow of doubles on CPU is libm's pow,
    which Python's ** calls, so out[:3] are bitwise the doubles torch.optim.AdamW computes;
    torch.pow of fp32 is powf, as in torch's fused kernel."""
    torch.pow(pow_consts[:2], step, out=out[:2])
    out[:2].neg_().add_(1.0)  # exactly 1 - x, one rounding
    torch.pow(out[1:2], pow_consts[2:], out=out[2:3])
    torch.pow(pow_consts32[:2], step, out=pow_consts32[2:])
    pow_consts32[2:].neg_().add_(1.0)
    out[3:].copy_(pow_consts32[2:])
    return out


def adamw_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               lr: torch.Tensor, bias: torch.Tensor, beta1: float, beta2: float, eps: float,
               weight_decay: float, fused_math: bool | None = None, precise: bool = True,
               block: int | None = None, num_warps: int | None = None) -> None:
    """One AdamW update of the flat buffers p, m, v in place from g (contract above).

    fused_math: torch's fused CUDA formulas (default for bf16 / fp16) or its single-tensor
    ones (default for fp32). precise: IEEE sqrt and division in the fused formulas' last step
    (the single-tensor formulas always use them). block, num_warps: for tuning."""
    n = p.numel()
    for name, t in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.numel() != n or t.dtype != p.dtype or t.device != p.device:
            raise ValueError(f"adamw_step: {name} is {t.dtype} [{t.numel()}] on {t.device}, "
                             f"the param is {p.dtype} [{n}] on {p.device}")
    if not (p.is_contiguous() and g.is_contiguous() and m.is_contiguous()
            and v.is_contiguous()):
        raise ValueError("adamw_step: the flat buffers must be contiguous")
    if n == 0:
        return
    emulate = interpreting()
    fused_math = p.dtype != torch.float32 if fused_math is None else fused_math
    block = block or (BLOCK_INTERPRET if emulate else BLOCK_GPU)
    _adamw_kernel[(triton.cdiv(n, block),)](
        p, g, m, v, lr, bias, n, float(beta1), float(beta2), float(eps), float(weight_decay),
        BLOCK=block, FUSED_MATH=fused_math, PRECISE=precise, EMULATE_FMA=emulate,
        num_warps=num_warps or NUM_WARPS_GPU, enable_fp_fusion=False)
