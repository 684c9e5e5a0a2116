"""Which slot block (and which expert) each program of a slot GEMM computes.

Three schedules over the RouteList's blocks (see route_align.py for the layout):
- one program per tile, `grouped_pid` order (GROUP_M row blocks at a time share L2);
- persistent: one program per SM, each first listing the live M blocks (`live_block_list`),
  then looping over their tiles (`persistent_tile`);
- the split tail (`TAIL` constexpr of the slot GEMMs). An expert's segment is padded up to a
  multiple of the route block BM, and its real slots come first, so only its *last* block can
  be partly padding. Where that block holds at most BM/2 real rows, a BM-row tile spends half
  its MMA work or more on padding (with uniform routing of 512 routes per expert and BM = 128,
  half the experts: about 5.6% of all the FC1 / FC2 work). A split launch therefore runs
    TAIL = 1: BM-row tiles over every live block except those (`second_half_real`), then
    TAIL = 2: BM/2-row tiles, one program per (expert, column tile) (`short_tail`): expert e's
              last block when it holds 1..BM/2 real rows; its second half is only padding and
              is written as zeros without a matmul (the padding-rows contract of gemm_config.py).
  Every other block keeps its BM-row tile, so no row is computed twice or skipped.
  Measured on the H200 (Qwen3 shape, T = 8192): the 64-row tail tiles ran slower per row than
  the 128-row tiles they replace, so the split is an opt-in variant (GemmConfig.split_tail).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (pid_m, pid_n), GROUP_M row blocks at a time so their tiles share L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def program_tile(pid, num_blocks, num_pid_n, block_expert_ptr, slot_route_ptr, num_routes,
                 expert_counts_ptr, expert_starts_ptr, num_slots, GROUP_M: tl.constexpr,
                 BLOCK_M: tl.constexpr, ROUTE_BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """Program pid of a one-program-per-tile launch -> (pid_m, pid_n, expert, ok); the
    program exits at once where ok is False.

    TAIL 0 / 1: grouped_pid order over the blocks; not ok for a dead block (expert -1) and,
    with TAIL = 1 (BLOCK_M = the route block), for a block whose second half holds no real
    slot (slot_route is the sentinel num_routes there): the tail launch computes it.
    TAIL = 2 (BLOCK_M = ROUTE_BLOCK / 2): one program per (expert, column tile), on the first
    half of the expert's last block; not ok where that block holds no real row or more than
    BLOCK_M of them, or would lie past the slots (a broken max_kept contract).
    """
    if TAIL == 2:
        expert = pid // num_pid_n
        pid_n = pid % num_pid_n
        pid_m, ok = short_tail(expert, expert >= 0, expert_counts_ptr, expert_starts_ptr,
                               num_slots, ROUTE_BLOCK, BLOCK_M)
    else:
        pid_m, pid_n = grouped_pid(pid, num_blocks, num_pid_n, GROUP_M)
        expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ROUTE_BLOCK)
        ok = expert >= 0
        if TAIL == 1:
            ok = second_half_real(slot_route_ptr, pid_m, ok, num_routes, BLOCK_M)
    return pid_m, pid_n, expert, ok


@triton.jit
def short_tail(expert, ok, expert_counts_ptr, expert_starts_ptr, num_slots,
               ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """(pid_m, ok) of `expert`'s last block, seen as BLOCK_M = ROUTE_BLOCK / 2 row blocks (its
    first half), for experts (a scalar or a vector) where `ok`: ok stays True only where that
    block holds 1..BLOCK_M real rows and lies within the slots (a broken max_kept contract
    could put it past them)."""
    count = tl.load(expert_counts_ptr + expert, mask=ok, other=0)
    rem = count % ROUTE_BLOCK
    row0 = tl.load(expert_starts_ptr + expert, mask=ok, other=0) + count - rem
    return row0 // BLOCK_M, ok & (rem > 0) & (rem <= BLOCK_M) & (row0 + ROUTE_BLOCK <= num_slots)


@triton.jit
def second_half_real(slot_route_ptr, pid_m, ok, num_routes, BLOCK_M: tl.constexpr):
    """ok, and block pid_m's second half holds a real slot (slot_route is the sentinel
    num_routes on padding); False leaves the block to the tail launch."""
    second = tl.load(slot_route_ptr + pid_m * BLOCK_M + BLOCK_M // 2, mask=ok, other=num_routes)
    return ok & (second < num_routes)


@triton.jit
def store_zero_rows(ptr, row0, stride, offs_n, n_ok, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Zeros into rows [row0, row0 + BLOCK_M), columns offs_n (masked by n_ok): the all-padding
    second half of a tail block."""
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=ptr.dtype.element_ty)
    tl.store(ptr + rows * stride + offs_n[None, :], zeros, mask=n_ok[None, :])


@triton.jit
def store_zero_gated_rows(y_ptr, act_ptr, row0, stride_y, stride_act, pid_n, ffn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          STORE_ACT: tl.constexpr = True):
    """store_zero_rows for a gated kernel's column tile pid_n: Y [rows, 2F] at gate columns n
    and up columns F + n, and (STORE_ACT) the activation [rows, F] at n."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < ffn
    store_zero_rows(y_ptr, row0, stride_y, offs_n, n_ok, BLOCK_M, BLOCK_N)
    store_zero_rows(y_ptr, row0, stride_y, offs_n + ffn, n_ok, BLOCK_M, BLOCK_N)
    if STORE_ACT:
        store_zero_rows(act_ptr, row0, stride_act, offs_n, n_ok, BLOCK_M, BLOCK_N)


@triton.jit
def live_block_list(block_expert_ptr, live_list_ptr, num_blocks, slot_route_ptr, num_routes,
                    expert_counts_ptr, expert_starts_ptr, num_experts, num_slots,
                    BLOCK_M: tl.constexpr, ROUTE_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                    SCAN_FREE: tl.constexpr, TAIL: tl.constexpr):
    """Write the live M blocks, in order, to live_list[0, :num_live] and their experts to
    live_list[1, :num_live] (this program's [2, num_blocks] int32 rows); return num_live.
    TAIL = 1 leaves out the blocks whose second half holds no real slot (the tail launch
    computes them); TAIL = 2 lists exactly those, one per expert at most, as the BLOCK_M =
    ROUTE_BLOCK / 2 block of their first half (program_tile's rule, as a list).

    The barrier makes the writes visible to all of the program's threads before its tile loop
    reads them. SCAN_FREE ranks by a [CHUNK, CHUNK] comparison instead of tl.cumsum: Triton's
    Hopper warp-specialization pass rejects kernels holding a scan.
    """
    num_live = tl.zeros((), dtype=tl.int32)
    num_items = num_experts if TAIL == 2 else num_blocks
    for c0 in range(0, num_items, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        if TAIL == 2:  # idx: experts
            be = idx
            idx, live = short_tail(idx, idx < num_experts, expert_counts_ptr,
                                   expert_starts_ptr, num_slots, ROUTE_BLOCK, BLOCK_M)
        else:  # idx: M blocks
            be = tl.load(block_expert_ptr + (idx * BLOCK_M) // ROUTE_BLOCK,
                         mask=idx < num_blocks, other=-1)
            live = be >= 0
        if TAIL == 1:
            live = second_half_real(slot_route_ptr, idx, live, num_routes, BLOCK_M)
        if SCAN_FREE:
            earlier = tl.arange(0, CHUNK)[None, :] <= tl.arange(0, CHUNK)[:, None]
            rank = tl.sum((earlier & live[None, :]).to(tl.int32), axis=1)
        else:
            rank = tl.cumsum(live.to(tl.int32), 0)
        at = num_live + rank - 1
        tl.store(live_list_ptr + at, idx, mask=live)
        tl.store(live_list_ptr + num_blocks + at, be, mask=live)
        num_live += tl.sum(live.to(tl.int32), 0)
    tl.debug_barrier()
    return num_live


@triton.jit
def persistent_tile(tile, live_list_ptr, num_live, num_blocks, num_pid_n, GROUP_M: tl.constexpr):
    """Live-tile id of a persistent loop -> (pid_m, pid_n, expert); tile ids count live tiles
    only, grouped as grouped_pid does."""
    pid_live, pid_n = grouped_pid(tile, num_live, num_pid_n, GROUP_M)
    pid_m = tl.load(live_list_ptr + pid_live)
    expert = tl.load(live_list_ptr + num_blocks + pid_live)
    return pid_m, pid_n, expert


def tail_grid(num_experts: int, n: int, block_n: int) -> tuple[int]:
    """Grid of a TAIL = 2 launch: one program per (expert, column tile)."""
    return (max(1, num_experts * triton.cdiv(n, block_n)),)
