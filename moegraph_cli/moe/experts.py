"""The permute-free expert path: an autograd.Function over the Triton kernels in kernels/.

Same signature and semantics as moe/reference.reference_moe (see its docstring for how every
value is rounded). No permuted copy of the tokens is ever written: the GEMMs gather rows by the
RouteList's slot_token while loading their A tiles, and each token pulls its routes' rows back
in the combine. Forward and backward are sync-free with static shapes (every grid and buffer
size follows from T, k, E, H, F and the slot block size), so the whole thing can be captured
in a CUDA graph and replayed with new routing.

Saved for backward: x, the top-k weights, both weights, Y1 [S, 2F] (the only F-scale tensor)
and the RouteList (with biases: the biases and the top-k ids too). FC1's activation A [S, F]
(dW_down's operand) is recomputed from Y1 by the dA kernel's epilogue, or, with `keep_act`
(the MoE scope's `keep` mode, which a plan picks where memory allows), saved too, so that dA
neither recomputes nor stores it: b S F more bytes for about 1% of the experts' fwd+bwd. With
`recompute_fc1` (the MoE scope's selective recompute) Y1 is not saved: the backward re-runs FC1
from x, the weights and the routes first (the same kernel on the same inputs, so the same Y1
bit for bit), and dW_down reads that re-run's A. The bits are the same in every mode: FC1
computes A from the rounded Y1, as dA does.

Biases and the activation (GPT-OSS; see reference.py for the rounding points): b_gate_up rides
FC1's epilogue, p * b_down FC2's, the clamped SwiGLU the FC1 and dA epilogues. Their
gradients: db_gate_up[e] = sum of dY1 over e's slots, db_down[e] = sum of p * dOut rows over
e's slots (kernels/wgrad.expert_bias_grad: one program per column tile, no atomics), and the
route weight's gradient gains dOut_t . b_down[e] (a [T, E] GEMM, then gathered by the ids).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch

from moegraph_kernels import gemm_config
from moegraph_kernels.combine import gather_combine
from moegraph_kernels.dact_swiglu import dact_swiglu, dp_tiles
from moegraph_kernels.fc1_swiglu import fc1_swiglu
from moegraph_kernels.gemm_config import (GemmConfig, dact_config, fc1_config, fc2_config,
                                          route_block_m, slot_gemm_config)
from moegraph_kernels.route_align import RouteList, build_route_list
from moegraph_kernels.route_grad import route_weight_grad
from moegraph_kernels.slot_gemm import slot_gemm
from moegraph_kernels.wgrad import expert_bias_grad, expert_wgrad, wgrad_config

from .. import grads
from .activation import SWIGLU, ExpertAct, check_expert_extras
from .routing import Dispatch, local_dispatch

# Tests set this (through `poisoned_scratch`) to allocate every output and scratch buffer
# full of NaN instead of uninitialised, so a kernel that reads a row it must not, or leaves a
# real element unwritten, shows up as a non-finite result.
POISON_SCRATCH = False


@contextlib.contextmanager
def poisoned_scratch():
    global POISON_SCRATCH
    before, POISON_SCRATCH = POISON_SCRATCH, True
    try:
        yield
    finally:
        POISON_SCRATCH = before


def _scratch(shape, dtype, device) -> torch.Tensor:
    if POISON_SCRATCH:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


class TileConfigs(NamedTuple):
    """Every kernel's tile config, picked on the host from static shapes (no autotune)."""
    route_block: int
    fc1: GemmConfig
    fc2: GemmConfig
    dact: GemmConfig
    dx: GemmConfig
    wgrad_down: GemmConfig
    wgrad_gate_up: GemmConfig


def tile_configs(num_routes: int, num_experts: int, hidden: int, ffn: int,
                 device: torch.device) -> TileConfigs:
    """The kernels' default tiles, with the Hopper variants that measured faster on the H200
    (`benchmarks/moe_experts.py --variants`, Qwen3 shape, bitwise equal to the pointer path;
    each falls back to it where TMA or persistence is unavailable): FC1 loads its weight tiles
    through TMA (T=1024: 0.364 -> 0.244 ms; T=8192: 0.891 -> 0.811 ms; at 128-row blocks a K-64
    tile then took it to 0.795 ms, `benchmarks/tile_sweep.py`), as one gate/up box and one dot
    a K step (`paired`, below); FC2 at 128-row blocks runs persistent with TMA (0.442 -> 0.380
    ms; 4 stages then 0.373 ms, `tile_sweep.py`), at 64-row blocks a 64 x 128 x 64 tile
    (0.147 -> 0.127 ms); dX at 64-row blocks persistent with TMA (0.252 -> 0.238 ms)."""
    block = route_block_m(num_routes, num_experts, device)
    cfg = TileConfigs(
        route_block=block,
        fc1=fc1_config(ffn, block, device),
        fc2=fc2_config(hidden, block, device),
        dact=dact_config(ffn, block, device),
        dx=slot_gemm_config(hidden, block, device),
        wgrad_down=wgrad_config(ffn, device, num_routes / num_experts),
        wgrad_gate_up=wgrad_config(hidden, device, num_routes / num_experts,
                                   slot_order_l=True),
    )
    if device.type != "cuda":
        return cfg
    # The split tail (kernels/slot_schedule.py) stays off: on the H200 its second launch cost
    # more than the padding it saves (benchmarks/experts_ab.py, T = 8192: FC1 0.960 vs
    # 0.934 ms, FC2 0.464 vs 0.436 ms, whatever the tail tile).
    fc2 = cfg.fc2.with_variant("tma+persistent") if block >= 128 else \
        GemmConfig(64, 128, 64, 8, 4, 4)
    # dX at 128-row blocks: TMA with 4 stages (benchmarks/kernel_sweep.py on the H200, Qwen3
    # shape: 0.766 / 0.763 / 2.876 -> 0.685 / 0.772 / 2.846 ms at T = 8192 uniform, skewed and
    # 32768), and persistent: timed with every burst led by the default's and a twin of it as
    # the resolution (results/kernel_sweep_led.json) 0.828 / 0.845 / 2.960 / 2.976 -> 0.816 /
    # 0.777 / 2.756 / 2.746 ms at T = 8192 and 32768, uniform / skewed, the twin within 1.2%
    # but at 8192 uniform (4.2%); the whole expert fwd+bwd moved inside its 2% resolution
    # (results/tiles_ab.json). The sequential sweeps of before had it slower at 32768.
    dx = cfg.dx.with_variant("tma+persistent")
    if block >= 128:
        dx = dx._replace(num_stages=4)
        # Both as the warp-specialized Gluon kernel on a Hopper GPU (gemm_config.SLOT_GEMM_WS).
        fc2 = fc2._replace(warp_specialize=gemm_config.SLOT_GEMM_WS)
        dx = dx._replace(warp_specialize=gemm_config.SLOT_GEMM_WS)
    # FC1 paired (one [2, BN, BK] gate/up box, one dot a K step), and at 128-row blocks
    # persistent: benchmarks/experts_ab.py on the H200, T = 8192, FC1 alone 0.79-0.82 ms
    # paired against 0.87-0.90 unpaired; persistent on top 0.796 / 0.837 / 0.809 against
    # 0.818 / 0.823 / 0.823 in three A/Bs, 3.049 / 3.004 against 3.065 / 3.052 at T = 32768
    # (results/NOTES.md, the sixth session of 2026-11-30).
    fc1 = "tma+pair" if gemm_config.FC1_PAIRED else "tma"
    if gemm_config.FC1_PAIRED and block >= 128:
        fc1 = "tma+persistent+pair"
    # dA at 128-row blocks: the paired 128 x 256 tile, 3 stages, its epilogue a 64-column
    # quarter at a time (dact_swiglu.py): benchmarks/tiles_ab.py on the H200, the whole
    # expert fwd+bwd 0.986 / 0.979 of the 128 x 128 tile's at T = 8192 (uniform / skewed) and
    # 0.991 / 1.000 at 32768, its twin 1.013 / 1.008 / 0.999 / 1.008
    # (results/tiles_ab_dact_quarters.json); in a second run the 128 x 128 tile 0.996 / 1.016
    # / 1.036 / 1.032 of it (tiles_ab_dact_paired_default.json); the loaded step moved inside
    # its spread. dY1 and A bitwise the same, dp_part in quarters.
    dact = cfg.dact
    if gemm_config.DACT_PAIRED and block >= 128:
        dact = dact._replace(num_stages=3).with_variant("pair")
    fc1 = cfg.fc1.with_variant(fc1)
    if block >= 128:  # the warp-specialized Gluon kernel on a Hopper GPU (gemm_config.FC1_WS)
        fc1 = fc1._replace(warp_specialize=gemm_config.FC1_WS)
    return cfg._replace(fc1=fc1, fc2=fc2, dx=dx, dact=dact)


def build_routes(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int,
                 block_m: int, capacity_factor: float | None) -> RouteList:
    """The RouteList for one call: dropless, or capacity with moe/routing's keep rule."""
    keep_TK, cap, max_kept = local_dispatch(topk_ids_TK, topk_weights_TK, num_experts,
                                            capacity_factor)
    return build_route_list(topk_ids_TK, num_experts, block_m, keep_TK, cap, max_kept)


def _route_bound(topk_ids_TK: torch.Tensor, dispatch: Dispatch) -> int:
    """The most routes the slots must hold: what sizes the slot block (static)."""
    if dispatch.keep_TK is not None and dispatch.capacity is None and dispatch.max_kept:
        return min(dispatch.max_kept, topk_ids_TK.numel())
    return topk_ids_TK.numel()


class PermuteFreeMoE(torch.autograd.Function):
    """Outputs (y_TH, num_dropped [1] int32); differentiable in x, weights, both w, the
    optional biases and the optional residual_TH, which the combine adds to y (its gradient
    is y's)."""

    @staticmethod
    def forward(ctx, x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                dispatch, configs, b_gate_up_EF2=None, b_down_EH=None, act=SWIGLU,
                recompute_fc1=False, residual_TH=None, keep_act=False):
        num_tokens, hidden = x_TH.shape
        num_experts, two_f, _ = w_gate_up_EFH.shape
        ffn = two_f // 2
        dev = x_TH.device
        check_expert_extras(w_gate_up_EFH, w_down_EHF, b_gate_up_EF2, b_down_EH, act)
        ctx.weights = (w_gate_up_EFH, w_down_EHF)  # the parameters: sinks get dW written
        ctx.biases = (b_gate_up_EF2, b_down_EH)  # and db
        ctx.clamp = act.clamp
        if not isinstance(dispatch, Dispatch):  # a capacity factor (or None): decide here
            dispatch = local_dispatch(topk_ids_TK, topk_weights_TK, num_experts, dispatch)
        cfg = configs or tile_configs(_route_bound(topk_ids_TK, dispatch), num_experts, hidden,
                                      ffn, dev)
        x_TH = x_TH.contiguous()
        w_gate_up_EFH = w_gate_up_EFH.contiguous()
        w_down_EHF = w_down_EHF.contiguous()
        weights_N = topk_weights_TK.reshape(-1).contiguous()
        routes = build_route_list(topk_ids_TK, num_experts, cfg.route_block, *dispatch)
        S = routes.num_slots

        b_gate_up_EF2 = None if b_gate_up_EF2 is None else b_gate_up_EF2.contiguous()
        b_down_EH = None if b_down_EH is None else b_down_EH.contiguous()

        y1 = _scratch((S, two_f), x_TH.dtype, dev)
        a_S = _scratch((S, ffn), x_TH.dtype, dev)
        fc1_swiglu(x_TH, w_gate_up_EFH, weights_N, routes, y1, a_S, cfg.fc1,
                   bias_EF2=b_gate_up_EF2, clamp=ctx.clamp)
        y2 = slot_gemm(a_S, w_down_EHF, routes, _scratch((S, hidden), x_TH.dtype, dev),
                       w_nk=True, cfg=cfg.fc2, bias_EN=b_down_EH, topk_weights_N=weights_N)
        # A for dW_down: kept (keep_act), else dA recomputes it from Y1; with recompute_fc1
        # FC1's re-run has it.
        kept_act = a_S if keep_act and not recompute_fc1 else None
        del a_S
        out = gather_combine(y2, routes.token_slots, _scratch((num_tokens, hidden), x_TH.dtype,
                                                              dev), residual_TH)
        # Only dweights reads the ids and b_down (the bias term of dp); saved only with a bias.
        ids_TK = topk_ids_TK if b_down_EH is not None else None
        ctx.save_for_backward(x_TH, weights_N, w_gate_up_EFH, w_down_EHF,
                              None if recompute_fc1 else y1, kept_act, ids_TK, b_down_EH,
                              *routes[:-1])
        del y1, kept_act
        ctx.block_m = routes.block_m
        ctx.configs = cfg
        ctx.weights_shape = topk_weights_TK.shape
        ctx.mark_non_differentiable(routes.num_dropped)
        return out, routes.num_dropped

    @staticmethod
    def backward(ctx, dout_TH, _grad_dropped):
        (x_TH, weights_N, w_gate_up_EFH, w_down_EHF, y1, act, ids_TK, b_down_EH,
         *route_tensors) = ctx.saved_tensors
        routes = RouteList(*route_tensors, block_m=ctx.block_m)
        cfg = ctx.configs
        num_tokens, hidden = x_TH.shape
        num_experts, two_f, _ = w_gate_up_EFH.shape
        ffn = two_f // 2
        S = routes.num_slots
        dev = x_TH.device
        need_x, _, need_w, need_gu, need_down = ctx.needs_input_grad[:5]
        need_b_gu, need_b_down = ctx.needs_input_grad[7:9]
        dout_TH = dout_TH.contiguous()
        if y1 is None:  # recompute_fc1: FC1 again; dW_down reads its activation
            y1 = _scratch((S, two_f), x_TH.dtype, dev)
            b_gate_up = ctx.biases[0]
            act_S = _scratch((S, ffn), x_TH.dtype, dev)
            fc1_swiglu(x_TH, w_gate_up_EFH, weights_N, routes, y1, act_S, cfg.fc1,
                       bias_EF2=None if b_gate_up is None else b_gate_up.contiguous(),
                       clamp=ctx.clamp)
            act = act_S
            del act_S

        dy1 = _scratch((S, two_f), x_TH.dtype, dev)
        recompute_act = act is None
        if recompute_act:
            act = _scratch((S, ffn), x_TH.dtype, dev)
        dp_part = _scratch((S, dp_tiles(ffn, cfg.dact)), torch.float32, dev)
        dact_swiglu(dout_TH, w_down_EHF, y1, weights_N, routes, dy1,
                    act if recompute_act else None, dp_part, cfg.dact, clamp=ctx.clamp)

        dw_down = None
        if need_down:
            dw_down = _wgrad(ctx.weights[1], dout_TH, act, routes, True, False, cfg.wgrad_down)
        del act
        dweights = None
        if need_w:
            # dp of a route: its slot's partial sums over F-tiles, reduced in column order
            # (one kernel; 0 for a dropped route), in fp32 where a bias term follows.
            slots_TK = routes.token_slots
            dweights = route_weight_grad(dp_part, slots_TK, torch.empty(
                slots_TK.shape, device=dev,
                dtype=weights_N.dtype if b_down_EH is None else torch.float32))
            if b_down_EH is not None:
                # FC2's p * b_down[e]: dp += dOut_t . b_down[e], all experts at once by a
                # [T, E] GEMM (fp32), then each route's column; dropped routes masked.
                dots_TE = dout_TH.float() @ b_down_EH.float().t()
                ids = ids_TK.long().clamp(0, num_experts - 1)
                dweights = torch.where(slots_TK >= 0, dweights + dots_TE.gather(1, ids), 0.0)
                dweights = dweights.to(weights_N.dtype)
            dweights = dweights.view(ctx.weights_shape)
        del dp_part
        db_down = None
        if need_b_down:
            db_down = _bias_grad(ctx.biases[1], dout_TH, routes, True, weights_N)
        dx = None
        if need_x:
            dx_S = slot_gemm(dy1, w_gate_up_EFH, routes, _scratch((S, hidden), x_TH.dtype, dev),
                             w_nk=False, cfg=cfg.dx)
            dx = gather_combine(dx_S, routes.token_slots,
                                _scratch((num_tokens, hidden), x_TH.dtype, dev))
            del dx_S
        dw_gate_up = None
        if need_gu:
            dw_gate_up = _wgrad(ctx.weights[0], dy1, x_TH, routes, False, True,
                                cfg.wgrad_gate_up)
        db_gate_up = None
        if need_b_gu:
            db_gate_up = _bias_grad(ctx.biases[0], dy1, routes, False, None)
        # Callers that pass no residual apply with fewer inputs: trailing Nones are allowed.
        d_residual = dout_TH if ctx.needs_input_grad[11:12] == (True,) else None
        return (dx, None, dweights, dw_gate_up, dw_down, None, None, db_gate_up, db_down,
                None, None, d_residual, None)


def _wgrad(w, l_rows, r_rows, routes, gather_l, gather_r, cfg):
    """An expert weight's gradient: written (or added) by the kernel straight into a sink's
    `.grad` (returns None), else into a fresh buffer that is returned."""
    where = grads.target(w)
    if where is not None:
        out, acc = where
        expert_wgrad(l_rows, r_rows, routes, out, gather_l, gather_r, cfg, accumulate=acc)
        return None
    out = _scratch(w.shape, w.dtype, l_rows.device)
    return expert_wgrad(l_rows, r_rows, routes, out, gather_l, gather_r, cfg)


def _bias_grad(b, r_rows, routes, gather_r, weights_N):
    """A bias's gradient (kernels/wgrad.expert_bias_grad): written (or added) into a sink's
    `.grad` (returns None), else into a fresh buffer that is returned."""
    where = grads.target(b)
    if where is not None:
        out, acc = where
        expert_bias_grad(r_rows, routes, out, gather_r, weights_N, accumulate=acc)
        return None
    out = _scratch(b.shape, b.dtype, r_rows.device)
    return expert_bias_grad(r_rows, routes, out, gather_r, weights_N)


def permute_free_moe_with_drops(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                                capacity_factor=None, configs: TileConfigs | None = None, *,
                                b_gate_up=None, b_down=None, act: ExpertAct = SWIGLU,
                                keep_act: bool = False):
    """(y_TH, num_dropped [1] int32 on the device); `configs` overrides the tile choice."""
    return PermuteFreeMoE.apply(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                                capacity_factor, configs, b_gate_up, b_down, act, False, None,
                                keep_act)


def permute_free_experts(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                         dispatch: Dispatch, *, b_gate_up=None, b_down=None,
                         act: ExpertAct = SWIGLU, recompute_fc1: bool = False,
                         residual: torch.Tensor | None = None,
                         keep_act: bool = False) -> torch.Tensor:
    """The experts over the routes `dispatch` keeps; reference_experts' contract (`residual`
    is added by the combine kernel, the same bits as adding it after; `keep_act`: FC1's
    activation saved for the backward, see PermuteFreeMoE)."""
    if residual is not None:
        residual = residual.reshape(x_TH.shape)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    return PermuteFreeMoE.apply(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                                dispatch, None, b_gate_up, b_down, act, recompute_fc1,
                                residual, keep_act)[0]


def permute_free_moe(x_TH: torch.Tensor, topk_ids_TK: torch.Tensor,
                     topk_weights_TK: torch.Tensor, w_gate_up_EFH: torch.Tensor,
                     w_down_EHF: torch.Tensor, capacity_factor: float | None = None, *,
                     b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                     act: ExpertAct = SWIGLU, keep_act: bool = False) -> torch.Tensor:
    """y_TH = sum_j p_tj * expert_{e_tj}(x_t): reference_moe's contract on the Triton kernels
    (`keep_act`: FC1's activation saved for the backward, see PermuteFreeMoE)."""
    return permute_free_moe_with_drops(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH,
                                       w_down_EHF, capacity_factor, b_gate_up=b_gate_up,
                                       b_down=b_down, act=act, keep_act=keep_act)[0]
