"""The expert dW kernel of wgrad.py as one program per SM, its tile and K loops fused by hand.

Same contract as `wgrad.expert_wgrad` (see wgrad.py): dW[e] = sum over expert e's real slots
of L[row_L(s)]^T R[row_R(s)], one program owns each dW tile, no atomics, an empty expert's tiles
get exact zeros, `accumulate` adds in fp32 with one rounding. Only the padded K loop (BLOCK_K
dividing the route block) runs here; wgrad.py keeps the masked loop.

Why: a dW tile's K loop is an expert's slot count, 512 slots at T = 8192 (8 steps of 64), so
the per-tile pipeline fill and epilogue of the one-program-per-tile kernel cost about a third
as much again as the steps themselves. Triton fuses a tile loop with its K loop (`flatten`)
only when the K trip count does not depend on the tile, and here it depends on the expert. So
the loop is written flat: one loop over this program's K steps, the tile advancing inside it,
the store under an `if` at a tile's last step. The pipeliner then loads the next tile's first
K steps while the last one's epilogue runs.

Schedule: the tiles are numbered expert-major (grouped rows within an expert, as wgrad.py), and
program p takes tiles p, p + G, p + 2G, ... (G programs). Every tile runs max(1, steps) K
steps: an empty expert's one step reads whatever lies at its (empty) slot range and the store
selects zeros for it (`count > 0`), so NaN there never reaches dW. Each tile sums the same K
tiles in the same order as wgrad.py's kernel with the same tile shape: bitwise equal to it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .slot_schedule import grouped_pid


@triton.jit
def _tile_of(tile, tiles_m, tiles_n, expert_start_ptr, expert_count_ptr, num_tiles,
             GROUP_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile number -> (expert, pid_m, pid_n, first slot, real slots, K steps >= 1); a number
    past the last tile reads expert 0 (its steps are never run)."""
    tiles_e = tiles_m * tiles_n
    ok = tile < num_tiles
    expert = tl.where(ok, tile // tiles_e, 0)
    pid_m, pid_n = grouped_pid(tile % tiles_e, tiles_m, tiles_n, GROUP_M)
    start = tl.load(expert_start_ptr + expert)
    count = tl.load(expert_count_ptr + expert)
    steps = tl.maximum(tl.cdiv(count, BLOCK_K), 1)
    return expert, pid_m, pid_n, start, count, steps


@triton.jit
def dw_step(acc, l_ptr, r_ptr, l_desc, r_desc, row_l, row_r, l_mask, r_mask, slot0, pid_m,
            pid_n, offs_m, offs_n, stride_l, stride_r, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, L_TMA: tl.constexpr, R_TMA: tl.constexpr):
    """One K step of a dW tile (both kernels): acc += L^T tile @ R tile. The L^T tile
    [BLOCK_M, BLOCK_K]: column k of it is row row_l[k] of L; a slot-order operand with a
    descriptor loads its box at (slot0, column) instead of its rows."""
    if L_TMA:
        lt = l_desc.load([slot0, pid_m * BLOCK_M]).T
    else:
        lt = tl.load(l_ptr + row_l.to(tl.int64)[None, :] * stride_l + offs_m[:, None],
                     mask=l_mask, other=0.0)
    if R_TMA:
        r = r_desc.load([slot0, pid_n * BLOCK_N])
    else:
        r = tl.load(r_ptr + row_r.to(tl.int64)[:, None] * stride_r + offs_n[None, :],
                    mask=r_mask, other=0.0)
    return tl.dot(lt, r, acc)


@triton.jit
def _wgrad_persistent_kernel(
    l_ptr, r_ptr, l_desc, r_desc, dw_ptr, slot_token_ptr, expert_start_ptr, expert_count_ptr,
    M, N, num_experts, num_tokens, num_slots, stride_l, stride_r, stride_dwe, stride_dwm,
    GATHER_L: tl.constexpr, GATHER_R: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, L_TMA: tl.constexpr, R_TMA: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_experts * tiles_m * tiles_n
    offs_k = tl.arange(0, BLOCK_K)

    # This program's K steps over all its tiles.
    total = 0
    for tile in range(pid, num_tiles, grid):
        count = tl.load(expert_count_ptr + tile // (tiles_m * tiles_n))
        total += tl.maximum(tl.cdiv(count, BLOCK_K), 1)

    tile = pid
    expert, pid_m, pid_n, start, count, steps = _tile_of(
        tile, tiles_m, tiles_n, expert_start_ptr, expert_count_ptr, num_tiles, GROUP_M, BLOCK_K)
    k0 = 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in tl.range(0, total, num_stages=NUM_STAGES):
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        slots = start + k0 + offs_k
        row_l = slots
        row_r = slots
        l_mask = m_ok[:, None]
        r_mask = n_ok[None, :]
        # The gathered operand's token ids, loaded in the step that uses them. Loaded a step
        # ahead (loop-carried, as wgrad.py does) they trip an assertion of Triton 3.6's
        # pipeliner next to the epilogue's `if`; here the id load takes a stage of its own,
        # so NUM_STAGES = 5 keeps the 3 buffers per operand that wgrad.py's 3 stages get.
        tok = tl.load(slot_token_ptr + slots, mask=slots < num_slots, other=num_tokens)
        if GATHER_L:
            row_l = tok
            l_mask = (tok < num_tokens)[None, :] & m_ok[:, None]
        if GATHER_R:
            row_r = tok
            r_mask = (tok < num_tokens)[:, None] & n_ok[None, :]
        acc = dw_step(acc, l_ptr, r_ptr, l_desc, r_desc, row_l, row_r, l_mask, r_mask,
                      start + k0, pid_m, pid_n, offs_m, offs_n, stride_l, stride_r,
                      BLOCK_M, BLOCK_N, L_TMA, R_TMA)
        last = k0 + BLOCK_K == steps * BLOCK_K
        if last:  # the tile's last K step: its epilogue
            out = tl.where(count > 0, acc, 0.0)
            dw_ptrs = (dw_ptr + expert.to(tl.int64) * stride_dwe
                       + offs_m.to(tl.int64)[:, None] * stride_dwm + offs_n[None, :])
            if ACCUMULATE:
                out += tl.load(dw_ptrs, mask=m_ok[:, None] & n_ok[None, :],
                               other=0.0).to(tl.float32)
            tl.store(dw_ptrs, out.to(dw_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The next step's tile and slot, by selects outside the epilogue's `if`: the pipeliner
        # runs them (and the loads they address) stages ahead of the dot, which it could not
        # if they hung on the branch that holds the store.
        tile = tl.where(last, tile + grid, tile)
        expert, pid_m, pid_n, start, count, steps = _tile_of(
            tile, tiles_m, tiles_n, expert_start_ptr, expert_count_ptr, num_tiles, GROUP_M,
            BLOCK_K)
        k0 = tl.where(last, 0, k0 + BLOCK_K)

def launch_persistent(l_rows, r_rows, l_desc, r_desc, routes, out_EMN, gather_l, gather_r,
                      cfg, accumulate, grid):
    """One launch of the kernel above over `grid` programs (wgrad.expert_wgrad picks it)."""
    num_experts, m, n = out_EMN.shape
    _wgrad_persistent_kernel[(grid,)](
        l_rows, r_rows, l_rows if l_desc is None else l_desc,
        r_rows if r_desc is None else r_desc, out_EMN, routes.slot_token,
        routes.expert_starts, routes.expert_counts, m, n, num_experts,
        routes.token_slots.shape[0], routes.num_slots, l_rows.stride(0), r_rows.stride(0),
        out_EMN.stride(0), out_EMN.stride(1),
        GATHER_L=gather_l, GATHER_R=gather_r, ACCUMULATE=accumulate, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        L_TMA=l_desc is not None, R_TMA=r_desc is not None, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out_EMN
