"""Expert dW on Hopper, warp-specialized, two consumer warpgroups taking tiles in turn (Gluon).

wgrad_ws.py's kernel runs its two consumer warpgroups on halves of one tile: after each
tile's K loop both wait for their last wgmma and write the tile to shared memory for its TMA
store, and no MMA runs meanwhile. At T = 8192 an expert holds 512 slots, 8 K steps a tile, so
that pause is a large part of each tile. Here the tile is half as tall (`block_m / 2` rows,
the config's `block_n` columns) and each consumer warpgroup (4 warps) takes every other tile
of the program's sequence: one's epilogue runs while the other's wgmmas do. The producer is
wgrad_ws.py's, unchanged (it fills the stages in tile order; each stage is handed back by the
consumer whose tile used it, so both consumers walk the same ring, skipping the other's
steps).

Each consumer runs the same wgmma instructions on its 64-row slices as the cooperative tile
(m64 x block_n x 16, K steps in the same order), so dW is bitwise wgrad_ws.py's
(tests/kernels/test_wgrad_ws.py). Costs: each K step's gathered and slot-order boxes feed half
the rows, so the operands cross L2 and shared memory 1.33x (dW_gate_up's 128 x 128 tiles) or
1.67x (dW_down's 64 x 256) as often a FLOP.
"""

from __future__ import annotations

from .fp_fusion import FUSED
from .gluon_hopper import GLUON
from .wgrad_ws import launch_geometry

if GLUON:
    from .gluon_hopper import gl, gluon, mbarrier, tma
    from .wgrad_ws import _producer, _tile_of, stage_ring, tile_k_loop, tile_store

# Each consumer is one warpgroup; the producer keeps wgrad_ws.py's 4 warps. Registers a
# thread: two consumers at 208 and the producer at 96 fill the SM's 64 K.
CONSUMER_WARPS, PRODUCER_WARPS, CONSUMER_REGS, PRODUCER_REGS = 4, 4, 208, 96


if GLUON:

    @gluon.jit
    def _consumer(dw_desc, expert_count_ptr, s_bufs, g_bufs, ready_s, ready_g, empty, turn,
                  out_buf, M, N, num_tiles, GATHER_L: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                  ME: gl.constexpr):
        """Consumer ME (0 or 1): the program's tiles j with j % 2 == ME; the others' K steps
        only advance its place in the stage ring. The `turn` pair orders the K loops (a
        consumer may not wait on a stage a lap ahead: a parity wait cannot tell the laps
        apart); each tile's end and store run under the other's K loop."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        it = 0
        j = 0
        turns = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
            count = gl.load(expert_count_ptr + expert)
            if j % 2 == ME:
                # My turn at the ring: the other consumer has waited for every stage before
                # mine, so the ring's parities name this tile's stages.
                mbarrier.wait(turn.index(ME), (turns & 1) ^ (1 - ME))
                turns += 1
                acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
                acc, it, prev = tile_k_loop(s_bufs, g_bufs, ready_s, ready_g, empty, acc,
                                            count, it, GATHER_L, BLOCK_K)
                mbarrier.arrive(turn.index(1 - ME))  # the other's K loop may start
                tile_store(dw_desc, empty, out_buf, acc, count, prev,
                           expert * M + pid_m * BLOCK_M, pid_n * BLOCK_N)
            else:
                it += gl.cdiv(count, BLOCK_K)
            j += 1
        tma.store_wait(0)

    @gluon.jit
    def _wgrad_pingpong_kernel(s_desc, g_ptr, dw_desc, slot_token_ptr, expert_start_ptr,
                               expert_count_ptr, M, N, num_tokens, num_slots, num_tiles,
                               stride_g, GATHER_L: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                               GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                               PRODUCER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr):
        s_bufs, g_bufs, ready_s, ready_g, empty = stage_ring(
            s_desc, GATHER_L, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, PRODUCER_WARPS)
        # one store buffer a consumer
        out_bufs = gl.allocate_shared_memory(s_desc.dtype, [2] + dw_desc.block_type.shape,
                                             dw_desc.layout)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (dw_desc, expert_count_ptr, s_bufs, g_bufs, ready_s, ready_g, empty,
                         turn, out_bufs.index(0), M, N, num_tiles, GATHER_L, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, 0)),
            (_consumer, (dw_desc, expert_count_ptr, s_bufs, g_bufs, ready_s, ready_g, empty,
                         turn, out_bufs.index(1), M, N, num_tiles, GATHER_L, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, 1)),
            (_producer, (s_desc, g_ptr, stride_g, slot_token_ptr, expert_start_ptr,
                         expert_count_ptr, s_bufs, g_bufs, ready_s, ready_g, empty, M, N,
                         num_tokens, num_slots, num_tiles, GATHER_L, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def consumer_tile(block_m: int, block_n: int) -> tuple[int, int]:
    """Each consumer's tile: half the config's rows (64-row wgmma slices, as the cooperative
    tile's warpgroups run)."""
    return block_m // 2, block_n


def fits(block_m: int, block_n: int) -> bool:
    """Whether the config's tile splits into two consumer tiles of whole 64-row slices."""
    return block_m % 128 == 0 and block_n <= 256


def expert_wgrad_pingpong(l_rows, r_rows, slot_token, expert_starts, expert_counts,
                          num_tokens: int, num_slots: int, out_EMN, gather_l: bool,
                          block_m: int, block_n: int, block_k: int, group_m: int, stages: int,
                          num_programs: int):
    """Fill out_EMN [E, M, N] as wgrad_ws.expert_wgrad_ws does (its `fits` cases, and
    `fits` here), each consumer on a [block_m / 2, block_n] tile."""
    bm, bn = consumer_tile(block_m, block_n)
    s_desc, g_rows, dw_desc, m, n, num_tiles, grid = launch_geometry(
        l_rows, r_rows, out_EMN, gather_l, bm, bn, block_k, num_programs)
    _wgrad_pingpong_kernel[grid](
        s_desc, g_rows, dw_desc, slot_token, expert_starts, expert_counts, m, n,
        num_tokens, num_slots, num_tiles, g_rows.stride(0),
        GATHER_L=gather_l, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, GROUP_M=group_m,
        STAGES=stages, PRODUCER_WARPS=PRODUCER_WARPS, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=CONSUMER_WARPS, enable_fp_fusion=FUSED)
    return out_EMN
