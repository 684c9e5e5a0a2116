"""dA (gathered dOut @ w_down) with the SwiGLU backward in its epilogue.

Layout contract (S slots, BM-blocks of one expert each, see route_align.py; T tokens, H hidden,
F ffn width, E experts; all tensors row-major with a contiguous last dimension):
- `dact_swiglu`: dA[s] = dOut[slot_token[s]] @ w_down[e(s)] (w_down [E, H, F]) with the
  activation backward in the epilogue: writes dY1 [S, 2F], the recomputed A [S, F] (for the
  dW_down wgrad; STORE_ACT, not where the caller kept FC1's) and dp_part [S, cdiv(F, BN)]
  fp32 (`dp_tiles` columns), the per-column-tile partial sums of d(route probability); the
  caller reduces its rows in a fixed order (no atomics). CLAMPED picks the clamped SwiGLU
  backward.
- `paired` (GemmConfig; where 2 BN divides F): one program computes a [BM, 2 BN] dA tile in
  one dot a K step (the gathered dOut tile feeds twice the columns), rounds it to the input
  dtype and runs the epilogue one [BM, BN / 2] quarter at a time, so its registers stay below
  those of a BN-wide tile's epilogue; each quarter writes its own dp_part column (`dp_tiles`).
  dY1 and A are those of the BN tile; dp_part sums its columns in other groups. No split tail
  with it.
The gathered rows ride the A-tile load (`gathered_k_loop`, gathered_loop.py). Sentinel and
padding rules, tile configs and the variants: gemm_config.py; launch and fallback:
gemm_launch.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import gemm_launch as gl
from . import tma
from .gated_act import gated_backward, gated_forward
from .gathered_loop import gathered_k_loop
from .gemm_config import GemmConfig, dact_config
from .route_align import RouteList
from .slot_schedule import (live_block_list, persistent_tile, program_tile,
                            store_zero_gated_rows)


@triton.jit
def _dact_epilogue(
    acc, offs_m, offs_n, pid_dp, row_ok, route, route_ok, y1_ptr, weights_ptr, dy1_ptr,
    act_ptr, dp_ptr, alpha, limit, ffn, stride_y1, stride_dy1, stride_act, stride_dp,
    CLAMPED: tl.constexpr, ROUTE_MASK: tl.constexpr, slot_route_ptr=None, num_routes=0,
    LOAD_ROUTE: tl.constexpr = False, FAST_ACT: tl.constexpr = False,
    STORE_ACT: tl.constexpr = True,
):
    """The SwiGLU backward of one [BM, BN] dA tile at columns offs_n: dY1, A and dp_part's
    column pid_dp. LOAD_ROUTE: the rows' routes are loaded here (the BN tile's one epilogue,
    in the order it had before the paired tile), not passed in."""
    n_ok = offs_n < ffn
    # dA as autograd would hand it to the activation: rounded to the input dtype.
    da = acc.to(dy1_ptr.dtype.element_ty).to(tl.float32)
    rows = offs_m.to(tl.int64)[:, None]
    if LOAD_ROUTE:
        route = tl.load(slot_route_ptr + offs_m)
        route_ok = route < num_routes
    # A padding slot has both sentinels, so route_ok == row_ok. ROUTE_MASK (the persistent
    # loop) masks by the route: row_ok, from the A-load's tokens, would then have to stay live
    # across the K loop in the epilogue's layout, once per pipeline stage, which spills.
    tile_mask = (route_ok if ROUTE_MASK else row_ok)[:, None] & n_ok[None, :]
    y1_ptrs = y1_ptr + rows * stride_y1 + offs_n[None, :]
    g = tl.load(y1_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    u = tl.load(y1_ptrs + ffn, mask=tile_mask, other=0.0).to(tl.float32)
    p = tl.load(weights_ptr + route, mask=route_ok, other=0.0).to(tl.float32)
    dg, du, dp_part = gated_backward(da, g, u, p[:, None], alpha, limit, CLAMPED, FAST_ACT)
    out_mask = n_ok[None, :]
    dy1_ptrs = dy1_ptr + rows * stride_dy1 + offs_n[None, :]
    tl.store(dy1_ptrs, dg.to(dy1_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dy1_ptrs + ffn, du.to(dy1_ptr.dtype.element_ty), mask=out_mask)
    if STORE_ACT:
        act = gated_forward(g, u, p[:, None], alpha, limit, CLAMPED, FAST_ACT)
        tl.store(act_ptr + rows * stride_act + offs_n[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dp_ptr + offs_m.to(tl.int64) * stride_dp + pid_dp, dp_part)


@triton.jit
def _dact_swiglu_tile(
    pid_m, pid_n, expert,
    dout_ptr, w_ptr, w_desc, y1_ptr, weights_ptr, slot_token_ptr, slot_route_ptr,
    dy1_ptr, act_ptr, dp_ptr, alpha, limit,
    num_tokens, num_routes, ffn, hidden,
    stride_dt, stride_we, stride_wk, stride_y1, stride_dy1, stride_act, stride_dp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, CLAMPED: tl.constexpr,
    ROUTE_MASK: tl.constexpr, PAIRED: tl.constexpr, FAST_ACT: tl.constexpr,
    STORE_ACT: tl.constexpr,
):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tok = tl.load(slot_token_ptr + offs_m)
    row_ok = tok < num_tokens
    n_ok = offs_n < ffn

    d_ptrs = dout_ptr + tok.to(tl.int64)[:, None] * stride_dt + offs_k[None, :]
    # w_down[e] is [H, F]: B[k = h, n = f], contiguous along f.
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + offs_k.to(tl.int64)[:, None] * stride_wk + offs_n[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # TMA: w_down as [E * H, F]; tile [BK, BN] at (e*H + k, n).
    acc, _ = gathered_k_loop(
        acc, acc, d_ptrs, row_ok, hidden, w_ptrs, w_ptrs, BLOCK_K * stride_wk, n_ok,
        w_desc, expert * hidden, pid_n * BLOCK_N, 0,
        BLOCK_K=BLOCK_K, EVEN_K=EVEN_K, EVEN_N=EVEN_N, TWO_B=False, B_TMA=USE_TMA, B_NK=False)

    if PAIRED:
        route = tl.load(slot_route_ptr + offs_m)
        route_ok = route < num_routes
        # One [BM, 2 BN'] dot (BN' = BLOCK_N / 2, the config's block_n), rounded to the input
        # dtype at once (as the epilogue would), the epilogue then a [BM, BN' / 2] quarter at a
        # time, each writing its own dp_part column: the registers stay below a BN'-wide
        # tile's epilogue (half the columns live at most), where halves spilled.
        Q: tl.constexpr = BLOCK_N // 4
        acc16 = acc.to(dy1_ptr.dtype.element_ty)
        lo, hi = tl.split(tl.permute(tl.reshape(acc16, (BLOCK_M, 2, 2 * Q)), (0, 2, 1)))
        q0, q1 = tl.split(tl.permute(tl.reshape(lo, (BLOCK_M, 2, Q)), (0, 2, 1)))
        q2, q3 = tl.split(tl.permute(tl.reshape(hi, (BLOCK_M, 2, Q)), (0, 2, 1)))
        offs_q = pid_n * BLOCK_N + tl.arange(0, Q)
        _dact_epilogue(q0, offs_m, offs_q, 4 * pid_n, row_ok, route, route_ok, y1_ptr,
                       weights_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit, ffn, stride_y1,
                       stride_dy1, stride_act, stride_dp, CLAMPED, ROUTE_MASK,
                       FAST_ACT=FAST_ACT, STORE_ACT=STORE_ACT)
        _dact_epilogue(q1, offs_m, offs_q + Q, 4 * pid_n + 1, row_ok, route, route_ok,
                       y1_ptr, weights_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit, ffn,
                       stride_y1, stride_dy1, stride_act, stride_dp, CLAMPED, ROUTE_MASK,
                       FAST_ACT=FAST_ACT, STORE_ACT=STORE_ACT)
        _dact_epilogue(q2, offs_m, offs_q + 2 * Q, 4 * pid_n + 2, row_ok, route, route_ok,
                       y1_ptr, weights_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit, ffn,
                       stride_y1, stride_dy1, stride_act, stride_dp, CLAMPED, ROUTE_MASK,
                       FAST_ACT=FAST_ACT, STORE_ACT=STORE_ACT)
        _dact_epilogue(q3, offs_m, offs_q + 3 * Q, 4 * pid_n + 3, row_ok, route, route_ok,
                       y1_ptr, weights_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit, ffn,
                       stride_y1, stride_dy1, stride_act, stride_dp, CLAMPED, ROUTE_MASK,
                       FAST_ACT=FAST_ACT, STORE_ACT=STORE_ACT)
    else:
        _dact_epilogue(acc, offs_m, offs_n, pid_n, row_ok, row_ok, row_ok, y1_ptr,
                       weights_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit, ffn, stride_y1,
                       stride_dy1, stride_act, stride_dp, CLAMPED, ROUTE_MASK,
                       slot_route_ptr, num_routes, True, FAST_ACT, STORE_ACT)


@triton.jit
def _zero_dact_rows(dy1_ptr, act_ptr, dp_ptr, row0, stride_dy1, stride_act, stride_dp, pid_n,
                    ffn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_ACT: tl.constexpr):
    """The all-padding second half of a tail block: dY1, A (STORE_ACT) and dp_part's column
    pid_n."""
    store_zero_gated_rows(dy1_ptr, act_ptr, row0, stride_dy1, stride_act, pid_n, ffn, BLOCK_M,
                          BLOCK_N, STORE_ACT)
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(dp_ptr + rows * stride_dp + pid_n, tl.zeros((BLOCK_M,), dtype=tl.float32))


@triton.jit
def _dact_swiglu_kernel(
    dout_ptr, w_ptr, w_desc, y1_ptr, weights_ptr, slot_token_ptr, slot_route_ptr,
    block_expert_ptr, live_list_ptr, expert_counts_ptr, expert_starts_ptr, num_experts,
    dy1_ptr, act_ptr, dp_ptr, alpha, limit, num_tokens, num_routes, num_slots, ffn, hidden,
    stride_dt, stride_we, stride_wk, stride_y1, stride_dy1, stride_act, stride_dp,
    ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
    LIST_CHUNK: tl.constexpr, CLAMPED: tl.constexpr, TAIL: tl.constexpr,
    PAIRED: tl.constexpr, FAST_ACT: tl.constexpr, STORE_ACT: tl.constexpr,
):
    num_blocks = num_slots // BLOCK_M
    num_pid_n = tl.cdiv(ffn, BLOCK_N)
    if PERSISTENT:
        live_list_ptr += tl.program_id(0) * 2 * num_blocks
        num_live = live_block_list(block_expert_ptr, live_list_ptr, num_blocks, slot_route_ptr,
                                   num_routes, expert_counts_ptr, expert_starts_ptr, num_experts,
                                   num_slots, BLOCK_M, ROUTE_BLOCK, LIST_CHUNK, False, TAIL)
        num_tiles = num_live * num_pid_n
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                             flatten=FLATTEN):
            pid_m, pid_n, expert = persistent_tile(tile, live_list_ptr, num_live, num_blocks,
                                                   num_pid_n, GROUP_M)
            _dact_swiglu_tile(
                pid_m, pid_n, expert, dout_ptr, w_ptr, w_desc, y1_ptr, weights_ptr,
                slot_token_ptr, slot_route_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit,
                num_tokens, num_routes, ffn, hidden, stride_dt, stride_we, stride_wk,
                stride_y1, stride_dy1, stride_act, stride_dp,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, CLAMPED, True, PAIRED,
                FAST_ACT, STORE_ACT)
            if TAIL == 2:
                _zero_dact_rows(dy1_ptr, act_ptr, dp_ptr, (pid_m + 1) * BLOCK_M, stride_dy1,
                                stride_act, stride_dp, pid_n, ffn, BLOCK_M, BLOCK_N, STORE_ACT)
    else:
        pid_m, pid_n, expert, ok = program_tile(
            tl.program_id(0), num_blocks, num_pid_n, block_expert_ptr, slot_route_ptr,
            num_routes, expert_counts_ptr, expert_starts_ptr, num_slots, GROUP_M, BLOCK_M,
            ROUTE_BLOCK, TAIL)
        if not ok:
            return
        _dact_swiglu_tile(
            pid_m, pid_n, expert, dout_ptr, w_ptr, w_desc, y1_ptr, weights_ptr,
            slot_token_ptr, slot_route_ptr, dy1_ptr, act_ptr, dp_ptr, alpha, limit,
            num_tokens, num_routes, ffn, hidden, stride_dt, stride_we, stride_wk,
            stride_y1, stride_dy1, stride_act, stride_dp,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, CLAMPED, False, PAIRED,
            FAST_ACT, STORE_ACT)
        if TAIL == 2:
            _zero_dact_rows(dy1_ptr, act_ptr, dp_ptr, (pid_m + 1) * BLOCK_M, stride_dy1,
                            stride_act, stride_dp, pid_n, ffn, BLOCK_M, BLOCK_N, STORE_ACT)


# ---------------------------------------------------------------------------------------------
# Launchers.


def dp_tiles(ffn: int, cfg: GemmConfig) -> int:
    """Columns of dact_swiglu's dp_part buffer: one a column tile, or with `paired` one an
    epilogue quarter of the 2 BN tile (BN / 2 columns)."""
    return triton.cdiv(ffn, cfg.block_n // 2 if paired_tile(ffn, cfg) else cfg.block_n)


def dact_swiglu(dout_TH, w_down_EHF, y1_S2F, topk_weights_N, routes: RouteList,
                dy1_out, act_out, dp_part_out, cfg: GemmConfig | None = None, *, clamp=None):
    """Fill dy1_out [S, 2F], act_out [S, F] and dp_part_out [S, dp_tiles] fp32 (live blocks).
    act_out None: the activation is not recomputed (the caller kept FC1's, the same bits).
    `clamp` = (alpha, limit) picks the clamped SwiGLU backward. dp_part holds only the
    activation's share of d(route probability): FC2's bias term is the caller's."""
    num_tokens, hidden = dout_TH.shape
    ffn = w_down_EHF.shape[2]
    cfg = cfg or dact_config(ffn, routes.block_m, dout_TH.device)
    if dp_part_out.shape[1] != dp_tiles(ffn, cfg):
        raise ValueError(f"dp_part_out has {dp_part_out.shape[1]} columns, the tile config "
                         f"needs {dp_tiles(ffn, cfg)}")
    # The pointer path that replaces a failed variant keeps `paired` (a pointer-path tiling
    # too): dp_part's columns follow it.
    return gl.with_fallback(
        "dact", cfg, dout_TH.device, (dout_TH.dtype, routes.block_m, hidden, ffn),
        lambda c: _dact_swiglu(dout_TH, w_down_EHF, y1_S2F, topk_weights_N, routes, dy1_out,
                               act_out, dp_part_out, c, clamp),
        keep=("paired",))


def paired_tile(ffn: int, cfg: GemmConfig) -> bool:
    """Whether cfg's `paired` applies to dact: a [BM, 2 BN] tile, its epilogue in four BN / 2
    quarters, where 2 BN divides F (so every one of dp_part's cdiv(F, BN / 2) columns is
    written)."""
    return cfg.paired and ffn % (2 * cfg.block_n) == 0


def _dact_swiglu(dout_TH, w_down_EHF, y1_S2F, topk_weights_N, routes, dy1_out, act_out,
                 dp_part_out, cfg, clamp=None):
    num_tokens, hidden = dout_TH.shape
    ffn = w_down_EHF.shape[2]
    paired = paired_tile(ffn, cfg)
    # The kernel's tile: 2 BN wide when paired (no split tail then: its zero rows are written
    # per BN tile).
    tile = cfg._replace(block_n=2 * cfg.block_n, split_tail=False) if paired else cfg
    tile = tile._replace(paired=False)
    w_desc = None
    # Tiles of w_down [E, H, F] past H would contract the next expert's rows: even H only.
    if tile.tma and tma.tma_available(dout_TH.device) and hidden % tile.block_k == 0:
        w_desc = tma.weight_desc(w_down_EHF, (tile.block_k, tile.block_n))
    grid, live_list, meta, plan = gl.build_plan(routes, tile, ffn, dout_TH.device,
                                                w_desc is not None)

    store_act = act_out is not None
    act_arg = act_out if store_act else dy1_out  # never written without STORE_ACT

    def launch(grid, cfg, live_list, meta, tail):
        _dact_swiglu_kernel[grid](
            dout_TH, w_down_EHF, w_down_EHF if w_desc is None else w_desc, y1_S2F,
            topk_weights_N, routes.slot_token, routes.slot_route, routes.block_expert,
            live_list, routes.expert_counts, routes.expert_starts, w_down_EHF.shape[0], dy1_out,
            act_arg, dp_part_out, *gl.act_scalars(clamp),
            num_tokens, topk_weights_N.numel(), routes.num_slots, ffn, hidden,
            dout_TH.stride(0), w_down_EHF.stride(0), w_down_EHF.stride(1), y1_S2F.stride(0),
            dy1_out.stride(0), act_arg.stride(0), dp_part_out.stride(0),
            ROUTE_BLOCK=routes.block_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k == 0,
            EVEN_N=ffn % cfg.block_n == 0, CLAMPED=clamp is not None, TAIL=tail,
            PAIRED=paired, FAST_ACT=cfg.fast_act and dout_TH.is_cuda, STORE_ACT=store_act,
            **cfg.launch_options(),
            **meta)

    gl.LAST_PLAN["dact"] = gl.launch_split(launch, routes, tile, grid, live_list, meta, plan,
                                           w_down_EHF.shape[0], ffn, dout_TH.device
                                           )._replace(paired=paired)
    return dy1_out, act_out, dp_part_out
