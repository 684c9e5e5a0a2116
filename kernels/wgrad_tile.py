"""The dW tile of kernels/wgrad.py (`wgrad_tile`) and the persistent loop that loads each tile's
slot range a tile ahead (`wgrad_tiles_ahead`). The layout contract is wgrad.py's.

A tile of a short K loop (about 512 slots an expert at T = 8192: eight K steps) spends a fixed
stretch before its first MMA: the expert's slot range, then the first token ids, then the
first operand rows, three dependent trips to memory. `wgrad_tiles_ahead` (GemmConfig.prefetch,
persistent) loads the slot range two tiles ahead and the first token ids one tile ahead, so
both are in registers when their tile starts; with prefetch 2 it also asks the L2 for the
slot-order operand's rows of the next tile's first K step (l2_prefetch.py). Each tile still
sums the same terms in the same order: the values are the default loop's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .l2_prefetch import prefetch_l2
from .slot_schedule import grouped_pid


@triton.jit
def tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """dW tile `pid` -> (expert, pid_m, pid_n): expert-major, GROUP_M-grouped within one."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.cast(pid, tl.int32)  # a Python int in the interpreter's persistent loop
    expert = pid // (tiles_m * tiles_n)
    pid_m, pid_n = grouped_pid(pid % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
    return expert, pid_m, pid_n


@triton.jit
def first_tokens(slot_token_ptr, start, num_slots, num_tokens, BLOCK_K: tl.constexpr):
    """The token ids of a tile's first K step (the padded loop's `tok_next` before it)."""
    offs_k = tl.arange(0, BLOCK_K)
    return tl.load(slot_token_ptr + start + offs_k, mask=start + offs_k < num_slots,
                   other=num_tokens)


@triton.jit
def wgrad_tile(
    pid, l_ptr, r_ptr, l_desc, r_desc, dw_ptr, dw_desc, slot_token_ptr, expert_start_ptr,
    expert_count_ptr, M, N, num_tokens, num_slots, stride_l, stride_r, stride_dwe, stride_dwm,
    GATHER_L: tl.constexpr, GATHER_R: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PADDED: tl.constexpr, L_TMA: tl.constexpr, R_TMA: tl.constexpr,
    OUT_TMA: tl.constexpr,
):
    """dW tile `pid`, its slot range and first token ids loaded here."""
    expert, pid_m, pid_n = tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    start = tl.load(expert_start_ptr + expert)
    count = tl.load(expert_count_ptr + expert)
    tok_first = start  # unused by the masked loop
    if PADDED:
        tok_first = first_tokens(slot_token_ptr, start, num_slots, num_tokens, BLOCK_K)
    wgrad_tile_at(expert, pid_m, pid_n, start, count, tok_first, l_ptr, r_ptr, l_desc, r_desc,
                  dw_ptr, dw_desc, slot_token_ptr, M, N, num_tokens, num_slots, stride_l,
                  stride_r, stride_dwe, stride_dwm, GATHER_L, GATHER_R, ACCUMULATE, BLOCK_M,
                  BLOCK_N, BLOCK_K, PADDED, L_TMA, R_TMA, OUT_TMA)


@triton.jit
def wgrad_tiles_ahead(
    l_ptr, r_ptr, l_desc, r_desc, dw_ptr, dw_desc, slot_token_ptr, expert_start_ptr,
    expert_count_ptr, M, N, num_tokens, num_slots, num_tiles, stride_l, stride_r, stride_dwe,
    stride_dwm,
    GATHER_L: tl.constexpr, GATHER_R: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, L_TMA: tl.constexpr, R_TMA: tl.constexpr, OUT_TMA: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The persistent loop over this program's tiles (program_id, + num_programs, ...), the
    padded K loop only: tile i's slot range was loaded two tiles before it and its first token
    ids one tile before (tile ids past the last are clamped to it: loaded, never used)."""
    step = tl.num_programs(0)
    last = num_tiles - 1
    tile = tl.program_id(0)
    e0, m0, n0 = tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    start0 = tl.load(expert_start_ptr + e0)
    count0 = tl.load(expert_count_ptr + e0)
    e1, m1, n1 = tile_coords(tl.minimum(tile + step, last), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    start1 = tl.load(expert_start_ptr + e1)
    count1 = tl.load(expert_count_ptr + e1)
    tok0 = first_tokens(slot_token_ptr, start0, num_slots, num_tokens, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, step):
        # One tile ahead: the first token ids (its start arrived a tile ago). Two ahead: the
        # slot range.
        tok1 = first_tokens(slot_token_ptr, start1, num_slots, num_tokens, BLOCK_K)
        e2, m2, n2 = tile_coords(tl.minimum(tile + 2 * step, last), M, N, BLOCK_M, BLOCK_N,
                                 GROUP_M)
        start2 = tl.load(expert_start_ptr + e2)
        count2 = tl.load(expert_count_ptr + e2)
        if PREFETCH == 2:
            _prefetch_first_rows(l_ptr, r_ptr, start1, m1, n1, stride_l, stride_r, GATHER_L,
                                 GATHER_R, BLOCK_M, BLOCK_N, BLOCK_K)
        wgrad_tile_at(e0, m0, n0, start0, count0, tok0, l_ptr, r_ptr, l_desc, r_desc, dw_ptr,
                      dw_desc, slot_token_ptr, M, N, num_tokens, num_slots, stride_l, stride_r,
                      stride_dwe, stride_dwm, GATHER_L, GATHER_R, ACCUMULATE, BLOCK_M,
                      BLOCK_N, BLOCK_K, True, L_TMA, R_TMA, OUT_TMA)
        e0, m0, n0, start0, count0, tok0 = e1, m1, n1, start1, count1, tok1
        e1, m1, n1, start1, count1 = e2, m2, n2, start2, count2


@triton.jit
def _prefetch_first_rows(l_ptr, r_ptr, start, pid_m, pid_n, stride_l, stride_r,
                         GATHER_L: tl.constexpr, GATHER_R: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """L2 prefetch of the slot-order operand's rows start + [0, BLOCK_K) over a tile's
    columns (its first K step), a 128-byte line (64 two-byte elements) at a time. The
    gathered operand's rows would need the tile's token ids, which arrive only as it starts."""
    rows = (start + tl.arange(0, BLOCK_K)).to(tl.int64)
    if not GATHER_L:
        LINES_M: tl.constexpr = BLOCK_M // 64
        if LINES_M > 0:
            cols_m = pid_m * BLOCK_M + tl.arange(0, LINES_M) * 64
            prefetch_l2(l_ptr + rows[:, None] * stride_l + cols_m[None, :])
    if not GATHER_R:
        LINES_N: tl.constexpr = BLOCK_N // 64
        if LINES_N > 0:
            cols_n = pid_n * BLOCK_N + tl.arange(0, LINES_N) * 64
            prefetch_l2(r_ptr + rows[:, None] * stride_r + cols_n[None, :])


@triton.jit
def wgrad_tile_at(
    expert, pid_m, pid_n, start, count, tok_first, l_ptr, r_ptr, l_desc, r_desc, dw_ptr,
    dw_desc, slot_token_ptr, M, N, num_tokens, num_slots, stride_l, stride_r, stride_dwe,
    stride_dwm,
    GATHER_L: tl.constexpr, GATHER_R: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PADDED: tl.constexpr, L_TMA: tl.constexpr, R_TMA: tl.constexpr, OUT_TMA: tl.constexpr,
):
    """The K loop and store of the dW tile (expert, pid_m, pid_n) over the expert's slots
    [start, start + count); `tok_first`: the padded loop's first token ids."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # PADDED: the gathered operand's token ids, loaded one K step ahead (loop-carried): the
    # pipeliner then keeps num_stages buffers in flight, where an id load feeding its row load
    # in the same step leaves it about half as many.
    tok_next = tok_first
    end = start + count
    for k0 in range(0, count, BLOCK_K):
        slots = start + k0 + offs_k
        row_l = slots
        row_r = slots
        if PADDED:
            # The K tile stays inside the expert's live blocks (BLOCK_K divides the route
            # block): slots past the count are padding, zeros in a slot-order operand and
            # masked by their sentinel token in a gathered one. The next step's ids past the
            # expert's end read as that sentinel, as the padding slots hold it. (Masking by
            # `end` also keeps Triton 3.6 from dropping the count, when it is carried by
            # wgrad_tiles_ahead's loop: its layout pass lost a scalar used only as a bound.)
            tok = tok_next
            tok_next = tl.load(slot_token_ptr + slots + BLOCK_K,
                               mask=slots + BLOCK_K < end, other=num_tokens)
            l_mask = m_ok[:, None]
            r_mask = n_ok[None, :]
            if GATHER_L:
                row_l = tok
                l_mask = (tok < num_tokens)[None, :] & m_ok[:, None]
            if GATHER_R:
                row_r = tok
                r_mask = (tok < num_tokens)[:, None] & n_ok[None, :]
        else:
            k_ok = offs_k + k0 < count
            l_mask = k_ok[None, :] & m_ok[:, None]
            r_mask = k_ok[:, None] & n_ok[None, :]
            if GATHER_L:
                row_l = tl.load(slot_token_ptr + slots, mask=k_ok, other=0)
            if GATHER_R:
                row_r = tl.load(slot_token_ptr + slots, mask=k_ok, other=0)
        # L^T tile [BLOCK_M, BLOCK_K]: column k of it is row row_l[k] of L.
        if L_TMA:
            lt = l_desc.load([start + k0, pid_m * BLOCK_M]).T
        else:
            lt = tl.load(l_ptr + row_l.to(tl.int64)[None, :] * stride_l + offs_m[:, None],
                         mask=l_mask, other=0.0)
        if R_TMA:
            r = r_desc.load([start + k0, pid_n * BLOCK_N])
        else:
            r = tl.load(r_ptr + row_r.to(tl.int64)[:, None] * stride_r + offs_n[None, :],
                        mask=r_mask, other=0.0)
        acc = tl.dot(lt, r, acc)

    if OUT_TMA:
        # dW as [E * M, N] (M a multiple of BLOCK_M): the tile goes out by an asynchronous
        # bulk store, and the program moves on while the copy engine drains it.
        dw_desc.store([expert * M + pid_m * BLOCK_M, pid_n * BLOCK_N],
                      acc.to(dw_ptr.dtype.element_ty))
    else:
        dw_ptrs = (dw_ptr + expert.to(tl.int64) * stride_dwe
                   + offs_m.to(tl.int64)[:, None] * stride_dwm + offs_n[None, :])
        if ACCUMULATE:
            acc += tl.load(dw_ptrs, mask=m_ok[:, None] & n_ok[None, :],
                           other=0.0).to(tl.float32)
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
