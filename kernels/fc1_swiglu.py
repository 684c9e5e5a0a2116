"""FC1 + SwiGLU: the gathered FC1 GEMM with the gated activation in its epilogue.

Layout contract (S slots, BM-blocks of one expert each, see route_align.py; T tokens, H hidden,
F ffn width, E experts; all tensors row-major with a contiguous last dimension):
- `fc1_swiglu`: Y1[s] = X[slot_token[s]] @ w_gate_up[e(s)]^T  ->  Y1 [S, 2F] (input dtype), and
  in the same epilogue A[s] = silu(g) * u * p  ->  A [S, F]. X [T, H], w_gate_up [E, 2F, H].
  One program owns matching column tiles of gate (columns n) and up (columns F + n).
  Optional (constexpr, no cost when off): a bias b [E, 2F] added to the fp32 accumulator of
  real rows before Y1 is rounded (HAS_BIAS), and the clamped SwiGLU of gated_act.py (CLAMPED).
The gathered rows ride the A-tile load (`gathered_k_loop`, gathered_loop.py). Sentinel and
padding rules, tile configs and the variants: gemm_config.py; launch and fallback:
gemm_launch.py. The variant of this kernel alone:
- `paired` (fc1_swiglu with `tma`, 2 BN <= 256): w_gate_up [E, 2F, H] is described as
  [2E, F, H], so one [2, BN, BK] box holds the gate and the up rows of a column tile; it is
  the [2 BN, BK] operand of one [BM, 2 BN] dot a K step (instead of two [BM, BN] dots, each
  reading the A tile), and the accumulator is split into gate and up in the epilogue. A box
  past F reads zeros, never the up rows. No weight layout changes. In the product (with
  `persistent` at 128-row blocks): on the H200, T = 8192, FC1 0.79-0.82 ms against 0.87-0.90
  unpaired (benchmarks/experts_ab.py; benchmarks/results/NOTES.md, "one dot for gate and up,
  over the unchanged layout", 2026-11-30).
With MOEGRAPH_FC1_TMA_STORE=1 (gemm_config.FC1_TMA_STORE) the TMA variant also writes Y1 and
A through TMA store descriptors where F is a multiple of the column tile (`_fc1_store_tma`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import fc1_swiglu_ws, gluon_hopper, tma
from . import gemm_config as gc
from . import gemm_launch as gl
from .fp_fusion import FUSED
from .gated_act import gated_forward
from .gathered_loop import gathered_k_loop
from .gemm_config import GemmConfig, fc1_config, splits_tail
from .route_align import RouteList
from .slot_schedule import live_block_list, persistent_tile, program_tile, store_zero_gated_rows


@triton.jit
def _fc1_swiglu_tile(
    pid_m, pid_n, expert,
    x_ptr, w_ptr, w_desc, weights_ptr, slot_token_ptr, slot_route_ptr, y1_ptr, act_ptr,
    y1_desc, act_desc, bias_ptr, alpha, limit,
    num_tokens, num_routes, ffn, hidden,
    stride_xt, stride_we, stride_wn, stride_y1, stride_act, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, Y_TMA: tl.constexpr,
    PAIRED: tl.constexpr, FAST_ACT: tl.constexpr,
):
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
    if PAIRED:  # w_desc over w as [2E, F, H]: box (2e, n, k) = gate rows n.., up rows n..
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        acc, _ = gathered_k_loop(
            acc, acc, x_ptrs, row_ok, hidden, wg_ptrs, wg_ptrs, BLOCK_K, n_ok,
            w_desc, 2 * expert, pid_n * BLOCK_N, 0,
            BLOCK_K=BLOCK_K, EVEN_K=EVEN_K, EVEN_N=EVEN_N, TWO_B=False, B_TMA=True, B_NK=True,
            B_PAIR=True)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # TMA: w_gate_up as [E * 2F, H]; gate rows e*2F + n, up rows e*2F + F + n.
        acc_g, acc_u = gathered_k_loop(
            acc_g, acc_u, x_ptrs, row_ok, hidden, wg_ptrs, wu_ptrs, BLOCK_K, n_ok,
            w_desc, expert * 2 * ffn + pid_n * BLOCK_N, 0, ffn,
            BLOCK_K=BLOCK_K, EVEN_K=EVEN_K, EVEN_N=EVEN_N, TWO_B=True, B_TMA=USE_TMA, B_NK=True)

    if HAS_BIAS:  # b_gate_up[e] in fp32 into the accumulator; padding rows stay zero
        b_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + offs_n
        b_g = tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)
        b_u = tl.load(b_ptrs + ffn, mask=n_ok, other=0.0).to(tl.float32)
        acc_g += tl.where(row_ok[:, None], b_g[None, :], 0.0)
        acc_u += tl.where(row_ok[:, None], b_u[None, :], 0.0)
    # Round g and u to the stored dtype first: backward recomputes A from the stored Y1.
    g = acc_g.to(y1_ptr.dtype.element_ty)
    u = acc_u.to(y1_ptr.dtype.element_ty)
    route = tl.load(slot_route_ptr + offs_m)
    p = tl.load(weights_ptr + route, mask=route < num_routes, other=0.0).to(tl.float32)
    act = gated_forward(g.to(tl.float32), u.to(tl.float32), p[:, None], alpha, limit, CLAMPED,
                        FAST_ACT)
    if Y_TMA:  # whole column tiles (F % BN == 0): the boxes never cross gate into up
        y1_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], g)
        y1_desc.store([pid_m * BLOCK_M, ffn + pid_n * BLOCK_N], u)
        act_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], act.to(act_ptr.dtype.element_ty))
    else:
        rows = offs_m.to(tl.int64)[:, None]
        out_mask = n_ok[None, :]
        y1_ptrs = y1_ptr + rows * stride_y1 + offs_n[None, :]
        tl.store(y1_ptrs, g, mask=out_mask)
        tl.store(y1_ptrs + ffn, u, mask=out_mask)
        tl.store(act_ptr + rows * stride_act + offs_n[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _fc1_swiglu_kernel(
    x_ptr, w_ptr, w_desc, weights_ptr, slot_token_ptr, slot_route_ptr, block_expert_ptr,
    live_list_ptr, expert_counts_ptr, expert_starts_ptr, num_experts, y1_ptr, act_ptr, y1_desc,
    act_desc, bias_ptr, alpha, limit, num_tokens, num_routes, num_slots, ffn, hidden,
    stride_xt, stride_we, stride_wn, stride_y1, stride_act, stride_be,
    ROUTE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
    LIST_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    TAIL: tl.constexpr, Y_TMA: tl.constexpr, PAIRED: tl.constexpr, FAST_ACT: tl.constexpr,
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
            _fc1_swiglu_tile(
                pid_m, pid_n, expert, x_ptr, w_ptr, w_desc, weights_ptr,
                slot_token_ptr, slot_route_ptr, y1_ptr, act_ptr, y1_desc, act_desc, bias_ptr,
                alpha, limit, num_tokens, num_routes, ffn, hidden,
                stride_xt, stride_we, stride_wn, stride_y1, stride_act, stride_be,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, HAS_BIAS, CLAMPED, Y_TMA,
                PAIRED, FAST_ACT)
            if TAIL == 2:
                store_zero_gated_rows(y1_ptr, act_ptr, (pid_m + 1) * BLOCK_M, stride_y1,
                                      stride_act, pid_n, ffn, BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n, expert, ok = program_tile(
            tl.program_id(0), num_blocks, num_pid_n, block_expert_ptr, slot_route_ptr,
            num_routes, expert_counts_ptr, expert_starts_ptr, num_slots, GROUP_M, BLOCK_M,
            ROUTE_BLOCK, TAIL)
        if not ok:
            return
        _fc1_swiglu_tile(
            pid_m, pid_n, expert, x_ptr, w_ptr, w_desc, weights_ptr, slot_token_ptr,
            slot_route_ptr, y1_ptr, act_ptr, y1_desc, act_desc, bias_ptr, alpha, limit,
            num_tokens, num_routes, ffn, hidden,
            stride_xt, stride_we, stride_wn, stride_y1, stride_act, stride_be,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, USE_TMA, HAS_BIAS, CLAMPED, Y_TMA,
            PAIRED, FAST_ACT)
        if TAIL == 2:
            store_zero_gated_rows(y1_ptr, act_ptr, (pid_m + 1) * BLOCK_M, stride_y1, stride_act,
                                  pid_n, ffn, BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------------------------------------
# Launcher.


def fc1_swiglu(x_TH, w_gate_up_EFH, topk_weights_N, routes: RouteList, y1_out, act_out,
               cfg: GemmConfig | None = None, *, bias_EF2=None, clamp=None):
    """Fill y1_out [S, 2F] and act_out [S, F] (live blocks only); see the module docstring.
    `bias_EF2` [E, 2F] ([gate | up] halves, any float dtype) is added in fp32 to the
    accumulator before Y1 is rounded; `clamp` = (alpha, limit) picks the clamped SwiGLU.
    With cfg.paired (and cfg.tma) gate and up load as one box for one dot (module docstring)."""
    num_tokens, hidden = x_TH.shape
    ffn = w_gate_up_EFH.shape[1] // 2
    cfg = cfg or fc1_config(ffn, routes.block_m, x_TH.device)
    if cfg.warp_specialize and bias_EF2 is None and clamp is None and _warp_specialized(
            x_TH, w_gate_up_EFH, topk_weights_N, routes, y1_out, act_out, cfg):
        return y1_out, act_out
    return gl.with_fallback(
        "fc1", cfg, x_TH.device, (x_TH.dtype, routes.block_m, hidden, ffn),
        lambda c: _fc1_swiglu(x_TH, w_gate_up_EFH, topk_weights_N, routes, y1_out, act_out, c,
                              bias_EF2, clamp))


def _warp_specialized(x_TH, w_gate_up_EFH, topk_weights_N, routes: RouteList, y1_out,
                      act_out, cfg: GemmConfig) -> bool:
    """fc1_swiglu through fc1_swiglu_ws.py's kernel where the GPU is a Hopper and the launch
    fits (True, and LAST_PLAN says warp_specialize); False (nothing written) otherwise, or
    where its launch fails (gemm_launch.gluon_launch: then the Triton kernel)."""
    if not (gluon_hopper.available(x_TH.device) and not splits_tail(routes, cfg)
            and fc1_swiglu_ws.fits(x_TH, w_gate_up_EFH, y1_out, act_out, cfg.block_m,
                                   cfg.block_n, cfg.block_k, routes.block_m)):
        return False
    return gl.gluon_launch("fc1", (cfg, x_TH.dtype, x_TH.shape[1], w_gate_up_EFH.shape[1]),
                           lambda: fc1_swiglu_ws.fc1_swiglu_ws(
                               x_TH, w_gate_up_EFH, topk_weights_N, routes, y1_out, act_out,
                               cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m,
                               cfg.num_stages, tma.num_programs(x_TH.device)),
                           record={"store_tma": True})


def _fc1_swiglu(x_TH, w_gate_up_EFH, topk_weights_N, routes, y1_out, act_out, cfg,
                bias_EF2=None, clamp=None):
    num_tokens, hidden = x_TH.shape
    ffn = w_gate_up_EFH.shape[1] // 2
    w_desc, paired = None, False
    if cfg.tma and tma.tma_available(x_TH.device):
        if cfg.paired:
            w_desc = tma.gate_up_pair_desc(w_gate_up_EFH, cfg.block_n, cfg.block_k)
            paired = w_desc is not None
        if w_desc is None:
            w_desc = tma.weight_desc(w_gate_up_EFH, (cfg.block_n, cfg.block_k))
    grid, live_list, meta, plan = gl.build_plan(routes, cfg, ffn, x_TH.device,
                                                w_desc is not None)

    def launch(grid, cfg, live_list, meta, tail):
        box = (cfg.block_m, cfg.block_n)
        y_tma = _fc1_store_tma(cfg, w_desc is not None, ffn, y1_out, act_out)
        _fc1_swiglu_kernel[grid](
            x_TH, w_gate_up_EFH, w_gate_up_EFH if w_desc is None else w_desc, topk_weights_N,
            routes.slot_token, routes.slot_route, routes.block_expert, live_list,
            routes.expert_counts, routes.expert_starts, w_gate_up_EFH.shape[0], y1_out, act_out,
            tma.descriptor(y1_out, box) if y_tma else y1_out,
            tma.descriptor(act_out, box) if y_tma else act_out,
            x_TH if bias_EF2 is None else bias_EF2, *gl.act_scalars(clamp),
            num_tokens, topk_weights_N.numel(), routes.num_slots, ffn, hidden,
            x_TH.stride(0), w_gate_up_EFH.stride(0), w_gate_up_EFH.stride(1), y1_out.stride(0),
            act_out.stride(0), 0 if bias_EF2 is None else bias_EF2.stride(0),
            ROUTE_BLOCK=routes.block_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k == 0,
            EVEN_N=ffn % cfg.block_n == 0, HAS_BIAS=bias_EF2 is not None,
            CLAMPED=clamp is not None, TAIL=tail, Y_TMA=y_tma, PAIRED=paired,
            FAST_ACT=cfg.fast_act and x_TH.is_cuda, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            enable_fp_fusion=FUSED, **meta)

    plan = plan._replace(store_tma=_fc1_store_tma(cfg, w_desc is not None, ffn, y1_out, act_out),
                         paired=paired)
    gl.LAST_PLAN["fc1"] = gl.launch_split(launch, routes, cfg, grid, live_list, meta, plan,
                                          w_gate_up_EFH.shape[0], ffn, x_TH.device)
    return y1_out, act_out


def _fc1_store_tma(cfg: GemmConfig, weights_tma: bool, ffn: int, y1_out, act_out) -> bool:
    """Whether FC1 stores Y1 and A through TMA descriptors: with its TMA variant, whole
    column tiles (F % BN == 0: a gate box never reaches the up columns) and rows a
    descriptor can describe."""
    box = (cfg.block_m, cfg.block_n)
    return (gc.FC1_TMA_STORE and weights_tma and ffn % cfg.block_n == 0
            and tma.matrix_fits(y1_out, box) and tma.matrix_fits(act_out, box))
