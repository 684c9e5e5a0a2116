"""Expert dW on Hopper, warp-specialized (Gluon): the loads run ahead across tiles.

The same sums as wgrad.py's long-loop tile (dW[e] = sum over expert e's slots of
L[row_L(s)]^T R[row_R(s)], its layout contract, padded K loop and tile order), for the one
case the Triton kernel cannot pipeline across tiles: one operand in slot order (loaded by TMA)
and the other gathered by token (loaded by cp.async, which Hopper's TMA cannot gather).
Triton 3.6 warp-specializes only all-TMA loops, and its software pipeliner refills at every
tile, so each tile of a short expert (8-16 K steps at T = 8192-16384) waits for its first
gathered rows; Nsight Compute put 22-35% of the dW warps' time there
(benchmarks/results/ncu_kernels_source_h100.json).

Here one program an SM runs two partitions over the same (tile, K step) sequence:
- a producer (4 warps) that, for every K step, waits for a free stage, issues the slot-order
  operand's TMA box (its bytes expected on the stage's `ready_s` barrier) and the gathered
  operand's rows by cp.async (`ready_g`: each producer thread arrives once its own copies
  land), the token ids loaded one step ahead, across tile boundaries;
- the default partition (8 warps, two warpgroups) that waits on both barriers, runs the
  stage's wgmma and hands the stage back (`empty`) once the wgmma has read it, then stores
  the tile by a TMA store and moves on while the producer has already filled the next tile's
  stages.
Each tile sums its K steps in the same order, with the same wgmma shapes, as the Triton
kernel: the values are the same (tests/kernels/test_wgrad_ws.py compares bitwise).

Gluon runs on NVIDIA GPUs only (no interpreter): `available(device)` says whether this path
can run; the launcher (wgrad.expert_wgrad) falls back to the Triton kernel otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

from .fp_fusion import FUSED
from .gluon_hopper import GL_DTYPES, GLUON, available, descriptor, rows_aligned  # noqa: F401
from .slot_schedule import grouped_pid

if GLUON:
    from .gluon_hopper import (async_copy, await_gathered_stage, cp_async, fence_async_shared, gl,
                               gluon, mbarrier, tma, tma_load, tma_store, warpgroup_mma,
                               warpgroup_mma_wait)


# The launch's partitions: the default one (the two consumer warpgroups) and the producer,
# with the producer's register budget (the consumers get the rest). A 384-wide tile keeps
# 192 fp32 accumulator registers a consumer thread: its producer gets WIDE_PRODUCER_REGS,
# leaving the consumers (65536 - 128 * WIDE_PRODUCER_REGS) / 256.
CONSUMER_WARPS, PRODUCER_WARPS, PRODUCER_REGS, WIDE_PRODUCER_REGS = 8, 4, 96, 40
# The slot-order side of a tile: a power of two up to MAIN_SIDE, or MAIN_SIDE + EXTRA_SIDE
# (384), held as two parts (Triton's blocks are powers of two; a wgmma and a TMA box are at
# most 256 wide): a 256-wide part and a 128-wide one, each with its own shared buffers,
# accumulator and store. The gathered side is shared by both parts' wgmma.
MAIN_SIDE, EXTRA_SIDE = 256, 128


def slot_parts(side: int) -> tuple[int, int] | None:
    """(main, extra) widths of a slot-order side, None where this kernel cannot take it."""
    if side == MAIN_SIDE + EXTRA_SIDE:
        return MAIN_SIDE, EXTRA_SIDE
    if side <= MAIN_SIDE and side & (side - 1) == 0:
        return side, 0
    return None


if GLUON:

    @gluon.jit
    def _tile_of(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        """Tile -> (expert, pid_m, pid_n): expert-major, GROUP_M row tiles at a time within
        an expert (wgrad.py's order)."""
        per_expert = tiles_m * tiles_n
        pid_m, pid_n = grouped_pid(tile % per_expert, tiles_m, tiles_n, GROUP_M)
        return tile // per_expert, pid_m, pid_n

    @gluon.jit
    def _producer(s_desc, x_desc, g_ptr, stride_g, slot_token_ptr, expert_start_ptr,
                  expert_count_ptr, s_bufs, x_bufs, g_bufs, ready_s, ready_g, empty, M, N,
                  num_tokens, num_slots, num_tiles, GATHER_L: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr, EXTRA: gl.constexpr):
        STAGES: gl.constexpr = s_bufs.shape[0]
        MAIN: gl.constexpr = s_bufs.shape[2]
        if EXTRA > 0:
            STAGE_BYTES: gl.constexpr = s_desc.block_type.nbytes + x_desc.block_type.nbytes
        else:
            STAGE_BYTES: gl.constexpr = s_desc.block_type.nbytes
        G_COLS: gl.constexpr = BLOCK_M if GATHER_L else BLOCK_N
        TPW_C: gl.constexpr = G_COLS // 8 if G_COLS // 8 < 32 else 32
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_C, TPW_C],
                                                [gl.num_warps(), 1], [1, 0])
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
        offs_c = gl.arange(0, G_COLS, layout=gl.SliceLayout(0, layout))
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        step = gl.num_programs(0)
        tile = gl.program_id(0)
        expert, pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        start = gl.load(expert_start_ptr + expert)
        count = gl.load(expert_count_ptr + expert)
        slots = start + offs_k
        tok_next = gl.load(slot_token_ptr + slots, mask=slots < num_slots, other=num_tokens)
        it = 0
        for tile in range(gl.program_id(0), num_tiles, step):
            # The next tile's expert range, read while this tile's steps are issued.
            nxt = tile + step
            n_expert, n_pid_m, n_pid_n = _tile_of(nxt, tiles_m, tiles_n, GROUP_M)
            n_live = nxt < num_tiles
            n_start = gl.load(expert_start_ptr + n_expert, mask=n_live, other=0)
            n_count = gl.load(expert_count_ptr + n_expert, mask=n_live, other=0)
            if GATHER_L:
                s_col = pid_n * BLOCK_N
                g_col = pid_m * BLOCK_M
                g_ok = (g_col + offs_c) < M
            else:
                s_col = pid_m * BLOCK_M
                g_col = pid_n * BLOCK_N
                g_ok = (g_col + offs_c) < N
            for k0 in range(0, count, BLOCK_K):
                tok = tok_next
                # The next K step's token ids: this tile's, or the next tile's first.
                base = gl.where(k0 + BLOCK_K < count, start + k0 + BLOCK_K, n_start)
                slots = base + offs_k
                tok_next = gl.load(slot_token_ptr + slots, mask=slots < num_slots,
                                   other=num_tokens)
                stage = it % STAGES
                phase = (it // STAGES) & 1
                mbarrier.wait(empty.index(stage), phase ^ 1)
                bar_s = ready_s.index(stage)
                mbarrier.expect(bar_s, STAGE_BYTES)
                tma_load(s_desc, [start + k0, s_col], bar_s, s_bufs.index(stage))
                if EXTRA > 0:
                    tma_load(x_desc, [start + k0, s_col + MAIN], bar_s, x_bufs.index(stage))
                ptrs = (g_ptr + tok.to(gl.int64)[:, None] * stride_g
                        + (g_col + offs_c)[None, :])
                mask = (tok < num_tokens)[:, None] & g_ok[None, :]
                cp_async(g_bufs.index(stage), ptrs, mask=mask)
                async_copy.mbarrier_arrive(ready_g.index(stage), increment_count=False)
                it += 1
            if count == 0:
                slots = n_start + offs_k
                tok_next = gl.load(slot_token_ptr + slots, mask=slots < num_slots,
                                   other=num_tokens)
            start = n_start
            count = n_count
            pid_m = n_pid_m
            pid_n = n_pid_n

    @gluon.jit
    def _consumer(dw_desc, dwx_desc, expert_count_ptr, s_bufs, x_bufs, g_bufs, ready_s,
                  ready_g, empty, out_buf, out_x, M, N, num_tiles, GATHER_L: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr, EXTRA: gl.constexpr, num_warps: gl.constexpr):
        STAGES: gl.constexpr = s_bufs.shape[0]
        # The main part's accumulator, and the extra part's (the slot-order side's last
        # EXTRA rows or columns of the tile).
        ACC_M: gl.constexpr = BLOCK_M if GATHER_L else BLOCK_M - EXTRA
        ACC_N: gl.constexpr = BLOCK_N - EXTRA if GATHER_L else BLOCK_N
        X_M: gl.constexpr = BLOCK_M if GATHER_L else EXTRA
        X_N: gl.constexpr = EXTRA if GATHER_L else BLOCK_N
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, ACC_N, 16])
        x_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, X_N, 16])
        # wgmma groups a K step: the previous step's are done when at most this many remain.
        PER_STEP: gl.constexpr = 2 if EXTRA > 0 else 1
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
            count = gl.load(expert_count_ptr + expert)
            acc = gl.zeros((ACC_M, ACC_N), gl.float32, acc_layout)
            if EXTRA > 0:
                acc_x = gl.zeros((X_M, X_N), gl.float32, x_layout)
            prev = 0
            for k0 in range(0, count, BLOCK_K):
                stage = it % STAGES
                phase = (it // STAGES) & 1
                await_gathered_stage(ready_s, ready_g, stage, phase)
                if GATHER_L:
                    a = g_bufs.index(stage).permute((1, 0))
                    acc = warpgroup_mma(a, s_bufs.index(stage), acc, is_async=True)
                    if EXTRA > 0:
                        acc_x = warpgroup_mma(a, x_bufs.index(stage), acc_x, is_async=True)
                else:
                    b = g_bufs.index(stage)
                    acc = warpgroup_mma(s_bufs.index(stage).permute((1, 0)), b, acc,
                                        is_async=True)
                    if EXTRA > 0:
                        acc_x = warpgroup_mma(x_bufs.index(stage).permute((1, 0)), b, acc_x,
                                              is_async=True)
                if EXTRA > 0:
                    acc, acc_x = warpgroup_mma_wait(num_outstanding=PER_STEP, deps=[acc, acc_x])
                else:
                    acc = warpgroup_mma_wait(num_outstanding=PER_STEP, deps=[acc])
                # The wgmma before this one has read its stage: hand it back.
                mbarrier.arrive(empty.index(prev), pred=k0 > 0)
                prev = stage
                it += 1
            if EXTRA > 0:
                acc, acc_x = warpgroup_mma_wait(num_outstanding=0, deps=[acc, acc_x])
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(empty.index(prev), pred=count > 0)
            tma.store_wait(0)  # the last tile's stores have left out_buf and out_x
            row = expert * M + pid_m * BLOCK_M
            col = pid_n * BLOCK_N
            out_buf.store(acc.to(dw_desc.dtype))
            if EXTRA > 0:
                out_x.store(acc_x.to(dw_desc.dtype))
            fence_async_shared()
            tma_store(dw_desc, [row, col], out_buf)
            if EXTRA > 0:
                if GATHER_L:
                    tma_store(dwx_desc, [row, col + ACC_N], out_x)
                else:
                    tma_store(dwx_desc, [row + ACC_M, col], out_x)
        tma.store_wait(0)

    @gluon.jit
    def _wgrad_ws_kernel(s_desc, x_desc, g_ptr, dw_desc, dwx_desc, slot_token_ptr,
                         expert_start_ptr, expert_count_ptr, M, N, num_tokens, num_slots,
                         num_tiles, stride_g, GATHER_L: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                         STAGES: gl.constexpr, EXTRA: gl.constexpr,
                         PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                         num_warps: gl.constexpr):
        dtype: gl.constexpr = s_desc.dtype
        G_COLS: gl.constexpr = BLOCK_M if GATHER_L else BLOCK_N
        s_bufs = gl.allocate_shared_memory(dtype, [STAGES] + s_desc.block_type.shape,
                                           s_desc.layout)
        g_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, G_COLS], dtype)
        g_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, G_COLS], g_layout)
        out_buf = gl.allocate_shared_memory(dtype, dw_desc.block_type.shape, dw_desc.layout)
        # The extra part's buffers; without one, the main part's stand in (never read).
        if EXTRA > 0:
            x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape,
                                               x_desc.layout)
            out_x = gl.allocate_shared_memory(dtype, dwx_desc.block_type.shape,
                                              dwx_desc.layout)
        else:
            x_bufs = s_bufs
            out_x = out_buf
        ready_s = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_g = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_s.index(i), count=1)
            # every producer thread arrives once its own cp.async copies have landed
            mbarrier.init(ready_g.index(i), count=PRODUCER_WARPS * 32)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (dw_desc, dwx_desc, expert_count_ptr, s_bufs, x_bufs, g_bufs,
                         ready_s, ready_g, empty, out_buf, out_x, M, N, num_tiles, GATHER_L,
                         BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EXTRA, num_warps)),
            (_producer, (s_desc, x_desc, g_ptr, stride_g, slot_token_ptr, expert_start_ptr,
                         expert_count_ptr, s_bufs, x_bufs, g_bufs, ready_s, ready_g, empty, M,
                         N, num_tokens, num_slots, num_tiles, GATHER_L, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, EXTRA)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


class Layout(NamedTuple):
    """A launch's boxes: the slot-order operand's main and extra parts (s_box, x_box: [BK,
    width]) and dW's (dw_box, dwx_box: the tile's first `main` and last `extra` columns for
    dW_down, whose slot-order side is N, or rows for dW_gate_up); without an extra part its
    boxes repeat the main part's (never used)."""
    s_box: tuple[int, int]
    x_box: tuple[int, int]
    dw_box: tuple[int, int]
    dwx_box: tuple[int, int]
    extra: int
    producer_regs: int


def layout(block_m: int, block_n: int, block_k: int, gather_l: bool) -> Layout:
    """The boxes and producer registers of a tile this kernel takes (`fits`)."""
    main, extra = slot_parts(block_n if gather_l else block_m)
    dw_box, dwx_box = (((block_m, main), (block_m, extra)) if gather_l
                       else ((main, block_n), (extra, block_n)))
    if not extra:
        return Layout((block_k, main), (block_k, main), dw_box, dw_box, 0, PRODUCER_REGS)
    return Layout((block_k, main), (block_k, extra), dw_box, dwx_box, extra,
                  WIDE_PRODUCER_REGS)


def fits(l_rows, r_rows, out_EMN, gather_l: bool, gather_r: bool, block_m: int,
         block_n: int, block_k: int, accumulate: bool) -> bool:
    """Whether this kernel takes the launch: exactly one operand gathered, 2-byte operands and
    dW of one dtype, no accumulation, M a multiple of BLOCK_M (the TMA store's boxes stay in
    an expert), and 16-byte aligned rows, operands and dW alike (a `.grad` view into a flat
    buffer may start anywhere)."""
    if gather_l == gather_r or accumulate or not out_EMN.is_contiguous():
        return False
    dtype = out_EMN.dtype
    if dtype not in GL_DTYPES or l_rows.dtype != dtype or r_rows.dtype != dtype:
        return False
    _, m, n = out_EMN.shape
    slot_side, gathered_side = (block_n, block_m) if gather_l else (block_m, block_n)
    if (m % block_m or n % block_n or slot_parts(slot_side) is None
            or gathered_side > MAIN_SIDE or gathered_side & (gathered_side - 1)):
        return False
    return rows_aligned(l_rows, r_rows, out_EMN.view(-1, n))


def expert_wgrad_ws(l_rows, r_rows, slot_token, expert_starts, expert_counts, num_tokens: int,
                    num_slots: int, out_EMN, gather_l: bool, block_m: int, block_n: int,
                    block_k: int, group_m: int, stages: int, num_programs: int):
    """Fill out_EMN [E, M, N] with wgrad.expert_wgrad's sums (see `fits` for the cases)."""
    num_experts, m, n = out_EMN.shape
    s_rows, g_rows = (r_rows, l_rows) if gather_l else (l_rows, r_rows)
    lay = layout(block_m, block_n, block_k, gather_l)
    dw_rows = out_EMN.view(num_experts * m, n)
    s_desc, dw_desc = descriptor(s_rows, lay.s_box), descriptor(dw_rows, lay.dw_box)
    x_desc, dwx_desc = ((descriptor(s_rows, lay.x_box), descriptor(dw_rows, lay.dwx_box))
                        if lay.extra else (s_desc, dw_desc))
    num_tiles = num_experts * (m // block_m) * (n // block_n)
    grid = (min(num_tiles, num_programs),)
    _wgrad_ws_kernel[grid](
        s_desc, x_desc, g_rows, dw_desc, dwx_desc, slot_token, expert_starts, expert_counts, m,
        n, num_tokens, num_slots, num_tiles, g_rows.stride(0),
        GATHER_L=gather_l, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        STAGES=stages, EXTRA=lay.extra, PRODUCER_WARPS=PRODUCER_WARPS,
        PRODUCER_REGS=lay.producer_regs,
        num_warps=CONSUMER_WARPS, enable_fp_fusion=FUSED)
    return out_EMN
