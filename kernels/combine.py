"""Gather-combine: each token pulls its routes' rows and sums them (no atomics, no scatter).

out[t] = sum over j = 0..k-1 of src[token_slots[t, j]], accumulated in fp32 in j order, then
rounded to out's dtype. With `base` [T, H] (the MoE layer's residual stream), out[t] = base[t] +
that rounded sum, added in fp32 and rounded once more: the bits of `base + gather_combine(...)`
in torch (one elementwise add computes in fp32 and rounds), without its own pass over [T, H].

Layout contract: src [S, H] in slot order (Y2 in the forward, dX per route in the backward),
row-major with a contiguous last dimension; token_slots [T, k] int32 from the RouteList, -1 for
a dropped route (skipped: contributes nothing, its row is never read). out [T, H]; every
element is written. Only real slots are read, so padding and dead blocks of src may hold
anything. Row index * row stride is formed in int64. The tile (tokens x columns a program,
warps) changes no value: each element's sum runs over j in order whatever the tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .env import ints_from_env
from .fp_fusion import FUSED


# A tile chosen by benchmarks/combine_sweep.py, (block_t, block_h, warps): from
# MOEGRAPH_COMBINE_TILE="block_t,block_h,warps", read once here, not on every call.
TILE_OVERRIDE = ints_from_env("MOEGRAPH_COMBINE_TILE", "block_t,block_h,warps")


@triton.jit
def _gather_combine_kernel(
    src_ptr, token_slots_ptr, out_ptr, base_ptr,
    num_tokens, hidden, stride_src, stride_out, stride_base,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BASE: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = offs_t < num_tokens
    h_ok = offs_h < hidden
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(token_slots_ptr + offs_t * TOP_K + j, mask=t_ok, other=-1)
        row = tl.load(src_ptr + slot.to(tl.int64)[:, None] * stride_src + offs_h[None, :],
                      mask=(slot >= 0)[:, None] & h_ok[None, :], other=0.0)
        acc += row.to(tl.float32)
    rows = offs_t.to(tl.int64)[:, None]
    ok = t_ok[:, None] & h_ok[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_BASE:
        base = tl.load(base_ptr + rows * stride_base + offs_h[None, :], mask=ok, other=0.0)
        out = (base.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows * stride_out + offs_h[None, :], out, mask=ok)


def gather_combine(src_SH: torch.Tensor, token_slots_TK: torch.Tensor,
                   out_TH: torch.Tensor, base_TH: torch.Tensor | None = None) -> torch.Tensor:
    num_tokens, top_k = token_slots_TK.shape
    hidden = src_SH.shape[1]
    if base_TH is not None and (base_TH.shape != out_TH.shape or base_TH.dtype != out_TH.dtype
                                or base_TH.stride(-1) != 1):
        raise ValueError(f"gather_combine: base must be {list(out_TH.shape)} {out_TH.dtype} "
                         f"with a contiguous last dimension, got {list(base_TH.shape)} "
                         f"{base_TH.dtype} strides {list(base_TH.stride())}")
    if src_SH.is_cuda:
        block_t, block_h, warps = 4, min(1024, triton.next_power_of_2(hidden)), 4
        if TILE_OVERRIDE is not None:
            block_t, block_h, warps = TILE_OVERRIDE
    else:
        block_t, block_h, warps = 16, min(64, triton.next_power_of_2(hidden)), 1
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))
    has_base = base_TH is not None
    _gather_combine_kernel[grid](
        src_SH, token_slots_TK, out_TH, base_TH if has_base else out_TH, num_tokens, hidden,
        src_SH.stride(0), out_TH.stride(0), base_TH.stride(0) if has_base else 0,
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, HAS_BASE=has_base, num_warps=warps,
        enable_fp_fusion=FUSED)
    return out_TH
