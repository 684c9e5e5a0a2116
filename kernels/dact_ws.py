"""dA with the SwiGLU backward in its epilogue, on Hopper, warp-specialized (Gluon).

The same outputs as dact_swiglu.py's paired tile (dY1 [S, 2F], the recomputed A [S, F] and
dp_part [S, F / 64] fp32; its layout contract and sentinel rules), for the product's long-loop
case: 128-row route blocks, H a multiple of 64, F a multiple of 128, 2-byte operands.
Nsight Compute put 36-40% of the Triton kernel's warp time in its per-tile epilogue, which
nothing overlaps with the next tile's MMAs (benchmarks/results/ncu_kernels_source_h100.json).

One program an SM runs three partitions over the same sequence of live [128, 128] tiles
(dead blocks skipped by all three alike):
- a producer (4 warps): per K step, a free stage, the weight tile [64, 128] of w_down[e] by
  TMA (`ready_w`), the gathered dOut rows [128, 64] by cp.async (`ready_a`, every producer
  thread arriving once its own copies land); the next tile's token ids loaded a tile ahead;
- two consumers (4 warps each) taking the live tiles in turn (ping-pong): one runs its tile's
  wgmma K loop while the other runs the previous tile's epilogue, so the tensor cores do not
  wait for an epilogue. A `turn` barrier pair hands the K loop from one consumer to the other
  (a consumer may not run a lap of the stage ring ahead of the producer). The epilogue rounds
  the tile to bf16 into its own shared buffer and reads it back [32, 64] at a time in a
  row-contiguous layout: Y1 read, dY1 / A written 16 bytes a thread.
Each dA element sums the same K steps in the same order, with the same wgmma instructions, as
the Triton kernel, and goes through the same activation math (gated_act.py): dY1 and A are
bitwise the Triton kernel's; dp_part sums each 64-column group in another order (fp32, to
rounding; the paired Triton tile already sums in quarters). Gluon has no interpreter: the
launcher (dact_swiglu.dact_swiglu) takes this kernel on a Hopper GPU only.
"""

from __future__ import annotations

import torch

from .gemm_launch import act_scalars
from .fp_fusion import FUSED
from .slot_schedule import grouped_pid
from .wgrad_ws import GLUON

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .dact_swiglu import dact_act_store
    from .wgrad_ws import _cp_async, _nvmma, _tma_load

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
# 4 stages of [128, 64] dOut rows and [64, 128] weights (128 KB) beside the two consumers'
# [128, 128] epilogue buffers (64 KB).
WS_STAGES = 4


def fits(dout_TH, w_down_EHF, y1_S2F, route_block: int) -> bool:
    """Whether this kernel takes the launch (see the module docstring)."""
    E, H, F = w_down_EHF.shape
    if route_block != BLOCK_M or H % BLOCK_K or F % BLOCK_N:
        return False
    if dout_TH.dtype not in (torch.bfloat16, torch.float16):
        return False
    if w_down_EHF.dtype != dout_TH.dtype or y1_S2F.dtype != dout_TH.dtype:
        return False
    if not w_down_EHF.is_contiguous() or dout_TH.stride(1) != 1:
        return False
    return (dout_TH.stride(0) * dout_TH.element_size()) % 16 == 0 and dout_TH.data_ptr() % 16 == 0


if GLUON:

    @gluon.jit
    def _producer(w_desc, dout_ptr, stride_dt, slot_token_ptr, block_expert_ptr, a_bufs,
                  b_bufs, ready_w, ready_a, empty, num_tokens, num_blocks, num_pid_n,
                  num_tiles, hidden, GROUP_M: gl.constexpr):
        STAGES: gl.constexpr = a_bufs.shape[0]
        BM: gl.constexpr = a_bufs.shape[1]
        BK: gl.constexpr = a_bufs.shape[2]
        BN: gl.constexpr = b_bufs.shape[2]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8],
                                                [gl.num_warps(), 1], [1, 0])
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
        step = gl.num_programs(0)
        pid_m, pid_n = grouped_pid(gl.program_id(0), num_blocks, num_pid_n, GROUP_M)
        tok_next = gl.load(slot_token_ptr + pid_m * BM + offs_m,
                           mask=gl.program_id(0) < num_tiles, other=num_tokens)
        it = 0
        for tile in range(gl.program_id(0), num_tiles, step):
            pid_m, pid_n = grouped_pid(tile, num_blocks, num_pid_n, GROUP_M)
            tok = tok_next
            # The next tile's token ids, read while this tile's steps are issued.
            n_m, n_n = grouped_pid(tile + step, num_blocks, num_pid_n, GROUP_M)
            tok_next = gl.load(slot_token_ptr + n_m * BM + offs_m,
                               mask=tile + step < num_tiles, other=num_tokens)
            expert = gl.load(block_expert_ptr + pid_m)
            if expert >= 0:
                a_ptrs = dout_ptr + tok.to(gl.int64)[:, None] * stride_dt + offs_k[None, :]
                row_ok = (tok < num_tokens)[:, None] & (offs_k < BK)[None, :]
                for k0 in range(0, hidden, BK):
                    stage = it % STAGES
                    mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
                    bar_w = ready_w.index(stage)
                    mbarrier.expect(bar_w, w_desc.block_type.nbytes)
                    _tma_load(w_desc, [expert * hidden + k0, pid_n * BN], bar_w,
                              b_bufs.index(stage))
                    _cp_async(a_bufs.index(stage), a_ptrs + k0, mask=row_ok)
                    async_copy.mbarrier_arrive(ready_a.index(stage), increment_count=False)
                    it += 1

    @gluon.jit
    def _epilogue(c_buf, pid_m, pid_n, row_ok, p, y1_ptr, dy1_ptr, act_ptr, dp_ptr, alpha,
                  limit, ffn, stride_y1, stride_dy1, stride_act, stride_dp,
                  layout: gl.constexpr, CLAMPED: gl.constexpr):
        """The activation backward of the tile in c_buf (dA rounded to bf16), all its rows and
        C columns at a time (row_ok and p: the rows' [BM] values, loaded before the K loop),
        each slice's Y1 loaded while the one before is computed: dY1 and A stored by
        dact_swiglu's own math, dp_part's column of each 64-column group summed over its
        slices."""
        BM: gl.constexpr = c_buf.shape[0]
        BN: gl.constexpr = c_buf.shape[1]
        C: gl.constexpr = 16
        G: gl.constexpr = 64  # dp_part's column width
        offs_c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
        rows = (pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))).to(gl.int64)
        y1_rows = y1_ptr + rows[:, None] * stride_y1
        mask = row_ok[:, None] & (offs_c < C)[None, :]
        col0 = pid_n * BN
        g_next = gl.load(y1_rows + (col0 + offs_c)[None, :], mask=mask, other=0.0)
        u_next = gl.load(y1_rows + (col0 + ffn + offs_c)[None, :], mask=mask, other=0.0)
        dp = gl.zeros([BM], gl.float32, gl.SliceLayout(1, layout))
        for j in gl.static_range(BN // C):
            cols = col0 + j * C + offs_c
            g = g_next.to(gl.float32)
            u = u_next.to(gl.float32)
            if j + 1 < BN // C:
                g_next = gl.load(y1_rows + (cols + C)[None, :], mask=mask, other=0.0)
                u_next = gl.load(y1_rows + (cols + C + ffn)[None, :], mask=mask, other=0.0)
            da = c_buf.slice(j * C, C, dim=1).load(layout).to(gl.float32)
            dp += dact_act_store(da, g, u, p, rows[:, None], cols, cols < ffn, dy1_ptr,
                                 act_ptr, alpha, limit, ffn, stride_dy1, stride_act, CLAMPED)
            if (j + 1) % (G // C) == 0:
                gl.store(dp_ptr + rows * stride_dp + (col0 + j * C) // G, dp)
                dp = gl.zeros([BM], gl.float32, gl.SliceLayout(1, layout))

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready_w, ready_a, empty, turn, c_buf, y1_ptr, weights_ptr,
                  slot_token_ptr, slot_route_ptr, block_expert_ptr, dy1_ptr, act_ptr, dp_ptr,
                  alpha, limit, num_tokens, num_routes, num_blocks, num_pid_n, num_tiles,
                  hidden, ffn, stride_y1, stride_dy1, stride_act, stride_dp,
                  ME: gl.constexpr, GROUP_M: gl.constexpr, CLAMPED: gl.constexpr):
        """Consumer ME (0 or 1): the program's live tiles of its parity, K loop then epilogue."""
        STAGES: gl.constexpr = a_bufs.shape[0]
        BM: gl.constexpr = a_bufs.shape[1]
        BK: gl.constexpr = a_bufs.shape[2]
        BN: gl.constexpr = b_bufs.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BN, 16])
        # the epilogue's [BM, 16] slices: 8 contiguous columns (16 bytes) a thread
        epi: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [gl.num_warps(), 1], [1, 0])
        k_steps = gl.cdiv(hidden, BK)
        live = 0
        turns = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = grouped_pid(tile, num_blocks, num_pid_n, GROUP_M)
            expert = gl.load(block_expert_ptr + pid_m)
            if expert >= 0:
                if live % 2 == ME:
                    # My turn at the tensor cores: after the other consumer's K loop.
                    mbarrier.wait(turn.index(ME), (turns & 1) ^ (1 - ME))
                    turns += 1
                    # The rows' token, route and probability, read under the K loop.
                    rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, epi))
                    row_ok = gl.load(slot_token_ptr + rows) < num_tokens
                    route = gl.load(slot_route_ptr + rows)
                    p = gl.load(weights_ptr + route, mask=route < num_routes,
                                other=0.0).to(gl.float32)
                    acc = gl.zeros((BM, BN), gl.float32, acc_layout)
                    it = live * k_steps
                    prev = 0
                    for kk in range(k_steps):
                        stage = it % STAGES
                        phase = (it // STAGES) & 1
                        mbarrier.wait(ready_w.index(stage), phase)
                        mbarrier.wait(ready_a.index(stage), phase)
                        fence_async_shared()  # cp.async wrote the A rows (generic proxy)
                        acc = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage), acc,
                                            is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
                        mbarrier.arrive(empty.index(prev), pred=kk > 0)
                        prev = stage
                        it += 1
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                    mbarrier.arrive(empty.index(prev))
                    mbarrier.arrive(turn.index(1 - ME))  # the other consumer's K loop may run
                    c_buf.store(acc.to(c_buf.dtype))
                    _epilogue(c_buf, pid_m, pid_n, row_ok, p, y1_ptr, dy1_ptr, act_ptr,
                              dp_ptr, alpha, limit, ffn, stride_y1, stride_dy1, stride_act,
                              stride_dp, epi, CLAMPED)
                live += 1

    @gluon.jit
    def _dact_ws_kernel(w_desc, dout_ptr, y1_ptr, weights_ptr, slot_token_ptr, slot_route_ptr,
                        block_expert_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit,
                        num_tokens, num_routes, num_blocks, num_tiles, ffn, hidden,
                        stride_dt, stride_y1, stride_dy1, stride_act, stride_dp,
                        BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                        STAGES: gl.constexpr, CLAMPED: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        dtype: gl.constexpr = w_desc.dtype
        BN: gl.constexpr = w_desc.block_type.shape[1]
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape,
                                           w_desc.layout)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BN], dtype)
        c_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BN], c_layout)
        ready_w = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_w.index(i), count=1)
            mbarrier.init(ready_a.index(i), count=4 * 32)  # each producer thread's copies
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        num_pid_n = ffn // BN
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready_w, ready_a, empty, turn, c_bufs.index(0), y1_ptr,
                         weights_ptr, slot_token_ptr, slot_route_ptr, block_expert_ptr, dy1_ptr,
                         act_ptr, dp_ptr, alpha, limit, num_tokens, num_routes, num_blocks,
                         num_pid_n, num_tiles, hidden, ffn, stride_y1, stride_dy1, stride_act,
                         stride_dp, 0, GROUP_M, CLAMPED)),
            (_consumer, (a_bufs, b_bufs, ready_w, ready_a, empty, turn, c_bufs.index(1), y1_ptr,
                         weights_ptr, slot_token_ptr, slot_route_ptr, block_expert_ptr, dy1_ptr,
                         act_ptr, dp_ptr, alpha, limit, num_tokens, num_routes, num_blocks,
                         num_pid_n, num_tiles, hidden, ffn, stride_y1, stride_dy1, stride_act,
                         stride_dp, 1, GROUP_M, CLAMPED)),
            (_producer, (w_desc, dout_ptr, stride_dt, slot_token_ptr, block_expert_ptr, a_bufs,
                         b_bufs, ready_w, ready_a, empty, num_tokens, num_blocks, num_pid_n,
                         num_tiles, hidden, GROUP_M)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def dact_ws(dout_TH, w_down_EHF, y1_S2F, topk_weights_N, dy1_out, act_out, dp_part_out, *,
            routes, cfg, num_programs: int, clamp=None, consumer_regs: int = 208,
            producer_regs: int = 96):
    """Fill dy1_out, act_out and dp_part_out (F / 64 columns) as dact_swiglu does."""
    E, H, F = w_down_EHF.shape
    rows = w_down_EHF.view(E * H, F)
    w_desc = TensorDescriptor.from_tensor(rows, [BLOCK_K, BLOCK_N],
                                          _nvmma((BLOCK_K, BLOCK_N), rows.dtype))
    slot_token, slot_route, block_expert = routes.slot_token, routes.slot_route, \
        routes.block_expert
    num_slots = routes.num_slots
    num_blocks = num_slots // BLOCK_M
    num_tiles = num_blocks * (F // BLOCK_N)
    alpha, limit = act_scalars(clamp)
    grid = (min(num_tiles, num_programs),)
    _dact_ws_kernel[grid](
        w_desc, dout_TH, y1_S2F, topk_weights_N, slot_token, slot_route, block_expert, dy1_out,
        act_out, dp_part_out, alpha, limit, dout_TH.shape[0], topk_weights_N.numel(),
        num_blocks, num_tiles, F, H, dout_TH.stride(0), y1_S2F.stride(0), dy1_out.stride(0),
        act_out.stride(0), dp_part_out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m, STAGES=WS_STAGES,
        CLAMPED=clamp is not None, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        num_warps=4, enable_fp_fusion=FUSED)
    return dy1_out, act_out, dp_part_out
