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

from .fp_fusion import FUSED
from .gluon_hopper import GL_DTYPES, GLUON, available, descriptor, rows_aligned  # noqa: F401
from .slot_schedule import grouped_pid

if GLUON:
    from .gluon_hopper import (async_copy, await_gathered_stage, cp_async, fence_async_shared, gl,
                               gluon, mbarrier, tma, tma_load, tma_store, warpgroup_mma,
                               warpgroup_mma_wait)


# The launch's partitions: the default one (the two consumer warpgroups) and the producer,
# with the producer's register budget (the consumers get the rest).
CONSUMER_WARPS, PRODUCER_WARPS, PRODUCER_REGS = 8, 4, 96


if GLUON:

    @gluon.jit
    def _tile_of(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        """Tile -> (expert, pid_m, pid_n): expert-major, GROUP_M row tiles at a time within
        an expert (wgrad.py's order)."""
        per_expert = tiles_m * tiles_n
        pid_m, pid_n = grouped_pid(tile % per_expert, tiles_m, tiles_n, GROUP_M)
        return tile // per_expert, pid_m, pid_n

    @gluon.jit
    def _producer(s_desc, g_ptr, stride_g, slot_token_ptr, expert_start_ptr, expert_count_ptr,
                  s_bufs, g_bufs, ready_s, ready_g, empty, M, N, num_tokens, num_slots,
                  num_tiles, GATHER_L: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr):
        STAGES: gl.constexpr = s_bufs.shape[0]
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
                mbarrier.expect(bar_s, s_desc.block_type.nbytes)
                tma_load(s_desc, [start + k0, s_col], bar_s, s_bufs.index(stage))
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
    def _consumer(dw_desc, expert_count_ptr, s_bufs, g_bufs, ready_s, ready_g, empty, out_buf,
                  M, N, num_tiles, GATHER_L: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                  num_warps: gl.constexpr):
        STAGES: gl.constexpr = s_bufs.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
            count = gl.load(expert_count_ptr + expert)
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
            prev = 0
            for k0 in range(0, count, BLOCK_K):
                stage = it % STAGES
                phase = (it // STAGES) & 1
                await_gathered_stage(ready_s, ready_g, stage, phase)
                if GATHER_L:
                    a = g_bufs.index(stage).permute((1, 0))
                    b = s_bufs.index(stage)
                else:
                    a = s_bufs.index(stage).permute((1, 0))
                    b = g_bufs.index(stage)
                acc = warpgroup_mma(a, b, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
                # The wgmma before this one has read its stage: hand it back.
                mbarrier.arrive(empty.index(prev), pred=k0 > 0)
                prev = stage
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(empty.index(prev), pred=count > 0)
            tma.store_wait(0)  # the last tile's store has left out_buf
            out_buf.store(acc.to(dw_desc.dtype))
            fence_async_shared()
            tma_store(dw_desc, [expert * M + pid_m * BLOCK_M, pid_n * BLOCK_N], out_buf)
        tma.store_wait(0)

    @gluon.jit
    def _wgrad_ws_kernel(s_desc, g_ptr, dw_desc, slot_token_ptr, expert_start_ptr,
                         expert_count_ptr, M, N, num_tokens, num_slots, num_tiles, stride_g,
                         GATHER_L: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                         num_warps: gl.constexpr):
        dtype: gl.constexpr = s_desc.dtype
        G_COLS: gl.constexpr = BLOCK_M if GATHER_L else BLOCK_N
        s_bufs = gl.allocate_shared_memory(dtype, [STAGES] + s_desc.block_type.shape,
                                           s_desc.layout)
        g_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, G_COLS], dtype)
        g_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, G_COLS], g_layout)
        out_buf = gl.allocate_shared_memory(dtype, dw_desc.block_type.shape, dw_desc.layout)
        ready_s = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_g = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_s.index(i), count=1)
            # every producer thread arrives once its own cp.async copies have landed
            mbarrier.init(ready_g.index(i), count=PRODUCER_WARPS * 32)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (dw_desc, expert_count_ptr, s_bufs, g_bufs, ready_s, ready_g, empty,
                         out_buf, M, N, num_tiles, GATHER_L, BLOCK_M, BLOCK_N, BLOCK_K,
                         GROUP_M, num_warps)),
            (_producer, (s_desc, g_ptr, stride_g, slot_token_ptr, expert_start_ptr,
                         expert_count_ptr, s_bufs, g_bufs, ready_s, ready_g, empty, M, N,
                         num_tokens, num_slots, num_tiles, GATHER_L, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


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
    if m % block_m or n % block_n:
        return False
    return rows_aligned(l_rows, r_rows, out_EMN.view(-1, n))


def expert_wgrad_ws(l_rows, r_rows, slot_token, expert_starts, expert_counts, num_tokens: int,
                    num_slots: int, out_EMN, gather_l: bool, block_m: int, block_n: int,
                    block_k: int, group_m: int, stages: int, num_programs: int):
    """Fill out_EMN [E, M, N] with wgrad.expert_wgrad's sums (see `fits` for the cases)."""
    num_experts, m, n = out_EMN.shape
    s_rows, g_rows = (r_rows, l_rows) if gather_l else (l_rows, r_rows)
    s_box = (block_k, block_n) if gather_l else (block_k, block_m)
    s_desc = descriptor(s_rows, s_box)
    dw_desc = descriptor(out_EMN.view(num_experts * m, n), (block_m, block_n))
    num_tiles = num_experts * (m // block_m) * (n // block_n)
    grid = (min(num_tiles, num_programs),)
    _wgrad_ws_kernel[grid](
        s_desc, g_rows, dw_desc, slot_token, expert_starts, expert_counts, m, n,
        num_tokens, num_slots, num_tiles, g_rows.stride(0),
        GATHER_L=gather_l, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        STAGES=stages, PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=CONSUMER_WARPS, enable_fp_fusion=FUSED)
    return out_EMN
