"""Top-k indices of each row of a router's scores: one program holds a block of rows in
registers and takes the row maximum k times.

Layout contract:
- x [T, E] fp32, bf16 or fp16, last-dimension stride 1, any row stride; E <= MAX_E.
- ids [T, k] int64, contiguous, every element written: row t's k largest in descending order,
  a tie going to the lower index (torch.topk leaves the order of ties unspecified; with
  distinct values the two agree). NaN ranks above every number, as in torch.topk; -inf is an
  ordinary value, so k == E picks every column once.
- No host sync, static shapes: capturable. The values are the caller's gather
  (`x.gather(1, ids)`), which autograd differentiates as it does torch.topk's values.

`topk_ids_ref` is the same contract in pure torch (a stable descending sort): the tests'
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp_fusion import FUSED

MAX_E = 1024
TILE_ELEMS = 4096  # rows x next_power_of_2(E) per program


@triton.jit
def _topk_ids_kernel(x_ptr, ids_ptr, T, E, stride_x,
                     K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    live = row_ok[:, None] & (cols < E)[None, :]  # columns not yet taken
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=live,
                other=0.0).to(tl.float32)
    is_nan = x != x
    for j in tl.static_range(K):
        nan_left = live & is_nan
        num = tl.where(live & ~is_nan, x, float("-inf"))
        top = tl.max(num, axis=1)
        # The lowest live column holding the top value (or, before any number, a NaN).
        pick_num = live & ~is_nan & (num == top[:, None])
        idx_num = tl.min(tl.where(pick_num, cols[None, :], BLOCK_E), axis=1)
        idx_nan = tl.min(tl.where(nan_left, cols[None, :], BLOCK_E), axis=1)
        idx = tl.where(idx_nan < BLOCK_E, idx_nan, idx_num)
        tl.store(ids_ptr + rows.to(tl.int64) * K + j, idx.to(tl.int64), mask=row_ok)
        live = live & (cols[None, :] != idx[:, None])


def topk_ids(x_TE: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids [T, k] int64 of each row's k largest (module docstring); into `out` when given."""
    if x_TE.dim() != 2 or x_TE.stride(-1) != 1:
        raise ValueError(f"router_topk: x must be [T, E] with a contiguous last dimension, got "
                         f"shape {list(x_TE.shape)} strides {list(x_TE.stride())}")
    T, E = x_TE.shape
    if not 0 < k <= E or E > MAX_E:
        raise ValueError(f"router_topk: need 0 < k <= E <= {MAX_E}, got k={k}, E={E}")
    if out is None:
        out = torch.empty((T, k), dtype=torch.int64, device=x_TE.device)
    elif out.shape != (T, k) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"router_topk: out must be contiguous int64 [{T}, {k}]")
    if T == 0:
        return out
    block_e = triton.next_power_of_2(E)
    block_r = max(1, min(TILE_ELEMS // block_e, 64))
    _topk_ids_kernel[(triton.cdiv(T, block_r),)](
        x_TE, out, T, E, x_TE.stride(0), K=k, BLOCK_R=block_r, BLOCK_E=block_e, num_warps=4,
        enable_fp_fusion=FUSED)
    return out


def topk_ids_ref(x_TE: torch.Tensor, k: int) -> torch.Tensor:
    """The contract in torch: a stable descending sort (NaN first, ties to the lower index)."""
    return torch.sort(x_TE, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
