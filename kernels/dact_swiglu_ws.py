"""dA (gathered dOut @ w_down) with the SwiGLU backward on Hopper, warp-specialized (Gluon):
the K loop never waits for the epilogue, which runs in its own warps under the next tile's
MMAs.

The same values as dact_swiglu.py's paired tile (its layout contract: dA[s] =
dOut[slot_token[s]] @ w_down[e(s)], rounded to the input dtype, then dY1, the recomputed A
and dp_part from gated_act.py's formulas; dp_part's columns are BN / 2-wide quarters of the
[BM, 2 BN] tile). The Triton kernel runs the epilogue (two Y1 tiles read, three tiles
written) between one tile's K loop and the next, so the tensor cores idle through it.

One program an SM runs three partitions over slot_gemm_ws.py's tile sequence (slot blocks x
F / 2 BN column tiles, GROUP_M blocks at a time, blocks of no expert skipped):
- a producer (2 warps, fc1_swiglu_ws.py's): the gathered dOut rows by cp.async (padding
  slots' rows masked to zeros) and the [BK, 2 BN] w_down box by TMA, a stage a K step;
- the MMA warpgroups (the default partition, 8 warps, 64 rows each): one [BM, 2 BN] wgmma a
  stage (the Triton kernel's K order: the same sums), then dA rounded to the input dtype and
  handed over in four [BM, BN / 2] quarter buffers once the epilogue is done with the tile
  before;
- the epilogue (2 warps): 16 rows of a quarter at a time, reads dA from shared memory and g,
  u from Y1 (the next slice's loaded ahead), writes dY1, A and the quarter's dp_part column,
  then hands the buffers back.
dY1 and A are elementwise: bitwise the Triton kernel's. dp_part sums a quarter's columns in
another order than the Triton kernel's layout does (a few fp32 ulps; the same every run).

`fits` says which launches it takes (2-byte dOut, w_down, Y1, dY1 and A of one dtype; the
paired tile with 2 BN = 256 dividing F; H a multiple of BK; 128-row tiles as tall as the
route block; 16-byte aligned rows; the plain SwiGLU); dact_swiglu.py runs its Triton kernel
otherwise.
"""

from __future__ import annotations

from .fp_fusion import FUSED
from .gluon_hopper import GL_DTYPES, GLUON, descriptor, rows_aligned

if GLUON:
    from .fc1_swiglu_ws import _gathered_k_loop, _producer
    from .gluon_hopper import fence_async_shared, gl, gluon, mbarrier
    from .slot_gemm_ws import _live_blocks, _next_tile, _tile_of

# Twelve warps in all: ptxas holds every partition to 65536 / (32 * 12) = 168 registers a
# thread, the least the [BM, 2 BN] accumulator's wgmma takes.
CONSUMER_WARPS, PRODUCER_WARPS, PRODUCER_REGS = 8, 2, 96
EPILOGUE_WARPS, EPILOGUE_REGS = 2, 168

# Hopper's shared memory a block (227 KB), less room for the barriers.
SHARED_BYTES = 227 * 1024 - 1024


def stages_that_fit(block_m: int, tile_n: int, block_k: int, stages: int) -> int:
    """The config's stages (a dOut tile and a [BK, 2 BN] w_down box each), lowered where they
    would not fit beside the [BM, 2 BN] dA hand-off buffers (2-byte elements)."""
    per_stage = (block_m + tile_n) * block_k * 2
    return max(1, min(stages, (SHARED_BYTES - block_m * tile_n * 2) // per_stage))


def launch_constants(block_m: int, tile_n: int, block_k: int, group_m: int,
                     stages: int) -> dict:
    """The kernel's tile ([BM, 2 BN]: tile_n = 2 BN), stage and partition constexprs for a
    config (what the launch passes, and benchmarks/compile_report.py lowers)."""
    return dict(BLOCK_M=block_m, BLOCK_N=tile_n, BLOCK_K=block_k, GROUP_M=group_m,
                STAGES=stages_that_fit(block_m, tile_n, block_k, stages),
                PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
                EPILOGUE_WARPS=EPILOGUE_WARPS, EPILOGUE_REGS=EPILOGUE_REGS,
                num_warps=CONSUMER_WARPS)


if GLUON:

    @gluon.jit
    def _consumer(block_expert_ptr, x_bufs, w_bufs, ready_w, ready_x, empty, da_bufs,
                  epi_ready, epi_free, num_blocks, tiles_n, hidden, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                  num_warps: gl.constexpr):
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        Q: gl.constexpr = BLOCK_N // 4
        dtype: gl.constexpr = da_bufs.dtype
        num_tiles = num_blocks * tiles_n
        tile = gl.program_id(0)
        pid_m, pid_n, expert = _tile_of(tile, num_blocks, tiles_n, block_expert_ptr, GROUP_M)
        it = 0
        done = 0
        while tile < num_tiles:
            nxt, n_pid_m, n_pid_n, n_expert = _next_tile(tile, num_tiles, num_blocks, tiles_n,
                                                         block_expert_ptr, GROUP_M)
            if expert >= 0:
                acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
                acc, it = _gathered_k_loop(acc, x_bufs, w_bufs, ready_w, ready_x, empty, it,
                                           hidden, BLOCK_K, True)
                # dA as autograd would hand it to the activation: rounded to the input dtype;
                # in quarters (a thread's columns of each), as the Triton kernel splits it.
                da = acc.to(dtype)
                lo, hi = gl.split(gl.permute(gl.reshape(da, [BLOCK_M, 2, 2 * Q]), [0, 2, 1]))
                q0, q1 = gl.split(gl.permute(gl.reshape(lo, [BLOCK_M, 2, Q]), [0, 2, 1]))
                q2, q3 = gl.split(gl.permute(gl.reshape(hi, [BLOCK_M, 2, Q]), [0, 2, 1]))
                mbarrier.wait(epi_free, (done & 1) ^ 1)
                da_bufs.index(0).store(q0)
                da_bufs.index(1).store(q1)
                da_bufs.index(2).store(q2)
                da_bufs.index(3).store(q3)
                mbarrier.arrive(epi_ready)
                done += 1
            tile = nxt
            pid_m = n_pid_m
            pid_n = n_pid_n
            expert = n_expert

    @gluon.jit
    def _load_gu(y1_ptr, rows, cols, ok, stride_y1, ffn):
        """A slice's gate and up values of Y1 (zeros on padding slots' rows)."""
        ptrs = y1_ptr + rows.to(gl.int64)[:, None] * stride_y1 + cols[None, :]
        mask = ok[:, None] & (cols < ffn)[None, :]
        return gl.load(ptrs, mask=mask, other=0.0), gl.load(ptrs + ffn, mask=mask, other=0.0)

    @gluon.jit
    def _epilogue(y1_ptr, dy1_ptr, act_ptr, dp_ptr, weights_ptr, slot_route_ptr,
                  block_expert_ptr, da_bufs, epi_ready, epi_free, num_blocks, tiles_n,
                  num_routes, ffn, stride_y1, stride_dy1, stride_act, stride_dp,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """Per tile: the four dA quarters ROWS rows at a time (row slice r, quarter q), g and
        u of the next slice loaded before this one is computed; gated_act.swiglu_backward
        and swiglu_forward in their order of operations."""
        ROWS: gl.constexpr = 16
        Q: gl.constexpr = BLOCK_N // 4
        TPW_N: gl.constexpr = Q // 8 if Q // 8 < 32 else 32
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_N, TPW_N],
                                                [gl.num_warps(), 1], [1, 0])
        SLICES: gl.constexpr = BLOCK_M // ROWS
        offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        offs_c = gl.arange(0, Q, layout=gl.SliceLayout(0, layout))
        out_ty: gl.constexpr = dy1_ptr.dtype.element_ty
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
                route = gl.load(slot_route_ptr + row + offs_r)
                ok = route < num_routes
                p = gl.load(weights_ptr + route, mask=ok, other=0.0).to(gl.float32)
                route_next = gl.load(slot_route_ptr + row + ROWS + offs_r)
                g_next, u_next = _load_gu(y1_ptr, row + offs_r, col + offs_c, ok, stride_y1,
                                          ffn)
                mbarrier.wait(epi_ready, done & 1)
                for r in gl.static_range(SLICES):
                    for q in gl.static_range(4):
                        g = g_next.to(gl.float32)
                        u = u_next.to(gl.float32)
                        p_i = p
                        rows = row + r * ROWS + offs_r
                        cols = col + q * Q + offs_c
                        # the next slice's g and u, loaded ahead (its route first); past the
                        # tile's last slice all masked
                        if q == 3:
                            route = route_next
                            ok = route < num_routes
                            p = gl.load(weights_ptr + route, mask=ok, other=0.0).to(gl.float32)
                            route_next = gl.load(slot_route_ptr + rows + 2 * ROWS,
                                                 mask=(r + 2 < SLICES) & (offs_r >= 0),
                                                 other=num_routes)
                            g_next, u_next = _load_gu(y1_ptr, rows + ROWS, col + offs_c, ok,
                                                      stride_y1, ffn)
                        else:
                            g_next, u_next = _load_gu(y1_ptr, rows, cols + Q, ok, stride_y1,
                                                      ffn)
                        da = da_bufs.index(q).slice(r * ROWS, ROWS).load(layout).to(gl.float32)
                        pc = p_i[:, None]
                        e = 1.0 + gl.exp(-g)
                        sig = 1.0 / e
                        silu_g = g / e
                        dg = da * pc * u * (sig * (1.0 + g * (1.0 - sig)))
                        du = da * pc * silu_g
                        dp_part = gl.sum(da * (silu_g * u), axis=1)
                        act = g / (1.0 + gl.exp(-g)) * u * pc
                        r64 = rows.to(gl.int64)[:, None]
                        dy1_ptrs = dy1_ptr + r64 * stride_dy1 + cols[None, :]
                        gl.store(dy1_ptrs, dg.to(out_ty))
                        gl.store(dy1_ptrs + ffn, du.to(out_ty))
                        gl.store(act_ptr + r64 * stride_act + cols[None, :], act.to(out_ty))
                        gl.store(dp_ptr + rows.to(gl.int64) * stride_dp + 4 * pid_n + q, dp_part)
                mbarrier.arrive(epi_free)
                done += 1
            tile = nxt
            pid_m = n_pid_m
            pid_n = n_pid_n
            expert = n_expert

    @gluon.jit
    def _dact_swiglu_ws_kernel(dout_ptr, w_desc, y1_ptr, weights_ptr, slot_token_ptr,
                               slot_route_ptr, block_expert_ptr, expert_start_ptr,
                               expert_count_ptr, dy1_ptr, act_ptr, dp_ptr, num_experts,
                               num_blocks, num_tokens, num_routes, ffn, hidden, stride_dt,
                               stride_y1, stride_dy1, stride_act, stride_dp,
                               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                               STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr, EPILOGUE_WARPS: gl.constexpr,
                               EPILOGUE_REGS: gl.constexpr, num_warps: gl.constexpr):
        dtype: gl.constexpr = w_desc.dtype
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [BLOCK_M, BLOCK_N // 4], dtype)
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
        da_bufs = gl.allocate_shared_memory(dtype, [4, BLOCK_M, BLOCK_N // 4], q_layout)
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
            (_consumer, (block_expert_ptr, x_bufs, w_bufs, ready_w, ready_x, empty, da_bufs,
                         epi_ready, epi_free, live, tiles_n, hidden, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, num_warps)),
            (_producer, (dout_ptr, stride_dt, w_desc, slot_token_ptr, block_expert_ptr,
                         x_bufs, w_bufs, ready_w, ready_x, empty, live, tiles_n, num_tokens,
                         ffn, hidden, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, True)),
            (_epilogue, (y1_ptr, dy1_ptr, act_ptr, dp_ptr, weights_ptr, slot_route_ptr,
                         block_expert_ptr, da_bufs, epi_ready, epi_free, live, tiles_n,
                         num_routes, ffn, stride_y1, stride_dy1, stride_act, stride_dp,
                         BLOCK_M, BLOCK_N, GROUP_M)),
        ], [PRODUCER_WARPS, EPILOGUE_WARPS], [PRODUCER_REGS, EPILOGUE_REGS])


def fits(dout_TH, w_down_EHF, y1_S2F, dy1_out, act_out, block_m: int, tile_n: int,
         block_k: int, route_block: int) -> bool:
    """Whether this kernel takes the launch: dOut, w_down, Y1, dY1 and A of one 2-byte dtype;
    a [128, 256] tile (the paired 128 x 128 config) whose width divides F, H a multiple of BK;
    128-row tiles (a warpgroup's 64 rows each) as tall as the route block; w_down contiguous;
    unit column strides and 16-byte aligned rows and starts (cp.async's 16-byte copies,
    TMA)."""
    dtype = dy1_out.dtype
    if dtype not in GL_DTYPES or any(t.dtype != dtype
                                     for t in (dout_TH, w_down_EHF, y1_S2F, act_out)):
        return False
    hidden, ffn = w_down_EHF.shape[1:]
    if block_m != 128 or route_block != block_m or tile_n != 256:
        return False
    if ffn % tile_n or hidden % block_k or dout_TH.shape[1] != hidden \
            or not w_down_EHF.is_contiguous():
        return False
    return rows_aligned(dout_TH, y1_S2F, dy1_out, act_out, w_down_EHF.view(-1, ffn))


def dact_swiglu_ws(dout_TH, w_down_EHF, y1_S2F, topk_weights_N, routes, dy1_out, act_out,
                   dp_part_out, block_m: int, tile_n: int, block_k: int, group_m: int,
                   stages: int, num_programs: int) -> int:
    """Fill dy1_out, act_out and dp_part_out's rows of live slot blocks with dact_swiglu's
    values (see `fits`; dp_part's columns are the tile's tile_n / 4 quarters); returns the
    grid."""
    num_tokens, hidden = dout_TH.shape
    num_experts, _, ffn = w_down_EHF.shape
    num_blocks = routes.num_slots // block_m
    w_desc = descriptor(w_down_EHF.view(-1, ffn), (block_k, tile_n))
    grid = (max(1, min(num_blocks * (ffn // tile_n), num_programs)),)
    _dact_swiglu_ws_kernel[grid](
        dout_TH, w_desc, y1_S2F, topk_weights_N, routes.slot_token, routes.slot_route,
        routes.block_expert, routes.expert_starts, routes.expert_counts, dy1_out, act_out,
        dp_part_out, num_experts, num_blocks, num_tokens, topk_weights_N.numel(), ffn, hidden,
        dout_TH.stride(0), y1_S2F.stride(0), dy1_out.stride(0), act_out.stride(0),
        dp_part_out.stride(0),
        **launch_constants(block_m, tile_n, block_k, group_m, stages), enable_fp_fusion=FUSED)
    return grid[0]
