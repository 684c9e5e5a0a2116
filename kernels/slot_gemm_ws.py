"""FC2 and FC1's dX on Hopper, warp-specialized (Gluon): loads run ahead across tiles, and
each tile leaves by a TMA store while the next one's MMAs run.

The same sums as slot_gemm.py's persistent TMA tile (its layout contract: C[s] = A[s] @
w[e(s)]^T for w [E, N, K], or A[s] @ w[e(s)] for w [E, K, N]; A [S, K] in slot order), for
the case Triton 3.6 cannot warp-specialize on the GPUs at hand (gemm_config
WARP_SPECIALIZE_ENABLED): its persistent loop refills the pipeline at each tile and stores
each tile from registers before the next tile's first MMA; Nsight Compute put 33% (FC2) and
20% (dX) of the warps' time outside the K loop (benchmarks/results/ncu_kernels_source_h100.json).

One program an SM runs two partitions over the same tile sequence (the slot blocks up to
the end of the last expert's live rows, times the column tiles, GROUP_M blocks at a time;
blocks of no expert skipped by both):
- a producer (one warp) that, for every K step, waits for a free stage and issues the A box
  and the weight box by TMA, their bytes expected on the stage's `ready` barrier;
- the default partition (8 warps, two warpgroups of 64 rows) that waits on `ready`, runs
  the stage's wgmma, hands the stage back (`empty`) once the next wgmma has been issued
  after it, then writes the tile to shared memory and stores it by TMA, waiting for the
  tile before's store only when it needs the buffer again.
Each tile sums its K steps in the same order, with the same wgmma shapes, as the Triton
kernel: the values are the same (tests/kernels/test_slot_gemm_ws.py compares bitwise).

`fits` says which launches it takes (2-byte operands, whole N and K tiles, 16-byte aligned
rows, no bias, no split tail); slot_gemm.py runs the Triton kernel for every other launch,
and where Gluon or a Hopper GPU is missing (gluon_hopper.available).
"""

from __future__ import annotations

from .fp_fusion import FUSED
from .gluon_hopper import GL_DTYPES, GLUON, descriptor, rows_aligned
from .slot_schedule import grouped_pid

if GLUON:
    from .gluon_hopper import (fence_async_shared, gl, gluon, mbarrier, tma, tma_load,
                               tma_store, warpgroup_mma, warpgroup_mma_wait)


# The launch's partitions: the default one (the two consumer warpgroups) and the producer,
# which only issues TMA copies, with its register budget (the consumers get the rest).
CONSUMER_WARPS, PRODUCER_WARPS, PRODUCER_REGS = 8, 1, 40

# Hopper's shared memory a block (227 KB), less room for the barriers.
SHARED_BYTES = 227 * 1024 - 1024


def stages_that_fit(block_m: int, block_n: int, block_k: int, stages: int) -> int:
    """The config's stage count, lowered where its stages and the [BM, BN] store buffer would
    not fit in shared memory (2-byte elements)."""
    per_stage = (block_m + block_n) * block_k * 2
    return max(1, min(stages, (SHARED_BYTES - block_m * block_n * 2) // per_stage))


def launch_constants(block_m: int, block_n: int, block_k: int, group_m: int,
                     stages: int) -> dict:
    """The kernel's tile, stage and partition constexprs for a config (what the launch passes,
    and benchmarks/compile_report.py lowers)."""
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                STAGES=stages_that_fit(block_m, block_n, block_k, stages),
                PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
                num_warps=CONSUMER_WARPS)


if GLUON:

    @gluon.jit
    def _tile_of(tile, num_blocks, tiles_n, block_expert_ptr, GROUP_M: gl.constexpr):
        """Tile -> (pid_m, pid_n, expert), GROUP_M slot blocks at a time; expert -1 for a
        block of no expert."""
        pid_m, pid_n = grouped_pid(tile, num_blocks, tiles_n, GROUP_M)
        return pid_m, pid_n, gl.load(block_expert_ptr + pid_m)

    @gluon.jit
    def _next_tile(tile, num_tiles, num_blocks, tiles_n, block_expert_ptr,
                   GROUP_M: gl.constexpr):
        """The program's tile after `tile`: (tile, pid_m, pid_n, expert), expert -1 past the
        last tile; read ahead, while the current tile's steps run."""
        nxt = tile + gl.num_programs(0)
        pid_m, pid_n = grouped_pid(nxt, num_blocks, tiles_n, GROUP_M)
        return nxt, pid_m, pid_n, gl.load(block_expert_ptr + pid_m, mask=nxt < num_tiles,
                                          other=-1)

    @gluon.jit
    def _live_blocks(expert_start_ptr, expert_count_ptr, num_experts, num_blocks,
                     BLOCK_M: gl.constexpr):
        """The slot blocks up to the end of the last expert's live rows: segments lie in
        expert order, so no live block lies past it (the blocks of no expert before it are
        skipped by their -1)."""
        last = num_experts - 1
        count = gl.load(expert_count_ptr + last)
        end = gl.load(expert_start_ptr + last) + gl.cdiv(count, BLOCK_M) * BLOCK_M
        return gl.minimum(end // BLOCK_M, num_blocks)

    @gluon.jit
    def _producer(a_desc, w_desc, block_expert_ptr, a_bufs, w_bufs, ready, empty, num_blocks,
                  tiles_n, N, K, W_NK: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr):
        STAGES: gl.constexpr = a_bufs.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
        step = gl.num_programs(0)
        num_tiles = num_blocks * tiles_n
        it = 0
        for tile in range(gl.program_id(0), num_tiles, step):
            pid_m, pid_n, expert = _tile_of(tile, num_blocks, tiles_n, block_expert_ptr,
                                            GROUP_M)
            if expert >= 0:
                for k0 in range(0, K, BLOCK_K):
                    stage = it % STAGES
                    mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
                    bar = ready.index(stage)
                    mbarrier.expect(bar, nbytes)
                    tma_load(a_desc, [pid_m * BLOCK_M, k0], bar, a_bufs.index(stage))
                    if W_NK:  # w as [E * N, K]
                        tma_load(w_desc, [expert * N + pid_n * BLOCK_N, k0], bar,
                                 w_bufs.index(stage))
                    else:  # w as [E * K, N]
                        tma_load(w_desc, [expert * K + k0, pid_n * BLOCK_N], bar,
                                 w_bufs.index(stage))
                    it += 1

    @gluon.jit
    def _consumer(c_desc, block_expert_ptr, a_bufs, w_bufs, ready, empty, out_buf, num_blocks,
                  tiles_n, K, W_NK: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                  num_warps: gl.constexpr):
        STAGES: gl.constexpr = a_bufs.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        num_tiles = num_blocks * tiles_n
        tile = gl.program_id(0)
        pid_m, pid_n, expert = _tile_of(tile, num_blocks, tiles_n, block_expert_ptr, GROUP_M)
        it = 0
        while tile < num_tiles:
            nxt, n_pid_m, n_pid_n, n_expert = _next_tile(tile, num_tiles, num_blocks, tiles_n,
                                                         block_expert_ptr, GROUP_M)
            if expert >= 0:
                acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
                prev = 0
                for k0 in range(0, K, BLOCK_K):
                    stage = it % STAGES
                    mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
                    if W_NK:
                        b = w_bufs.index(stage).permute((1, 0))
                    else:
                        b = w_bufs.index(stage)
                    acc = warpgroup_mma(a_bufs.index(stage), b, acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
                    # The wgmma before this one has read its stage: hand it back.
                    mbarrier.arrive(empty.index(prev), pred=k0 > 0)
                    prev = stage
                    it += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                mbarrier.arrive(empty.index(prev))
                tma.store_wait(0)  # the last tile's store has left out_buf
                out_buf.store(acc.to(c_desc.dtype))
                fence_async_shared()
                tma_store(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], out_buf)
            tile = nxt
            pid_m = n_pid_m
            pid_n = n_pid_n
            expert = n_expert
        tma.store_wait(0)

    @gluon.jit
    def _slot_gemm_ws_kernel(a_desc, w_desc, c_desc, block_expert_ptr, expert_start_ptr,
                             expert_count_ptr, num_experts, num_blocks, N, K,
                             W_NK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                             STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                             PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape,
                                           a_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape,
                                           w_desc.layout)
        out_buf = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        live = _live_blocks(expert_start_ptr, expert_count_ptr, num_experts, num_blocks,
                            BLOCK_M)
        tiles_n = N // BLOCK_N
        gl.warp_specialize([
            (_consumer, (c_desc, block_expert_ptr, a_bufs, w_bufs, ready, empty, out_buf,
                         live, tiles_n, K, W_NK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                         num_warps)),
            (_producer, (a_desc, w_desc, block_expert_ptr, a_bufs, w_bufs, ready, empty,
                         live, tiles_n, N, K, W_NK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


def fits(a_SK, w_E, out, w_nk: bool, block_m: int, block_n: int, block_k: int,
         route_block: int) -> bool:
    """Whether this kernel takes the launch: A, w and out of one 2-byte dtype; N and K whole
    tiles (a box must not run past an expert's weight rows); 128-row tiles (a warpgroup's 64
    rows each) as tall as the route block (block_expert's entries); unit column strides and
    16-byte aligned rows and starts (TMA); w contiguous."""
    dtype = out.dtype
    if dtype not in GL_DTYPES or a_SK.dtype != dtype or w_E.dtype != dtype:
        return False
    k_dim = a_SK.shape[1]
    n = w_E.shape[1] if w_nk else w_E.shape[2]
    if block_m != 128 or route_block != block_m or block_n > 256:
        return False
    if n % block_n or k_dim % block_k or out.shape[1] != n:
        return False
    if not w_E.is_contiguous():
        return False
    return rows_aligned(a_SK, out, w_E.view(-1, w_E.shape[2]))


def slot_gemm_ws(a_SK, w_E, block_expert, expert_starts, expert_counts, out, w_nk: bool,
                 block_m: int, block_n: int, block_k: int, group_m: int, stages: int,
                 num_programs: int):
    """Fill out's rows of live slot blocks with slot_gemm.slot_gemm's values (see `fits`);
    returns the grid."""
    num_experts = w_E.shape[0]
    k_dim = a_SK.shape[1]
    n = w_E.shape[1] if w_nk else w_E.shape[2]
    num_blocks = a_SK.shape[0] // block_m
    w_box = (block_n, block_k) if w_nk else (block_k, block_n)
    a_desc = descriptor(a_SK, (block_m, block_k))
    w_desc = descriptor(w_E.view(-1, w_E.shape[2]), w_box)
    c_desc = descriptor(out, (block_m, block_n))
    grid = (max(1, min(num_blocks * (n // block_n), num_programs)),)
    _slot_gemm_ws_kernel[grid](
        a_desc, w_desc, c_desc, block_expert, expert_starts, expert_counts, num_experts,
        num_blocks, n, k_dim, W_NK=w_nk,
        **launch_constants(block_m, block_n, block_k, group_m, stages), enable_fp_fusion=FUSED)
    return grid[0]
