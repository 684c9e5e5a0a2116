"""FC1 + SwiGLU on Hopper, warp-specialized (Gluon): the gathered X rows and the gate/up weight
boxes load ahead across tiles, and Y1 and A leave by TMA stores while the next tile's MMAs run.

The same values as fc1_swiglu.py's tile (its layout contract: Y1[s] = X[slot_token[s]] @
w_gate_up[e(s)]^T as [gate | up], A[s] = silu(g) * u * p from the rounded g and u), for the
launches its Triton kernel cannot pipeline across tiles: the X rows are gathered by token, so
Triton 3.6 cannot warp-specialize the loop (its pass needs all-TMA loads, and Hopper's TMA
cannot gather), and its persistent loop refills the pipeline and runs the SwiGLU epilogue
before the next tile's first MMA.

One program an SM runs three partitions over slot_gemm_ws.py's tile sequence (slot blocks x
F / BN column tiles, GROUP_M blocks at a time, blocks of no expert skipped):
- a producer (2 warps) that, for every K step, waits for a free stage, issues the gate and
  up weight boxes by TMA into the stage's [2 BN, BK] buffer (`ready_w`, bytes expected)
  and the gathered X rows by cp.async (`ready_x`: each producer thread arrives once its own
  copies land; padding slots' rows are masked, so cp.async fills them with zeros), the next
  tile's token ids loaded while this tile's steps are issued;
- the MMA warpgroups (the default partition, 8 warps, 64 rows each) that run one [BM, 2 BN]
  wgmma a stage over the stage's gate rows and up rows (the Triton kernel's paired dot: the
  same sums), hand the stage back once the next stage's wgmma is issued, then split the
  accumulator into gate and up (a thread holds matching columns of both), round them and
  hand them over in two [BM, BN] buffers once the epilogue is done with the tile before
  (`epi_free` / `epi_ready`), and go on to the next tile;
- the epilogue (2 warps) that stores g and u by TMA straight from those buffers, computes A
  from them 16 rows at a time with gated_act.py's formula into g's buffer (once g's store
  has read it), stores A by TMA and hands the buffers back.
Twelve warps in all: ptxas holds every partition to 65536 / (32 x warps) registers a thread
(168 here), and the accumulator's wgmma needs more than sixteen warps would leave (128).

`fits` says which launches it takes (2-byte X, weights and outputs; F a multiple of BN; H a
multiple of BK; 2 BN <= 256 (one wgmma); 128-row tiles as tall as the route block; 16-byte
aligned rows; no bias, no clamped SwiGLU, no split tail); fc1_swiglu.py runs its Triton
kernel otherwise.
"""

from __future__ import annotations

from .fp_fusion import FUSED
from .gated_act import EX2_FTZ, NEG_LOG2E, RCP_FTZ
from .gluon_hopper import GL_DTYPES, GLUON, descriptor, rows_aligned

if GLUON:
    from .gluon_hopper import (async_copy, await_gathered_stage, cp_async, fence_async_shared, gl,
                               gluon, mbarrier, tma, tma_load, tma_store, warpgroup_mma,
                               warpgroup_mma_wait)
    from .slot_gemm_ws import _live_blocks, _next_tile, _tile_of


# The launch's partitions: the default one (the two MMA warpgroups), the producer and the
# epilogue, with the workers' register budgets (the MMA warpgroups get the rest).
# Twelve warps in all: ptxas holds every partition to 65536 / (32 * 12) = 168 registers a
# thread, the least the [BM, 2 BN] accumulator's wgmma takes (16 warps: 128, too few).
CONSUMER_WARPS, PRODUCER_WARPS, PRODUCER_REGS = 8, 2, 96
EPILOGUE_WARPS, EPILOGUE_REGS = 2, 96

# Hopper's shared memory a block (227 KB), less room for the barriers.
SHARED_BYTES = 227 * 1024 - 1024


def stages_that_fit(block_m: int, block_n: int, block_k: int, stages: int) -> int:
    """The config's stages (an X tile and a [2 BN, BK] gate/up box each), lowered where they
    would not fit beside the two [BM, BN] hand-off buffers (gate and up; 2-byte elements)."""
    per_stage = (block_m + 2 * block_n) * block_k * 2
    return max(1, min(stages, (SHARED_BYTES - 2 * block_m * block_n * 2) // per_stage))


def launch_constants(block_m: int, block_n: int, block_k: int, group_m: int,
                     stages: int) -> dict:
    """The kernel's tile, stage and partition constexprs for a config (what the launch
    passes, and benchmarks/compile_report.py lowers)."""
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                STAGES=stages_that_fit(block_m, block_n, block_k, stages),
                PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
                EPILOGUE_WARPS=EPILOGUE_WARPS, EPILOGUE_REGS=EPILOGUE_REGS,
                num_warps=CONSUMER_WARPS)


if GLUON:

    @gluon.jit
    def _producer(x_ptr, stride_x, w_desc, slot_token_ptr, block_expert_ptr, x_bufs, w_bufs,
                  ready_w, ready_x, empty, num_blocks, tiles_n, num_tokens, ffn,
                  hidden, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr):
        STAGES: gl.constexpr = x_bufs.shape[0]
        TPW_K: gl.constexpr = BLOCK_K // 8 if BLOCK_K // 8 < 32 else 32
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K],
                                                [gl.num_warps(), 1], [1, 0])
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        w_bytes: gl.constexpr = 2 * w_desc.block_type.nbytes
        num_tiles = num_blocks * tiles_n
        tile = gl.program_id(0)
        pid_m, pid_n, expert = _tile_of(tile, num_blocks, tiles_n, block_expert_ptr, GROUP_M)
        tok_next = gl.load(slot_token_ptr + pid_m * BLOCK_M + offs_m, mask=tile < num_tiles,
                           other=num_tokens)
        it = 0
        while tile < num_tiles:
            tok = tok_next
            # The next tile's expert and token ids, read while this tile's steps are issued.
            nxt, n_pid_m, n_pid_n, n_expert = _next_tile(tile, num_tiles, num_blocks, tiles_n,
                                                         block_expert_ptr, GROUP_M)
            tok_next = gl.load(slot_token_ptr + n_pid_m * BLOCK_M + offs_m,
                               mask=nxt < num_tiles, other=num_tokens)
            if expert >= 0:
                x_ptrs = x_ptr + tok.to(gl.int64)[:, None] * stride_x + offs_k[None, :]
                x_mask = (tok < num_tokens)[:, None] & (offs_k < BLOCK_K)[None, :]
                w_row = expert * 2 * ffn + pid_n * BLOCK_N  # w as [E * 2F, H]
                for k0 in range(0, hidden, BLOCK_K):
                    stage = it % STAGES
                    mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
                    bar = ready_w.index(stage)
                    mbarrier.expect(bar, w_bytes)
                    w_buf = w_bufs.index(stage)  # [2 BN, BK]: gate rows, then up rows
                    tma_load(w_desc, [w_row, k0], bar, w_buf.slice(0, BLOCK_N))
                    tma_load(w_desc, [w_row + ffn, k0], bar, w_buf.slice(BLOCK_N, BLOCK_N))
                    cp_async(x_bufs.index(stage), x_ptrs + k0, mask=x_mask)
                    async_copy.mbarrier_arrive(ready_x.index(stage), increment_count=False)
                    it += 1
            tile = nxt
            pid_m = n_pid_m
            pid_n = n_pid_n
            expert = n_expert

    @gluon.jit
    def _gathered_k_loop(acc, x_bufs, w_bufs, ready_w, ready_x, empty, it, K,
                         BLOCK_K: gl.constexpr):
        """One tile's K steps: wait for the stage's gate/up box and gathered rows, wgmma (the
        Triton kernel's paired dot), hand the stage before back once this one's wgmma is
        issued."""
        STAGES: gl.constexpr = x_bufs.shape[0]
        prev = 0
        for k0 in range(0, K, BLOCK_K):
            stage = it % STAGES
            await_gathered_stage(ready_w, ready_x, stage, (it // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            # The wgmma before this one has read its stage: hand it back.
            mbarrier.arrive(empty.index(prev), pred=k0 > 0)
            prev = stage
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index(prev))
        return acc, it

    @gluon.jit
    def _consumer(block_expert_ptr, x_bufs, w_bufs, ready_w, ready_x, empty, g_buf, u_buf,
                  epi_ready, epi_free, num_blocks, tiles_n, hidden, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                  num_warps: gl.constexpr):
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 2 * BLOCK_N, 16])
        dtype: gl.constexpr = g_buf.dtype
        num_tiles = num_blocks * tiles_n
        tile = gl.program_id(0)
        pid_m, pid_n, expert = _tile_of(tile, num_blocks, tiles_n, block_expert_ptr, GROUP_M)
        it = 0
        done = 0
        while tile < num_tiles:
            nxt, n_pid_m, n_pid_n, n_expert = _next_tile(tile, num_tiles, num_blocks, tiles_n,
                                                         block_expert_ptr, GROUP_M)
            if expert >= 0:
                acc = gl.zeros((BLOCK_M, 2 * BLOCK_N), gl.float32, acc_layout)
                acc, it = _gathered_k_loop(acc, x_bufs, w_bufs, ready_w, ready_x, empty, it,
                                           hidden, BLOCK_K)
                # [BM, 2 BN] -> gate, up (a thread holds matching columns of both), rounded
                # (backward recomputes A from the stored Y1) and handed to the epilogue
                # partition once it is done with the tile before.
                acc_g, acc_u = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, BLOCK_N]),
                                                   [0, 2, 1]))
                mbarrier.wait(epi_free, (done & 1) ^ 1)
                g_buf.store(acc_g.to(dtype))
                u_buf.store(acc_u.to(dtype))
                fence_async_shared()
                mbarrier.arrive(epi_ready)
                done += 1
            tile = nxt
            pid_m = n_pid_m
            pid_n = n_pid_n
            expert = n_expert

    @gluon.jit
    def _epilogue(y1_desc, act_desc, weights_ptr, slot_route_ptr, block_expert_ptr, g_buf,
                  u_buf, epi_ready, epi_free, num_blocks, tiles_n, num_routes, ffn,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """Per tile: g and u leave by TMA stores straight from the hand-off buffers; A is
        computed from them ROWS rows at a time into g's buffer (once g's store has read it)
        and leaves by a TMA store; then the buffers go back to the MMA warpgroups."""
        ROWS: gl.constexpr = 16
        TPW_N: gl.constexpr = BLOCK_N // 8 if BLOCK_N // 8 < 32 else 32
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_N, TPW_N],
                                                [gl.num_warps(), 1], [1, 0])
        offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        num_tiles = num_blocks * tiles_n
        tile = gl.program_id(0)
        pid_m, pid_n, expert = _tile_of(tile, num_blocks, tiles_n, block_expert_ptr, GROUP_M)
        done = 0
        while tile < num_tiles:
            nxt, n_pid_m, n_pid_n, n_expert = _next_tile(tile, num_tiles, num_blocks, tiles_n,
                                                         block_expert_ptr, GROUP_M)
            if expert >= 0:
                row = pid_m * BLOCK_M
                col = pid_n * BLOCK_N
                mbarrier.wait(epi_ready, done & 1)
                tma_store(y1_desc, [row, col], g_buf)
                tma_store(y1_desc, [row, ffn + col], u_buf)
                tma.store_wait(0)  # both stores have read their buffers
                for r0 in gl.static_range(0, BLOCK_M, ROWS):
                    g_rows = g_buf.slice(r0, ROWS)
                    g = g_rows.load(layout).to(gl.float32)
                    u = u_buf.slice(r0, ROWS).load(layout).to(gl.float32)
                    route = gl.load(slot_route_ptr + row + r0 + offs_r)
                    p = gl.load(weights_ptr + route, mask=route < num_routes, other=0.0)
                    # gated_act.swiglu_forward's FAST path (the Triton kernels' on a GPU), in
                    # its order of operations; each thread overwrites only the elements it
                    # read.
                    e = 1.0 + gl.inline_asm_elementwise(EX2_FTZ, "=f,f", [g * NEG_LOG2E],
                                                        dtype=gl.float32, is_pure=True, pack=1)
                    r = gl.inline_asm_elementwise(RCP_FTZ, "=f,f", [e], dtype=gl.float32,
                                                  is_pure=True, pack=1)
                    act = g * r * u * p.to(gl.float32)[:, None]
                    g_rows.store(act.to(g_buf.dtype))
                fence_async_shared()
                tma_store(act_desc, [row, col], g_buf)
                tma.store_wait(0)
                mbarrier.arrive(epi_free)
                done += 1
            tile = nxt
            pid_m = n_pid_m
            pid_n = n_pid_n
            expert = n_expert

    @gluon.jit
    def _fc1_swiglu_ws_kernel(x_ptr, w_desc, y1_desc, act_desc, weights_ptr, slot_token_ptr,
                              slot_route_ptr, block_expert_ptr, expert_start_ptr,
                              expert_count_ptr, num_experts, num_blocks, num_tokens,
                              num_routes, ffn, hidden, stride_x, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                              PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                              EPILOGUE_WARPS: gl.constexpr, EPILOGUE_REGS: gl.constexpr,
                              num_warps: gl.constexpr):
        dtype: gl.constexpr = w_desc.dtype
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
        g_buf = gl.allocate_shared_memory(dtype, y1_desc.block_type.shape, y1_desc.layout)
        u_buf = gl.allocate_shared_memory(dtype, y1_desc.block_type.shape, y1_desc.layout)
        ready_w = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_x = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        epi_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_w.index(i), count=1)
            # every producer thread arrives once its own cp.async copies have landed
            mbarrier.init(ready_x.index(i), count=PRODUCER_WARPS * 32)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(epi_ready, count=1)
        mbarrier.init(epi_free, count=1)
        live = _live_blocks(expert_start_ptr, expert_count_ptr, num_experts, num_blocks,
                            BLOCK_M)
        tiles_n = ffn // BLOCK_N
        gl.warp_specialize([
            (_consumer, (block_expert_ptr, x_bufs, w_bufs, ready_w, ready_x, empty, g_buf,
                         u_buf, epi_ready, epi_free, live, tiles_n, hidden, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, num_warps)),
            (_producer, (x_ptr, stride_x, w_desc, slot_token_ptr, block_expert_ptr, x_bufs,
                         w_bufs, ready_w, ready_x, empty, live, tiles_n, num_tokens,
                         ffn, hidden, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)),
            (_epilogue, (y1_desc, act_desc, weights_ptr, slot_route_ptr, block_expert_ptr,
                         g_buf, u_buf, epi_ready, epi_free, live, tiles_n, num_routes, ffn,
                         BLOCK_M, BLOCK_N, GROUP_M)),
        ], [PRODUCER_WARPS, EPILOGUE_WARPS], [PRODUCER_REGS, EPILOGUE_REGS])


def fits(x_TH, w_gate_up_EFH, y1_out, act_out, block_m: int, block_n: int, block_k: int,
         route_block: int) -> bool:
    """Whether this kernel takes the launch: X, w_gate_up, Y1 and A of one 2-byte dtype; F a
    multiple of BN (a box never crosses gate into up) and H of BK; 2 BN <= 256 (the gate and
    up columns of one wgmma); 128-row tiles (a warpgroup's 64 rows each) as tall as the
    route block; w contiguous; unit column strides and 16-byte aligned rows and starts
    (cp.async's 16-byte copies, TMA)."""
    dtype = y1_out.dtype
    if dtype not in GL_DTYPES or any(t.dtype != dtype for t in (x_TH, w_gate_up_EFH, act_out)):
        return False
    hidden = x_TH.shape[1]
    ffn = w_gate_up_EFH.shape[1] // 2
    if block_m != 128 or route_block != block_m or block_n > 128:
        return False
    if ffn % block_n or hidden % block_k or not w_gate_up_EFH.is_contiguous():
        return False
    return rows_aligned(x_TH, y1_out, act_out, w_gate_up_EFH.view(-1, hidden))


def fc1_swiglu_ws(x_TH, w_gate_up_EFH, topk_weights_N, routes, y1_out, act_out, block_m: int,
                  block_n: int, block_k: int, group_m: int, stages: int,
                  num_programs: int) -> int:
    """Fill y1_out and act_out's rows of live slot blocks with fc1_swiglu's values (see
    `fits`); returns the grid."""
    num_tokens, hidden = x_TH.shape
    num_experts = w_gate_up_EFH.shape[0]
    ffn = w_gate_up_EFH.shape[1] // 2
    num_blocks = routes.num_slots // block_m
    w_desc = descriptor(w_gate_up_EFH.view(-1, hidden), (block_n, block_k))
    y1_desc = descriptor(y1_out, (block_m, block_n))
    act_desc = descriptor(act_out, (block_m, block_n))
    grid = (max(1, min(num_blocks * (ffn // block_n), num_programs)),)
    _fc1_swiglu_ws_kernel[grid](
        x_TH, w_desc, y1_desc, act_desc, topk_weights_N, routes.slot_token, routes.slot_route,
        routes.block_expert, routes.expert_starts, routes.expert_counts, num_experts,
        num_blocks, num_tokens, topk_weights_N.numel(), ffn, hidden, x_TH.stride(0),
        **launch_constants(block_m, block_n, block_k, group_m, stages), enable_fp_fusion=FUSED)
    return grid[0]
