"""The routing weights' gradient from dA's per-tile partial sums, in one kernel.

dp[t, j] = sum over c of dp_part[token_slots[t, j], c], accumulated in fp32 in column order c =
0..C-1, then rounded to out's dtype; 0 for a dropped route (token_slots -1: its row is never
read). This is the chain the backward ran as seven torch ops (sum over the columns, an int64
cast, a clamp, an index, a compare, a where, a cast), each its own launch over [T * k].

Layout contract: dp_part [S, C] fp32 with a contiguous last dimension (kernels/dact_swiglu's
`dp_part_out`); token_slots [T, k] int32 from the RouteList; out [T, k], every element written.
Only real slots are read, so padding rows of dp_part may hold anything. The tile changes no
value: each route's sum runs over the columns in order whatever the tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp_fusion import FUSED


@triton.jit
def _route_weight_grad_kernel(dp_ptr, token_slots_ptr, out_ptr, num_routes, stride_dp,
                              COLS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_routes
    slot = tl.load(token_slots_ptr + offs, mask=ok, other=-1)
    live = slot >= 0
    rows = dp_ptr + slot.to(tl.int64) * stride_dp
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in tl.static_range(COLS):
        acc += tl.load(rows + c, mask=live, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def route_weight_grad(dp_part_SC: torch.Tensor, token_slots_TK: torch.Tensor,
                      out_TK: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Fill out_TK [T, k] with each route's dp (see the module doc); returns out_TK. block:
    routes a program (a power of two; by default 256 on CUDA, 32 in the interpreter)."""
    if dp_part_SC.dtype != torch.float32 or dp_part_SC.stride(-1) != 1:
        raise ValueError(f"route_weight_grad: dp_part must be fp32 with a contiguous last "
                         f"dimension, got {dp_part_SC.dtype} strides {list(dp_part_SC.stride())}")
    if out_TK.shape != token_slots_TK.shape or not out_TK.is_contiguous() \
            or not token_slots_TK.is_contiguous():
        raise ValueError(f"route_weight_grad: out {list(out_TK.shape)} and token_slots "
                         f"{list(token_slots_TK.shape)} must be the same contiguous shape")
    num_routes = token_slots_TK.numel()
    block = block or (256 if dp_part_SC.is_cuda else 32)
    _route_weight_grad_kernel[(triton.cdiv(num_routes, block),)](
        dp_part_SC, token_slots_TK, out_TK, num_routes, dp_part_SC.stride(0),
        COLS=dp_part_SC.shape[1], BLOCK=block, num_warps=4 if dp_part_SC.is_cuda else 1,
        enable_fp_fusion=FUSED)
    return out_TK


def route_weight_grad_ref(dp_part_SC: torch.Tensor, token_slots_TK: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """The same in torch, column by column in order (the kernel's bits)."""
    slots = token_slots_TK.long()
    rows = dp_part_SC[slots.clamp(min=0)]
    acc = torch.zeros(slots.shape, dtype=torch.float32, device=dp_part_SC.device)
    for c in range(dp_part_SC.shape[1]):
        acc = acc + rows[..., c]
    return torch.where(slots >= 0, acc, 0.0).to(dtype)
