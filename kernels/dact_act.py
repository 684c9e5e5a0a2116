"""The SwiGLU backward over dA as its own memory-bound kernel (dact_swiglu's `act_kernel`).

dact_swiglu's GEMM then ends in one store, dA rounded to the input dtype, and this kernel does
what its epilogue would have done from that same value: the GEMM keeps no [BM, BN] epilogue
with two Y1 loads and three stores between one tile's K loop and the next.

Layout contract (S slots, RouteList blocks of `block_m` slots, F ffn width):
- da [S, F] in the input dtype, as dact_swiglu's GEMM wrote it for every row of a live block.
- Reads Y1 [S, 2F], the top-k weights [N] by slot_route, block_expert [S / block_m].
- Writes, for every row of every live block (block_expert >= 0), dY1 [S, 2F], A [S, F] and
  dp_part [S, cdiv(F, width)] fp32, one column a `width`-wide column tile: exactly what the
  GEMM epilogue writes for the same dA (gated_act.py's helpers, the same rounding), except
  that each dp_part column sums its `width` terms in this kernel's order. Rows of dead blocks
  are never read or written. A padding slot (slot_route == N) reads dA, Y1 and p as zeros and
  gets zeros.
- Row index * row stride is formed in int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .env import ints_from_env
from .fp_fusion import FUSED
from .gated_act import gated_backward, gated_forward

# A tile (rows a program, warps, dp_part columns a program) from
# MOEGRAPH_DACT_ACT_TILE="rows,warps,cols", read once here (benchmarks/dact_act_tiles.py sets
# the module's value between captures).
TILE_OVERRIDE = ints_from_env("MOEGRAPH_DACT_ACT_TILE", "rows,warps,cols")


@triton.jit
def _dact_act_tile(
    row0, col, da_ptr, y1_ptr, weights_ptr, slot_route_ptr, dy1_ptr, act_ptr, dp_ptr, alpha,
    limit, num_routes, ffn, stride_da, stride_y1, stride_dy1, stride_act, stride_dp,
    BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, CLAMPED: tl.constexpr,
):
    """Rows [row0, row0 + BLOCK_R) x dp_part column `col` (BLOCK_Q columns of F)."""
    offs_m = row0 + tl.arange(0, BLOCK_R)
    offs_n = col * BLOCK_Q + tl.arange(0, BLOCK_Q)
    n_ok = offs_n < ffn
    route = tl.load(slot_route_ptr + offs_m)
    route_ok = route < num_routes
    rows = offs_m.to(tl.int64)[:, None]
    mask = route_ok[:, None] & n_ok[None, :]
    da = tl.load(da_ptr + rows * stride_da + offs_n[None, :], mask=mask, other=0.0)
    y1_ptrs = y1_ptr + rows * stride_y1 + offs_n[None, :]
    g = tl.load(y1_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y1_ptrs + ffn, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(weights_ptr + route, mask=route_ok, other=0.0).to(tl.float32)
    dg, du, dp_part = gated_backward(da.to(tl.float32), g, u, p[:, None], alpha, limit,
                                     CLAMPED)
    act = gated_forward(g, u, p[:, None], alpha, limit, CLAMPED)
    out_mask = n_ok[None, :]
    dy1_ptrs = dy1_ptr + rows * stride_dy1 + offs_n[None, :]
    tl.store(dy1_ptrs, dg.to(dy1_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dy1_ptrs + ffn, du.to(dy1_ptr.dtype.element_ty), mask=out_mask)
    tl.store(act_ptr + rows * stride_act + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=out_mask)
    tl.store(dp_ptr + offs_m.to(tl.int64) * stride_dp + col, dp_part)


@triton.jit
def _dact_act_kernel(
    da_ptr, y1_ptr, weights_ptr, slot_route_ptr, block_expert_ptr, dy1_ptr, act_ptr, dp_ptr,
    alpha, limit, num_routes, ffn, num_cols, stride_da, stride_y1, stride_dy1, stride_act,
    stride_dp, ROUTE_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr,
    COLS: tl.constexpr, CLAMPED: tl.constexpr,
):
    """One program: BLOCK_R rows x COLS consecutive dp_part columns of BLOCK_Q."""
    row0 = tl.program_id(0) * BLOCK_R
    if tl.load(block_expert_ptr + row0 // ROUTE_BLOCK) < 0:
        return
    for c in tl.static_range(COLS):
        col = tl.program_id(1) * COLS + c
        if col < num_cols:
            _dact_act_tile(row0, col, da_ptr, y1_ptr, weights_ptr, slot_route_ptr, dy1_ptr,
                           act_ptr, dp_ptr, alpha, limit, num_routes, ffn, stride_da,
                           stride_y1, stride_dy1, stride_act, stride_dp, BLOCK_R, BLOCK_Q,
                           CLAMPED)


def dact_act(da_SF: torch.Tensor, y1_S2F: torch.Tensor, topk_weights_N: torch.Tensor,
             slot_route_S: torch.Tensor, block_expert: torch.Tensor, block_m: int,
             dy1_out: torch.Tensor, act_out: torch.Tensor, dp_part_out: torch.Tensor,
             width: int, clamp=None) -> None:
    """Fill dy1_out, act_out and dp_part_out (one column a `width`-wide column tile) for the
    live blocks, from da_SF (see the module docstring). `clamp` = (alpha, limit) picks the
    clamped SwiGLU backward."""
    num_slots, ffn = da_SF.shape
    if dp_part_out.shape[1] != triton.cdiv(ffn, width):
        raise ValueError(f"dact_act: dp_part_out has {dp_part_out.shape[1]} columns, "
                         f"{triton.cdiv(ffn, width)} wanted for {width}-wide tiles")
    num_cols = triton.cdiv(ffn, width)
    # GPU: 16 rows, 4 warps, a row block's columns in one program (up to 16): the fastest of
    # benchmarks/dact_act_tiles.py on an H100 at T = 8192 / 32768 (0.927x / 0.904x the 32-row
    # tile of one column; dact_act_tiles_h100.json). The CPU runs two columns a program.
    rows, warps, cols = (min(16, block_m), 4, min(num_cols, 16)) if da_SF.is_cuda else \
        (min(16, block_m), 1, 2)
    if da_SF.is_cuda and TILE_OVERRIDE is not None:
        rows, warps, cols = TILE_OVERRIDE
    if block_m % rows or width & (width - 1):
        raise ValueError(f"dact_act: {rows} rows a program must divide the block of {block_m}, "
                         f"and the column tile ({width}) be a power of two")
    alpha, limit = (1.0, 1.0) if clamp is None else (float(clamp[0]), float(clamp[1]))
    grid = (num_slots // rows, triton.cdiv(num_cols, cols))
    _dact_act_kernel[grid](
        da_SF, y1_S2F, topk_weights_N, slot_route_S, block_expert, dy1_out, act_out,
        dp_part_out, alpha, limit, topk_weights_N.numel(), ffn, num_cols, da_SF.stride(0),
        y1_S2F.stride(0), dy1_out.stride(0), act_out.stride(0), dp_part_out.stride(0),
        ROUTE_BLOCK=block_m, BLOCK_R=rows, BLOCK_Q=width, COLS=cols,
        CLAMPED=clamp is not None, num_warps=warps, enable_fp_fusion=FUSED)
