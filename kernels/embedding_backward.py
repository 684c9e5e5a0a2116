"""Token-embedding backward written straight into the weight's gradient buffer.

dW[v] = sum over tokens t with ids[t] == v of dy[t], summed in fp32 in ascending token order
(the order torch's CPU embedding backward adds them in), rounded once to dW's dtype. Rows no
token uses get exactly zero (write) or keep their value (accumulate).

Why: torch's embedding backward returns a dense [V, H] gradient, which a sink (moegraph_cli/
grads.py) must then copy into `.grad`: for Qwen3's V = 151936, H = 2048 in bf16 that is a
zero fill (0.6 GB written) and a copy (0.6 GB read, 0.6 GB written) per step. Here `.grad`
itself is zero-filled (write mode only; the one unavoidable pass, since `.grad` holds last
step's values) and the used rows are written once.

Layout contract:
- dy [T, H] in any float dtype, contiguous last dimension (any row stride); ids [T] int32 or
  int64, contiguous, every id in [0, V) (not checked: no host sync).
- out [V, H] (the sink's `.grad`, dtype of the weight), contiguous last dimension. Write mode
  (`accumulate=False`): every element is written: `out.zero_()`, then one store per used row.
  Accumulate mode: out[v] = round(out[v] + sum), one rounding (as `addmm_` with beta = 1 for
  the GEMM-written sinks); rows no token uses are not touched. `out` may hold NaN before a
  write-mode call.
- Deterministic, no atomics: the ids are sorted (stable, so each row's tokens stay in token
  order); the program at the first sorted position of each row's run sums the whole run in a
  sequential fp32 loop and owns that row. Row * row stride is formed in int64.
Rounding against torch: in fp32 the sum is bitwise torch's CPU result (0 + dy[t1] + dy[t2] +
... in token order); torch's CUDA kernels sum in another order (per 32-token batches below 3072
tokens, rounding to the weight's dtype between batches; partial segments of the sorted ids
above), so on CUDA the results agree to rounding, and in bf16 ours rounds once where torch
may round once per batch.
No padding_idx: the models here never set one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp_fusion import FUSED


@triton.jit
def _embedding_rows_kernel(
    dy_ptr, sorted_ids_ptr, order_ptr, out_ptr,
    num_tokens, hidden, stride_dy, stride_out,
    ACCUMULATE: tl.constexpr, UNROLL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pos = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < hidden
    row = tl.load(sorted_ids_ptr + pos)
    prev = tl.where(pos > 0, tl.load(sorted_ids_ptr + tl.maximum(pos - 1, 0)), -1)
    if row != prev:  # the first position of the row's run: this program owns the row
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        more = row == row
        p = pos
        while more:
            for u in tl.static_range(UNROLL):
                q = p + u
                same = tl.load(sorted_ids_ptr + q, mask=q < num_tokens, other=-1) == row
                tok = tl.load(order_ptr + q, mask=same, other=0)
                cols = tl.where(same, hidden, 0)  # a token of another row reads nothing
                acc += tl.load(dy_ptr + tok.to(tl.int64) * stride_dy + offs_h,
                               mask=offs_h < cols, other=0.0).to(tl.float32)
                more = same
            p += UNROLL
        out_ptrs = out_ptr + row.to(tl.int64) * stride_out + offs_h
        if ACCUMULATE:
            acc = tl.load(out_ptrs, mask=h_ok, other=0.0).to(tl.float32) + acc
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def embedding_backward_into(dy_TH: torch.Tensor, ids_T: torch.Tensor, out_VH: torch.Tensor,
                            accumulate: bool) -> torch.Tensor:
    """Write (or, `accumulate`, add) the embedding gradient of `dy_TH` for `ids_T` into
    `out_VH` (see the module docstring); returns `out_VH`. Sync-free, static grid (T, H)."""
    num_tokens, hidden = dy_TH.shape
    if not accumulate:
        out_VH.zero_()
    if num_tokens == 0:
        return out_VH
    sorted_ids, order = torch.sort(ids_T.contiguous(), stable=True)
    if dy_TH.is_cuda:
        block_h, unroll, warps = min(1024, triton.next_power_of_2(hidden)), 4, 4
    else:  # the interpreter: runs longer than UNROLL cross the while loop's iterations
        block_h, unroll, warps = min(64, triton.next_power_of_2(hidden)), 2, 1
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    _embedding_rows_kernel[grid](
        dy_TH, sorted_ids, order, out_VH, num_tokens, hidden, dy_TH.stride(0),
        out_VH.stride(0), ACCUMULATE=accumulate, UNROLL=unroll, BLOCK_H=block_h,
        num_warps=warps, enable_fp_fusion=FUSED)
    return out_VH


def embedding_backward_ref(dy_TH: torch.Tensor, ids_T: torch.Tensor,
                           num_weights: int) -> torch.Tensor:
    """torch's dense embedding gradient [V, H] (what F.embedding's backward returns)."""
    return torch.ops.aten.embedding_dense_backward(dy_TH, ids_T, num_weights, -1, False)
