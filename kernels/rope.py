"""Rotary embedding (halves layout), optionally after a per-head RMSNorm, with the transpose to
SDPA's layout folded in: one kernel forward, one backward.

Forward, per row x = q[b, s, n, :] (D = 2 * half; x1, x2 its halves; c, s' = cos[s], sin[s]):
    (norm)  r = rsqrt(sum(x^2) * inv_d + eps);  x <- round(w * round(x * r))    r saved
    y1 = round(round(x1 * c1) + round(-x2 * s'1))      torch's x * cos + rotate_half(x) * sin,
    y2 = round(round(x2 * c2) + round( x1 * s'2))      each op rounded to the dtype
Backward, given dy = dL/dy[b, n, s, :] (the autograd of the same torch ops):
    g1 = round(round(dy1 * c1) + round(dy2 * s'2))     mul backward, rotate_half's cat/neg
    g2 = round(round(dy2 * c2) - round(dy1 * s'1))     backward, autograd's sum of the two
    (norm)  gc = round(g * w);  dx = round(gc * r - (sum(gc * x32) * r^3 * inv_d) * x32)
            dW = round(sum over rows of round(g * round(x32 * r)))
round(.) is a rounding to the activation dtype (the identity in fp32), each at a point where
torch's unfused path (models/common/attention.py: norm.rms_norm, then rope.apply_rope) rounds,
and every sum of two products is formed from the two rounded products in fp32 (torch's bf16 ops
compute in fp32 and round once). The rope alone is therefore bitwise torch's in fp32 and in
bf16; with the norm, the fp32 sums of squares and of the backward's dot product (and dW's sum
over rows) are in another order, so those agree to a few ulps (see kernels/rmsnorm.py, whose
conventions, inv_d = fp32(1 / D) included, are the same). No fma anywhere
(`enable_fp_fusion=False`).

Layout contract:
- x [B, S, N, D] with last-dimension stride 1 and any other strides (the projection's output
  [B*S, N*D] viewed as heads). D even, half = D / 2 need not be a power of two (masked).
- cos, sin [>= S, D], last-dimension stride 1, one row stride; row s is position s. x, cos,
  sin and the norm weight [D] share one dtype (fp32, bf16 or fp16).
- y [B, N, S, D] as SDPA reads it, in one of two memory layouts (`layout`): "bnsd", contiguous;
  or "bsnd", the [B, N, S, D] view of a contiguous [B, S, N, D] tensor (the projection's row
  order: the stores are as coalesced as the loads, SDPA's cuDNN and flash kernels give their
  output, and the gradient, in that layout, so the output projection reads the attention
  output with no transpose copy either way).
- rstd [B*S*N] fp32 (norm only), every element written.
- dy [B, N, S, D] with last-dimension stride 1 and any other strides; dx [B, S, N, D]
  contiguous (a view of [B*S, N*D], the projection output's layout).
- dW: fp32 partial rows [P, D], every element written by its program, reduced in a fixed order
  by kernels/rmsnorm.reduce_dw (into a sink's `.grad`, written or accumulated, or a new
  tensor): deterministic, no atomics. Nothing syncs with the host: capturable.
"""

import torch
import triton
import triton.language as tl

from .rmsnorm import num_partials, reduce_dw, round_to, scratch

ROWS_PER_TILE = 16  # rows (one head of one token each) per forward program tile
# H200, qwen3-30b-a3b's q and k at 4 x 4096 (benchmarks/elementwise_ab.py, two runs): 2 warps
# 0.956-0.958 of the time of 4 (twin 1.000); 32 rows x 4 warps 0.973-0.975, 64 x 8 1.057.
FWD_WARPS = 2
LAYOUTS = ("bnsd", "bsnd")
# The backward's row blocks and programs: each program loops over its blocks in a fixed order
# (the dW partials' sum order), so several programs per SM keep enough loads in flight.
# H200, the same q and k: dW per row lane and 4 programs an SM 0.802 of the time of dW
# summed over each block's rows at 8 (twin 0.997; 8 programs with lanes 0.856, 16 0.954).
BWD_ROWS = 32
BWD_PROGRAMS_PER_SM = 4
BWD_WARPS = 4
BWD_DW_LANES = True


@triton.jit
def _rope_fwd_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr,
    n_rows, S, N, half, D, stride_xb, stride_xs, stride_xn, stride_cs, eps, inv_d,
    HAS_NORM: tl.constexpr, OUT_BSND: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    DT: tl.constexpr = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (b, s, n), n fastest
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    n = rows64 % N
    s = (rows64 // N) % S
    b = rows64 // (N * S)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < half
    mask = row_ok[:, None] & col_ok[None, :]
    x_row = x_ptr + (b * stride_xb + s * stride_xs + n * stride_xn)[:, None] + cols[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        eps = tl.full([], eps, tl.float32)
        inv_d = tl.full([], inv_d, tl.float32)
        r = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * inv_d + eps)
        tl.store(rstd_ptr + rows, r, mask=row_ok)
        w1 = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + cols, mask=col_ok, other=0.0).to(tl.float32)
        x1 = round_to(w1[None, :] * round_to(x1 * r[:, None], DT), DT)
        x2 = round_to(w2[None, :] * round_to(x2 * r[:, None], DT), DT)
    cs_row = (s * stride_cs)[:, None] + cols[None, :]
    c1 = tl.load(cos_ptr + cs_row, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs_row + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs_row, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs_row + half, mask=mask, other=0.0).to(tl.float32)
    y1 = round_to(x1 * c1, DT) + round_to(-x2 * s1, DT)
    y2 = round_to(x2 * c2, DT) + round_to(x1 * s2, DT)
    if OUT_BSND:
        y_row = y_ptr + (rows64 * D)[:, None] + cols[None, :]
    else:
        y_row = y_ptr + (((b * N + n) * S + s) * D)[:, None] + cols[None, :]
    tl.store(y_row, y1.to(DT), mask=mask)
    tl.store(y_row + half, y2.to(DT), mask=mask)


@triton.jit
def _rope_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, cos_ptr, sin_ptr, dx_ptr, dw_part_ptr,
    n_rows, S, N, half, D, stride_db, stride_dn, stride_ds, stride_xb, stride_xs, stride_xn,
    stride_cs, inv_d, n_blocks,
    HAS_NORM: tl.constexpr, HAS_DW: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, DW_LANES: tl.constexpr,
):
    DT: tl.constexpr = dx_ptr.dtype.element_ty
    inv_d = tl.full([], inv_d, tl.float32)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < half
    if HAS_NORM:
        w1 = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + cols, mask=col_ok, other=0.0).to(tl.float32)
    # DW_LANES: dW summed per (row lane, column) over the loop and over the lanes once at
    # the end, not over the rows of every block (a cross-warp reduction a block).
    if DW_LANES:
        dw1 = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        dw2 = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    else:
        dw1 = tl.zeros([BLOCK_H], dtype=tl.float32)
        dw2 = tl.zeros([BLOCK_H], dtype=tl.float32)
    # Program pid takes row blocks pid, pid + P, ...: a fixed assignment, a fixed sum order.
    for blk in range(pid, n_blocks, tl.num_programs(0)):
        rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        rows64 = rows.to(tl.int64)
        n = rows64 % N
        s = (rows64 // N) % S
        b = rows64 // (N * S)
        mask = row_ok[:, None] & col_ok[None, :]
        dy_row = dy_ptr + (b * stride_db + n * stride_dn + s * stride_ds)[:, None] \
            + cols[None, :]
        dy1 = tl.load(dy_row, mask=mask, other=0.0).to(tl.float32)
        dy2 = tl.load(dy_row + half, mask=mask, other=0.0).to(tl.float32)
        cs_row = (s * stride_cs)[:, None] + cols[None, :]
        c1 = tl.load(cos_ptr + cs_row, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs_row + half, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs_row, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs_row + half, mask=mask, other=0.0).to(tl.float32)
        g1 = round_to(round_to(dy1 * c1, DT) + round_to(dy2 * s2, DT), DT)
        g2 = round_to(round_to(dy2 * c2, DT) - round_to(dy1 * s1, DT), DT)
        if HAS_NORM:
            x_row = x_ptr + (b * stride_xb + s * stride_xs + n * stride_xn)[:, None] \
                + cols[None, :]
            x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_row + half, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            if HAS_DW and DW_LANES:
                dw1 += round_to(g1 * round_to(x1 * r[:, None], DT), DT)
                dw2 += round_to(g2 * round_to(x2 * r[:, None], DT), DT)
            elif HAS_DW:
                dw1 += tl.sum(round_to(g1 * round_to(x1 * r[:, None], DT), DT), axis=0)
                dw2 += tl.sum(round_to(g2 * round_to(x2 * r[:, None], DT), DT), axis=0)
            gc1 = round_to(g1 * w1[None, :], DT)
            gc2 = round_to(g2 * w2[None, :], DT)
            coef = (tl.sum(gc1 * x1, axis=1) + tl.sum(gc2 * x2, axis=1)) * (r * r * r) * inv_d
            g1 = gc1 * r[:, None] - coef[:, None] * x1
            g2 = gc2 * r[:, None] - coef[:, None] * x2
        dx_row = dx_ptr + (rows64 * D)[:, None] + cols[None, :]
        tl.store(dx_row, g1.to(DT), mask=mask)
        tl.store(dx_row + half, g2.to(DT), mask=mask)
    if HAS_DW:
        if DW_LANES:
            dw1, dw2 = tl.sum(dw1, axis=0), tl.sum(dw2, axis=0)
        part_row = dw_part_ptr + pid.to(tl.int64) * D + cols
        tl.store(part_row, dw1, mask=col_ok)
        tl.store(part_row + half, dw2, mask=col_ok)


# -- launchers --------------------------------------------------------------------------------
def _check(x_BSND: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
           weight: torch.Tensor | None) -> None:
    if x_BSND.dim() != 4 or x_BSND.stride(-1) != 1:
        raise ValueError(f"rope: x must be [B, S, N, D] with a contiguous last dimension, got "
                         f"shape {list(x_BSND.shape)} strides {list(x_BSND.stride())}")
    _check_tables(x_BSND.shape, x_BSND.dtype, cos_SD, sin_SD, weight)


def _check_tables(shape_BSND, dtype: torch.dtype, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
                  weight: torch.Tensor | None) -> None:
    S, D = shape_BSND[1], shape_BSND[3]
    if D % 2:
        raise ValueError(f"rope: the head dim must be even, got {D}")
    for name, t in (("cos", cos_SD), ("sin", sin_SD)):
        if t.dim() != 2 or t.shape[0] < S or t.shape[1] != D or t.stride(1) != 1:
            raise ValueError(f"rope: {name} must be [>= {S}, {D}] with a contiguous last "
                             f"dimension, got shape {list(t.shape)}")
        if t.dtype != dtype:
            raise ValueError(f"rope: {name} is {t.dtype}, x is {dtype}")
    if cos_SD.stride(0) != sin_SD.stride(0):
        raise ValueError("rope: cos and sin must have the same row stride")
    if weight is not None and (weight.shape != (D,) or weight.dtype != dtype):
        raise ValueError(f"rope: the norm weight is {weight.dtype} {list(weight.shape)}, x is "
                         f"{dtype} with head dim {D}")


def rope_forward(x_BSND: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
                 weight: torch.Tensor | None = None, eps: float = 1e-6, layout: str = "bnsd",
                 rows: int = ROWS_PER_TILE, num_warps: int = FWD_WARPS
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y [B, N, S, D] in `layout`, rstd [B*S*N] fp32 or None): rope of x, after an RMSNorm
    over each head with `weight` when given; see the module docstring. `rows` (a power of
    two) and `num_warps` set the tile; with the norm, the row's sum of squares is then
    formed in another order (rstd, and so y, within an ulp of another tile's)."""
    _check(x_BSND, cos_SD, sin_SD, weight)
    if layout not in LAYOUTS:
        raise ValueError(f"rope: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    B, S, N, D = x_BSND.shape
    if layout == "bsnd":
        y = torch.empty((B, S, N, D), dtype=x_BSND.dtype,
                        device=x_BSND.device).transpose(1, 2)
    else:
        y = torch.empty((B, N, S, D), dtype=x_BSND.dtype, device=x_BSND.device)
    n_rows = B * S * N
    rstd = None if weight is None else torch.empty(n_rows, dtype=torch.float32,
                                                     device=x_BSND.device)
    if n_rows == 0 or D == 0:
        return y, rstd
    half = D // 2
    block_h = triton.next_power_of_2(half)
    _rope_fwd_kernel[(triton.cdiv(n_rows, rows),)](
        x_BSND, weight if weight is not None else cos_SD, cos_SD, sin_SD, y,
        rstd if rstd is not None else y, n_rows, S, N, half, D,
        x_BSND.stride(0), x_BSND.stride(1), x_BSND.stride(2), cos_SD.stride(0),
        float(eps), 1.0 / D, HAS_NORM=weight is not None, OUT_BSND=layout == "bsnd",
        BLOCK_R=rows, BLOCK_H=block_h, num_warps=num_warps, enable_fp_fusion=False)
    return y, rstd


def rope_backward(dy_BNSD: torch.Tensor, x_BSND: torch.Tensor | None, cos_SD: torch.Tensor,
                  sin_SD: torch.Tensor, weight: torch.Tensor | None = None,
                  rstd: torch.Tensor | None = None, need_dw: bool = True,
                  dw_out: torch.Tensor | None = None, accumulate: bool = False,
                  rows: int = BWD_ROWS, programs_per_sm: int = BWD_PROGRAMS_PER_SM,
                  num_warps: int = BWD_WARPS, dw_lanes: bool = BWD_DW_LANES
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx [B, S, N, D] contiguous in dy's dtype, dW or None). x and rstd are needed only
    with the norm (weight given; x may be None without); dW, norm only, goes into dw_out when
    given (written, or added with `accumulate`) and is then returned as None. `rows` (a power
    of two), `programs_per_sm` and `num_warps` set the tiling, `dw_lanes` whether a program
    sums dW per row lane until its last block (see the kernel): dx is the same at any; dW's
    fp32 partials, one per program, are summed in another order at another tiling."""
    if dy_BNSD.dim() != 4:
        raise ValueError(f"rope: dy must be [B, N, S, D], got shape {list(dy_BNSD.shape)}")
    B, N, S, D = dy_BNSD.shape
    has_norm = weight is not None
    if has_norm:
        _check(x_BSND, cos_SD, sin_SD, weight)
        if x_BSND.shape != (B, S, N, D) or x_BSND.dtype != dy_BNSD.dtype or rstd is None:
            raise ValueError(f"rope: x is {x_BSND.dtype} {list(x_BSND.shape)} (rstd given: "
                             f"{rstd is not None}), dy {dy_BNSD.dtype} "
                             f"{list(dy_BNSD.shape)}")
    else:
        _check_tables((B, S, N, D), dy_BNSD.dtype, cos_SD, sin_SD, None)
        x_BSND = dy_BNSD  # an unused pointer
    if dy_BNSD.stride(-1) != 1:
        dy_BNSD = dy_BNSD.contiguous()
    need_dw = need_dw and has_norm
    dx = torch.empty((B, S, N, D), dtype=dy_BNSD.dtype, device=dy_BNSD.device)
    n_rows = B * S * N
    if n_rows == 0 or D == 0:
        dx.zero_()
        if not need_dw:
            return dx, None
        if dw_out is None:
            return dx, torch.zeros(D, dtype=weight.dtype, device=dx.device)
        if not accumulate:
            dw_out.zero_()
        return dx, None
    half = D // 2
    block_h = triton.next_power_of_2(half)
    n_blocks = triton.cdiv(n_rows, rows)
    n_parts = num_partials(dx.device, n_blocks, programs_per_sm) if need_dw else n_blocks
    part = scratch((n_parts, D), dx.device) if need_dw else dx  # dx: an unused pointer
    _rope_bwd_kernel[(n_parts,)](
        dy_BNSD, x_BSND, weight if has_norm else cos_SD, rstd if has_norm else dx,
        cos_SD, sin_SD, dx, part, n_rows, S, N, half, D,
        dy_BNSD.stride(0), dy_BNSD.stride(1), dy_BNSD.stride(2),
        x_BSND.stride(0), x_BSND.stride(1), x_BSND.stride(2), cos_SD.stride(0), 1.0 / D,
        n_blocks, HAS_NORM=has_norm, HAS_DW=need_dw, BLOCK_R=rows, BLOCK_H=block_h,
        DW_LANES=dw_lanes, num_warps=num_warps, enable_fp_fusion=False)
    if not need_dw:
        return dx, None
    dw = reduce_dw(part, dx.dtype, weight.dtype, dw_out, accumulate)
    return dx, (None if dw_out is not None else dw)


# -- pure-torch reference ---------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(x_BSND: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
             weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """The unfused torch math (attention.py's CPU path), [B, N, S, D], autograd-able."""
    x = x_BSND
    if weight is not None:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        x = weight * x32.to(x.dtype)
    x = x.transpose(1, 2)
    S = x.shape[2]
    cos, sin = cos_SD[:S], sin_SD[:S]
    return x * cos + _rotate_half(x) * sin
