"""The slot-order GEMM of FC2 and of FC1's dX, with FC2's bias in its epilogue.

Layout contract (S slots, BM-blocks of one expert each, see route_align.py; E experts; all
tensors row-major with a contiguous last dimension):
- `slot_gemm`: C[s] = A[s] @ w[e(s)]^T (w [E, N, K], FC2) or A[s] @ w[e(s)] (w [E, K, N], dX
  of FC1); A [S, K] is read in slot order, no gather. Optional (HAS_BIAS, FC2): C[s] +=
  p(s) * b[e(s)] in fp32 before the rounding, p(s) the slot's route weight (0 for padding).
Sentinel and padding rules, tile configs and the variants (`warp_specialize` applies to this
kernel only): gemm_config.py; launch and fallback: gemm_launch.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import gemm_launch as gl
from . import gluon_hopper, slot_gemm_ws, tma
from .fp_fusion import FUSED
from .gemm_config import GemmConfig, slot_gemm_config, splits_tail
from .route_align import RouteList
from .slot_schedule import live_block_list, persistent_tile, program_tile, store_zero_rows


@triton.jit
def _slot_gemm_tile(
    pid_m, pid_n, expert,
    a_ptr, a_desc, w_ptr, w_desc, c_ptr, N, K,
    stride_a, stride_we, stride_w, stride_c,
    bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
    W_NK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if W_NK:  # w[e] is [N, K]: C = A @ w[e]^T
        w_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
        w_step = BLOCK_K
        w_row = expert * N + pid_n * BLOCK_N  # TMA: w as [E * N, K]
    else:  # w[e] is [K, N]: C = A @ w[e]
        w_ptrs = w_base + offs_k.to(tl.int64)[:, None] * stride_w + offs_n[None, :]
        w_step = BLOCK_K * stride_w
        w_row = expert * K  # TMA: w as [E * K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if USE_TMA:
            a = a_desc.load([pid_m * BLOCK_M, k0])
            if W_NK:
                b = w_desc.load([w_row, k0]).T
            else:
                b = w_desc.load([w_row + k0, pid_n * BLOCK_N])
        elif EVEN_K:
            a = tl.load(a_ptrs)
            if EVEN_N:
                b = tl.load(w_ptrs)
            else:
                b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        if not USE_TMA:
            a_ptrs += BLOCK_K
            w_ptrs += w_step
    if HAS_BIAS:  # FC2: p * b_down[e] in fp32 before the one rounding (p = 0 on padding)
        route = tl.load(slot_route_ptr + offs_m)
        p = tl.load(weights_ptr + route, mask=route < num_routes, other=0.0).to(tl.float32)
        b = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_ok,
                    other=0.0).to(tl.float32)
        acc += p[:, None] * b[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _slot_gemm_kernel(
    a_ptr, a_desc, w_ptr, w_desc, c_ptr, block_expert_ptr, live_list_ptr,
    expert_counts_ptr, expert_starts_ptr, num_experts, num_slots, N, K,
    stride_a, stride_we, stride_w, stride_c,
    bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
    W_NK: tl.constexpr, ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, LIST_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr,
    TAIL: tl.constexpr,
):
    num_blocks = num_slots // BLOCK_M
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        live_list_ptr += tl.program_id(0) * 2 * num_blocks
        num_live = live_block_list(block_expert_ptr, live_list_ptr, num_blocks, slot_route_ptr,
                                   num_routes, expert_counts_ptr, expert_starts_ptr, num_experts,
                                   num_slots, BLOCK_M, ROUTE_BLOCK, LIST_CHUNK, WARP_SPECIALIZE,
                                   TAIL)
        num_tiles = num_live * num_pid_n
        if WARP_SPECIALIZE:
            for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                                 flatten=FLATTEN, warp_specialize=True):
                pid_m, pid_n, expert = persistent_tile(tile, live_list_ptr, num_live, num_blocks,
                                                       num_pid_n, GROUP_M)
                _slot_gemm_tile(pid_m, pid_n, expert, a_ptr, a_desc, w_ptr, w_desc, c_ptr,
                                N, K, stride_a, stride_we, stride_w, stride_c,
                                bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
                                W_NK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA,
                                HAS_BIAS)
        else:
            for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                                 flatten=FLATTEN):
                pid_m, pid_n, expert = persistent_tile(tile, live_list_ptr, num_live, num_blocks,
                                                       num_pid_n, GROUP_M)
                _slot_gemm_tile(pid_m, pid_n, expert, a_ptr, a_desc, w_ptr, w_desc, c_ptr,
                                N, K, stride_a, stride_we, stride_w, stride_c,
                                bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
                                W_NK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA,
                                HAS_BIAS)
                if TAIL == 2:
                    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                    store_zero_rows(c_ptr, (pid_m + 1) * BLOCK_M, stride_c, offs_n, offs_n < N,
                                    BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n, expert, ok = program_tile(
            tl.program_id(0), num_blocks, num_pid_n, block_expert_ptr, slot_route_ptr,
            num_routes, expert_counts_ptr, expert_starts_ptr, num_slots, GROUP_M, BLOCK_M,
            ROUTE_BLOCK, TAIL)
        if not ok:
            return
        _slot_gemm_tile(pid_m, pid_n, expert, a_ptr, a_desc, w_ptr, w_desc, c_ptr, N, K,
                        stride_a, stride_we, stride_w, stride_c,
                        bias_ptr, weights_ptr, slot_route_ptr, num_routes, stride_be,
                        W_NK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, HAS_BIAS)
        if TAIL == 2:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            store_zero_rows(c_ptr, (pid_m + 1) * BLOCK_M, stride_c, offs_n, offs_n < N,
                            BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------------------------------------
# Launcher.


def slot_gemm(a_SK, w_E, routes: RouteList, out, w_nk: bool, cfg: GemmConfig | None = None,
              *, bias_EN=None, topk_weights_N=None):
    """out[s] = a[s] @ w[e(s)]^T if w_nk (w [E, N, K]) else a[s] @ w[e(s)] (w [E, K, N]).
    With `bias_EN` [E, N] (FC2's b_down; needs `topk_weights_N`), out[s] += p(s) * bias[e(s)]
    in fp32 before the rounding; p(s) = topk_weights_N[slot_route[s]], 0 for padding."""
    k_dim = a_SK.shape[1]
    n = w_E.shape[1] if w_nk else w_E.shape[2]
    if bias_EN is not None and topk_weights_N is None:
        raise ValueError("slot_gemm: bias_EN needs topk_weights_N (the bias is scaled by p)")
    cfg = cfg or slot_gemm_config(n, routes.block_m, a_SK.device)
    if cfg.warp_specialize and bias_EN is None \
            and _warp_specialized(a_SK, w_E, routes, out, w_nk, cfg):
        return out
    return gl.with_fallback(
        "fc2" if w_nk else "dx", cfg, a_SK.device, (a_SK.dtype, routes.block_m, k_dim, n),
        lambda c: _slot_gemm(a_SK, w_E, routes, out, w_nk, c, bias_EN, topk_weights_N))


def _warp_specialized(a_SK, w_E, routes: RouteList, out, w_nk: bool, cfg: GemmConfig) -> bool:
    """slot_gemm through slot_gemm_ws.py's kernel where the GPU is a Hopper and the launch
    fits (True, and LAST_PLAN says warp_specialize); False (nothing written) otherwise, or
    where its launch fails (gemm_launch.gluon_launch: then the Triton kernel)."""
    if not (gluon_hopper.available(a_SK.device) and not splits_tail(routes, cfg)
            and slot_gemm_ws.fits(a_SK, w_E, out, w_nk, cfg.block_m, cfg.block_n,
                                  cfg.block_k, routes.block_m)):
        return False
    return gl.gluon_launch("fc2" if w_nk else "dx",
                           (cfg, a_SK.dtype, a_SK.shape[1], out.shape[1]),
                           lambda: slot_gemm_ws.slot_gemm_ws(
                               a_SK, w_E, routes.block_expert, routes.expert_starts,
                               routes.expert_counts, out, w_nk, cfg.block_m, cfg.block_n,
                               cfg.block_k, cfg.group_m, cfg.num_stages,
                               tma.num_programs(a_SK.device)), record={})


def _slot_gemm(a_SK, w_E, routes, out, w_nk, cfg, bias_EN=None, topk_weights_N=None):
    k_dim = a_SK.shape[1]
    n = w_E.shape[1] if w_nk else w_E.shape[2]
    a_desc = w_desc = None
    # w [E, K, N] tiles past K would contract the next expert's rows: TMA only for even K.
    if (cfg.tma and tma.tma_available(a_SK.device) and (w_nk or k_dim % cfg.block_k == 0)
            and tma.matrix_fits(a_SK, (cfg.block_m, cfg.block_k))):
        w_desc = tma.weight_desc(w_E, (cfg.block_n, cfg.block_k) if w_nk
                                 else (cfg.block_k, cfg.block_n))
        if w_desc is not None:
            a_desc = tma.descriptor(a_SK, (cfg.block_m, cfg.block_k))
    use_tma = w_desc is not None
    # The bias epilogue's pointer loads would break warp specialization (TMA loads only).
    grid, live_list, meta, plan = gl.build_plan(routes, cfg, n, a_SK.device, use_tma,
                                                ws_ok=use_tma and bias_EN is None)

    def launch(grid, cfg, live_list, meta, tail):
        # The tail tile (TAIL = 2) reads A through a box half as tall; no warp specialization.
        a_box = a_desc if tail != 2 or not use_tma else \
            tma.descriptor(a_SK, (cfg.block_m, cfg.block_k))
        _slot_gemm_kernel[grid](
            a_SK, a_box if use_tma else a_SK, w_E, w_desc if use_tma else w_E, out,
            routes.block_expert, live_list, routes.expert_counts, routes.expert_starts,
            w_E.shape[0], routes.num_slots, n, k_dim,
            a_SK.stride(0), w_E.stride(0), w_E.stride(1), out.stride(0),
            a_SK if bias_EN is None else bias_EN,
            a_SK if bias_EN is None else topk_weights_N, routes.slot_route,
            routes.token_slots.numel(),  # N: the slot_route sentinel
            0 if bias_EN is None else bias_EN.stride(0),
            HAS_BIAS=bias_EN is not None, W_NK=w_nk, ROUTE_BLOCK=routes.block_m,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=k_dim % cfg.block_k == 0,
            EVEN_N=n % cfg.block_n == 0, WARP_SPECIALIZE=plan.warp_specialize and tail != 2,
            TAIL=tail, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=FUSED, **meta)

    gl.LAST_PLAN["fc2" if w_nk else "dx"] = gl.launch_split(launch, routes, cfg, grid,
                                                            live_list, meta, plan,
                                                            w_E.shape[0], n, a_SK.device)
    return out
