"""The gathered K loop shared by fc1_swiglu.py and dact_swiglu.py (`gathered_k_loop`).

Its A tile is a block of gathered token rows (row slot_token[s] of a [T, K] tensor, the
padding rows masked to zeros: the sentinel rules of gemm_config.py); its B tiles come from
an expert's weight, through pointers or a host TMA descriptor (tma.py). The loop's contract
is in the function's docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gathered_k_loop(acc0, acc1, a_ptrs, row_ok, k_size,
                    b0_ptrs, b1_ptrs, b_step, n_ok, b_desc, b_row, b_col, b1_row_offset,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                    TWO_B: tl.constexpr, B_TMA: tl.constexpr, B_NK: tl.constexpr,
                    B_PAIR: tl.constexpr = False):
    """acc0 += A @ B0 (and acc1 += A @ B1 if TWO_B) over k in [0, k_size), BLOCK_K at a time.

    A [BM, BK]: gathered rows, a_ptrs already offset by slot_token; padding rows (row_ok
    False) and columns past k_size read zeros. B [BK, BN] comes from pointers (b0_ptrs /
    b1_ptrs, advanced by b_step; columns past n_ok and rows past k_size read zeros) or, with
    B_TMA, from the descriptor b_desc: B_NK tiles [BN, BK] at (b_row, k) and
    (b_row + b1_row_offset, k), transposed; otherwise tiles [BK, BN] at (b_row + k, b_col).
    B_PAIR (with B_TMA, B_NK, not TWO_B): b_desc is 3-D, its [2, BN, BK] box at (b_row, b_col,
    k) is the [2 BN, BK] tile B0, transposed.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, k_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = offs_k + k0 < k_size
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if B_TMA:
            if B_PAIR:
                pair = b_desc.load([b_row, b_col, k0])
                b0 = tl.reshape(pair, (2 * pair.shape[1], pair.shape[2])).T
            elif B_NK:
                b0 = b_desc.load([b_row, k0]).T
                if TWO_B:
                    b1 = b_desc.load([b_row + b1_row_offset, k0]).T
            else:
                b0 = b_desc.load([b_row + k0, b_col])
        elif EVEN_K:
            if EVEN_N:
                b0 = tl.load(b0_ptrs)
                if TWO_B:
                    b1 = tl.load(b1_ptrs)
            else:
                b0 = tl.load(b0_ptrs, mask=n_ok[None, :], other=0.0)
                if TWO_B:
                    b1 = tl.load(b1_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            b0 = tl.load(b0_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if TWO_B:
                b1 = tl.load(b1_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc0 = tl.dot(a, b0, acc0)
        if TWO_B:
            acc1 = tl.dot(a, b1, acc1)
        a_ptrs += BLOCK_K
        if not B_TMA:
            b0_ptrs += b_step
            if TWO_B:
                b1_ptrs += b_step
    return acc0, acc1
