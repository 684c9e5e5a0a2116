"""Slot GEMMs: per-expert GEMMs over the RouteList's slot blocks, gathers riding the A-tile load.

Layout contract (S slots, BM-blocks of one expert each, see route_align.py; T tokens, H hidden,
F ffn width, E experts; all tensors row-major with a contiguous last dimension):
- `fc1_swiglu`: Y1[s] = X[slot_token[s]] @ w_gate_up[e(s)]^T  ->  Y1 [S, 2F] (input dtype), and
  in the same epilogue A[s] = silu(g) * u * p  ->  A [S, F]. X [T, H], w_gate_up [E, 2F, H].
  One program owns matching column tiles of gate (columns n) and up (columns F + n).
- `slot_gemm`: C[s] = A[s] @ w[e(s)]^T (w [E, N, K], FC2) or A[s] @ w[e(s)] (w [E, K, N], dX
  of FC1); A [S, K] is read in slot order, no gather.
- `dact_swiglu`: dA[s] = dOut[slot_token[s]] @ w_down[e(s)] (w_down [E, H, F]) with the
  activation backward in the epilogue: writes dY1 [S, 2F], the recomputed A [S, F] (for the
  dW_down wgrad) and dp_part [S, cdiv(F, BN)] fp32, the per-column-tile partial sums of
  d(route probability); the caller reduces its rows in a fixed order (no atomics).
Sentinel and padding rules: a padding slot (slot_token == T, slot_route == T*k) reads its
gathered row as zeros through the load mask (never a real row) and its probability as 0, so
every row of a live block is written with finite values (zeros for padding slots). Blocks with
block_expert == -1 exit at once: their rows are never written and never read by anything that
feeds a real result. Row index * row stride is formed in int64.
Tile configs are picked on the host from static shapes (no autotune: the kernels are captured
in CUDA graphs); BLOCK_M must divide the RouteList's block_m.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .gated_act import swiglu_backward, swiglu_forward
from .route_align import RouteList


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def route_block_m(num_routes: int, num_experts: int, device: torch.device) -> int:
    """Slot block size of the RouteList: the largest M tile the slot GEMMs will use."""
    if device.type != "cuda":
        return 16
    # Padding costs up to block_m - 1 slots per expert; with few routes per expert a 64-row
    # block wastes half as much as 128 rows.
    return 128 if num_routes >= 256 * num_experts else 64


def _cuda_config(block_m: int, n: int, block_n: int, block_k: int = 64, stages: int = 3):
    while block_n > 64 and n % block_n:
        block_n //= 2
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return GemmConfig(block_m, block_n, block_k, 8, warps, stages)


def fc1_config(ffn: int, block_m: int, device: torch.device) -> GemmConfig:
    """block_n is per half: a program computes [BM, BN] of gate and [BM, BN] of up."""
    if device.type != "cuda":
        return GemmConfig(block_m, 32, 32, 4, 4, 1)
    # 128 x (2 x 128) output tile, K tile 32, 5 stages: (128*32 + 256*32) * 2 B = 24 KB/stage,
    # 120 KB. Chosen by `benchmarks/moe_experts.py --sweep` on the H200 (448 vs 439 TFLOP/s for
    # K tile 64 x 3 stages at the Qwen3 shape, T=8192).
    return _cuda_config(min(block_m, 128), ffn, 128, block_k=32, stages=5)


def slot_gemm_config(n: int, block_m: int, device: torch.device) -> GemmConfig:
    if device.type != "cuda":
        return GemmConfig(block_m, 32, 32, 4, 4, 1)
    # 128 x 256 x 64, 3 stages: 48 KB/stage, 144 KB of the 228 KB shared memory.
    return _cuda_config(min(block_m, 128), n, 256)


def dact_config(ffn: int, block_m: int, device: torch.device) -> GemmConfig:
    if device.type != "cuda":
        return GemmConfig(block_m, 32, 32, 4, 4, 1)
    # The epilogue reads two Y1 tiles and writes three: keep the tile at 128 x 128.
    return _cuda_config(min(block_m, 128), ffn, 128, stages=4)


@triton.jit
def grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (pid_m, pid_n), GROUP_M row blocks at a time so their tiles share L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _fc1_swiglu_kernel(
    x_ptr, w_ptr, weights_ptr, slot_token_ptr, slot_route_ptr, block_expert_ptr,
    y1_ptr, act_ptr,
    num_tokens, num_routes, num_slots, ffn, hidden,
    stride_xt, stride_we, stride_wn, stride_y1, stride_act,
    ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    pid_m, pid_n = grouped_pid(tl.program_id(0), num_slots // BLOCK_M, tl.cdiv(ffn, BLOCK_N),
                               GROUP_M)
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ROUTE_BLOCK)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tok = tl.load(slot_token_ptr + offs_m)
    row_ok = tok < num_tokens
    n_ok = offs_n < ffn

    x_ptrs = x_ptr + tok.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    wg_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
               + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None])
    wu_ptrs = wg_ptrs + ffn * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            if EVEN_N:
                bg = tl.load(wg_ptrs)
                bu = tl.load(wu_ptrs)
            else:
                bg = tl.load(wg_ptrs, mask=n_ok[None, :], other=0.0)
                bu = tl.load(wu_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < hidden
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            bu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K

    # Round g and u to the stored dtype first: backward recomputes A from the stored Y1.
    g = acc_g.to(y1_ptr.dtype.element_ty)
    u = acc_u.to(y1_ptr.dtype.element_ty)
    route = tl.load(slot_route_ptr + offs_m)
    p = tl.load(weights_ptr + route, mask=route < num_routes, other=0.0).to(tl.float32)
    act = swiglu_forward(g.to(tl.float32), u.to(tl.float32), p[:, None])
    rows = offs_m.to(tl.int64)[:, None]
    out_mask = n_ok[None, :]
    y1_ptrs = y1_ptr + rows * stride_y1 + offs_n[None, :]
    tl.store(y1_ptrs, g, mask=out_mask)
    tl.store(y1_ptrs + ffn, u, mask=out_mask)
    tl.store(act_ptr + rows * stride_act + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _slot_gemm_kernel(
    a_ptr, w_ptr, c_ptr, block_expert_ptr,
    num_slots, N, K,
    stride_a, stride_we, stride_w, stride_c,
    W_NK: tl.constexpr, ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    pid_m, pid_n = grouped_pid(tl.program_id(0), num_slots // BLOCK_M, tl.cdiv(N, BLOCK_N),
                               GROUP_M)
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ROUTE_BLOCK)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if W_NK:  # w[e] is [N, K]: C = A @ w[e]^T
        w_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
        w_step = BLOCK_K
    else:  # w[e] is [K, N]: C = A @ w[e]
        w_ptrs = w_base + offs_k.to(tl.int64)[:, None] * stride_w + offs_n[None, :]
        w_step = BLOCK_K * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
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
        a_ptrs += BLOCK_K
        w_ptrs += w_step
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _dact_swiglu_kernel(
    dout_ptr, w_ptr, y1_ptr, weights_ptr, slot_token_ptr, slot_route_ptr, block_expert_ptr,
    dy1_ptr, act_ptr, dp_ptr,
    num_tokens, num_routes, num_slots, ffn, hidden,
    stride_dt, stride_we, stride_wk, stride_y1, stride_dy1, stride_act, stride_dp,
    ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    pid_m, pid_n = grouped_pid(tl.program_id(0), num_slots // BLOCK_M, tl.cdiv(ffn, BLOCK_N),
                               GROUP_M)
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ROUTE_BLOCK)
    if expert < 0:
        return
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
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(d_ptrs, mask=row_ok[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(w_ptrs)
            else:
                b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < hidden
            a = tl.load(d_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        d_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    # dA as autograd would hand it to the activation: rounded to the input dtype.
    da = acc.to(dy1_ptr.dtype.element_ty).to(tl.float32)
    rows = offs_m.to(tl.int64)[:, None]
    tile_mask = row_ok[:, None] & n_ok[None, :]
    y1_ptrs = y1_ptr + rows * stride_y1 + offs_n[None, :]
    g = tl.load(y1_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    u = tl.load(y1_ptrs + ffn, mask=tile_mask, other=0.0).to(tl.float32)
    route = tl.load(slot_route_ptr + offs_m)
    p = tl.load(weights_ptr + route, mask=route < num_routes, other=0.0).to(tl.float32)
    dg, du, dp_part = swiglu_backward(da, g, u, p[:, None])
    act = swiglu_forward(g, u, p[:, None])
    out_mask = n_ok[None, :]
    dy1_ptrs = dy1_ptr + rows * stride_dy1 + offs_n[None, :]
    tl.store(dy1_ptrs, dg.to(dy1_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dy1_ptrs + ffn, du.to(dy1_ptr.dtype.element_ty), mask=out_mask)
    tl.store(act_ptr + rows * stride_act + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dp_ptr + offs_m.to(tl.int64) * stride_dp + pid_n, dp_part)


def _grid(routes: RouteList, cfg: GemmConfig, n: int):
    if routes.block_m % cfg.block_m:
        raise ValueError(f"tile block_m {cfg.block_m} must divide the RouteList block_m "
                         f"{routes.block_m}")
    return (routes.num_slots // cfg.block_m * triton.cdiv(n, cfg.block_n),)


def fc1_swiglu(x_TH, w_gate_up_EFH, topk_weights_N, routes: RouteList, y1_out, act_out,
               cfg: GemmConfig | None = None):
    """Fill y1_out [S, 2F] and act_out [S, F] (live blocks only); see the module docstring."""
    num_tokens, hidden = x_TH.shape
    ffn = w_gate_up_EFH.shape[1] // 2
    cfg = cfg or fc1_config(ffn, routes.block_m, x_TH.device)
    _fc1_swiglu_kernel[_grid(routes, cfg, ffn)](
        x_TH, w_gate_up_EFH, topk_weights_N, routes.slot_token, routes.slot_route,
        routes.block_expert, y1_out, act_out,
        num_tokens, topk_weights_N.numel(), routes.num_slots, ffn, hidden,
        x_TH.stride(0), w_gate_up_EFH.stride(0), w_gate_up_EFH.stride(1), y1_out.stride(0),
        act_out.stride(0),
        ROUTE_BLOCK=routes.block_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k == 0,
        EVEN_N=ffn % cfg.block_n == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y1_out, act_out


def slot_gemm(a_SK, w_E, routes: RouteList, out, w_nk: bool, cfg: GemmConfig | None = None):
    """out[s] = a[s] @ w[e(s)]^T if w_nk (w [E, N, K]) else a[s] @ w[e(s)] (w [E, K, N])."""
    k_dim = a_SK.shape[1]
    n = w_E.shape[1] if w_nk else w_E.shape[2]
    cfg = cfg or slot_gemm_config(n, routes.block_m, a_SK.device)
    _slot_gemm_kernel[_grid(routes, cfg, n)](
        a_SK, w_E, out, routes.block_expert,
        routes.num_slots, n, k_dim,
        a_SK.stride(0), w_E.stride(0), w_E.stride(1), out.stride(0),
        W_NK=w_nk, ROUTE_BLOCK=routes.block_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=k_dim % cfg.block_k == 0,
        EVEN_N=n % cfg.block_n == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def dp_tiles(ffn: int, cfg: GemmConfig) -> int:
    """Columns of dact_swiglu's dp_part buffer."""
    return triton.cdiv(ffn, cfg.block_n)


def dact_swiglu(dout_TH, w_down_EHF, y1_S2F, topk_weights_N, routes: RouteList,
                dy1_out, act_out, dp_part_out, cfg: GemmConfig | None = None):
    """Fill dy1_out [S, 2F], act_out [S, F] and dp_part_out [S, dp_tiles] fp32 (live blocks)."""
    num_tokens, hidden = dout_TH.shape
    ffn = w_down_EHF.shape[2]
    cfg = cfg or dact_config(ffn, routes.block_m, dout_TH.device)
    if dp_part_out.shape[1] != dp_tiles(ffn, cfg):
        raise ValueError(f"dp_part_out has {dp_part_out.shape[1]} columns, the tile config "
                         f"needs {dp_tiles(ffn, cfg)}")
    _dact_swiglu_kernel[_grid(routes, cfg, ffn)](
        dout_TH, w_down_EHF, y1_S2F, topk_weights_N, routes.slot_token, routes.slot_route,
        routes.block_expert, dy1_out, act_out, dp_part_out,
        num_tokens, topk_weights_N.numel(), routes.num_slots, ffn, hidden,
        dout_TH.stride(0), w_down_EHF.stride(0), w_down_EHF.stride(1), y1_S2F.stride(0),
        dy1_out.stride(0), act_out.stride(0), dp_part_out.stride(0),
        ROUTE_BLOCK=routes.block_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k == 0,
        EVEN_N=ffn % cfg.block_n == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dy1_out, act_out, dp_part_out
