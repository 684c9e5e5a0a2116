"""Pure-torch experts: the CPU execution path and the oracle for the Triton path.

Semantics (shared with moe/experts.py, bit for bit in how values are rounded):
- FC1: Y1 = x @ w_gate_up[e]^T, shape [*, 2F], gate = first F columns, up = last F; stored in
  the input dtype (it is the one F-scale tensor the Triton path saves for backward).
- act: A = silu(gate) * up * p in fp32 from the stored Y1, cast to the input dtype.
  The route probability is applied here, before FC2, so its gradient needs no saved FC2 output.
- FC2: Y2 = A @ w_down[e]^T, stored in the input dtype.
- combine: out[t] = sum over j of Y2 of route (t, j), accumulated in fp32 in j order.
Capacity mode drops, per expert, the routes beyond C = ceil(T*k*F/E) of lowest weight
(ties: higher token index dropped first); a dropped route contributes nothing.

Optional (keyword-only, GPT-OSS; absent, every value above is bitwise unchanged):
- `b_gate_up` [E, 2F] ([gate | up] halves): Y1 = x @ w_gate_up[e]^T + b_gate_up[e], the bias
  added in fp32 to the fp32 product, one rounding to the input dtype.
- `act` (moe/activation.ExpertAct): plain SwiGLU, or the clamped SwiGLU, computed in fp32 from
  the stored Y1 as above (`gated_act`).
- `b_down` [E, H]: the route weight stays inside the activation, so FC2 adds p * b_down[e]:
  Y2 = A @ w_down[e]^T + p * b_down[e] in fp32, one rounding. The token's output is then
  sum_j p_tj * (act_j @ w_down^T + b_down[e_tj]), GPT-OSS's expert sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import grads
from ..matmul import linear
from .activation import SWIGLU, ExpertAct, check_expert_extras
from .routing import Dispatch, local_dispatch


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: ExpertAct = SWIGLU) -> torch.Tensor:
    """The gated activation of fp32 gate and up (before the route weight): torch's formulas,
    so autograd gives the clamp gradients torch's clamp does (kernels/gated_act.py mirrors)."""
    if act.kind == "swiglu":
        return F.silu(gate) * up
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(act.alpha * gate))


def reference_moe(x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  w_gate_up_EFH: torch.Tensor, w_down_EHF: torch.Tensor,
                  capacity_factor: float | None = None, *,
                  b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                  act: ExpertAct = SWIGLU) -> torch.Tensor:
    """y_TH = sum_j p_tj * expert_{e_tj}(x_t), differentiable in x, weights, both w and the
    biases."""
    dispatch = local_dispatch(topk_ids_TK, topk_weights_TK, w_gate_up_EFH.shape[0],
                              capacity_factor)
    return reference_experts(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                             dispatch, b_gate_up=b_gate_up, b_down=b_down, act=act)


def reference_experts(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                      dispatch: Dispatch, *, b_gate_up=None, b_down=None,
                      act: ExpertAct = SWIGLU, recompute_fc1: bool = False,
                      residual: torch.Tensor | None = None,
                      keep_act: bool = False) -> torch.Tensor:
    """The experts over the routes `dispatch` keeps (all when keep_TK is None), plus
    `residual` ([T, H] or any shape of T * H elements) where given. A sink's
    gradient is deposited whole (an expert with no routes gets exact zeros). `recompute_fc1`
    (the MoE scope's selective recompute): this path keeps no expert activations and re-runs
    its whole expert loop in the backward (torch's non-reentrant checkpoint; the same values).
    `keep_act` (the permute-free path's kept activation) changes nothing here: this path keeps
    every activation."""
    check_expert_extras(w_gate_up_EFH, w_down_EHF, b_gate_up, b_down, act)
    top_k = topk_ids_TK.shape[1]
    w_gate_up_EFH, w_down_EHF = grads.through(w_gate_up_EFH), grads.through(w_down_EHF)
    if b_gate_up is not None:
        b_gate_up = grads.through(b_gate_up)
    if b_down is not None:
        b_down = grads.through(b_down)
    args = (x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF, dispatch.keep_TK)
    extras = {"b_gate_up": b_gate_up, "b_down": b_down, "act": act}
    if recompute_fc1 and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        y_TKH = checkpoint(route_outputs, *args, use_reentrant=False, **extras)
    else:
        y_TKH = route_outputs(*args, **extras)
    out_TH = y_TKH[:, 0].float()
    for j in range(1, top_k):
        out_TH = out_TH + y_TKH[:, j].float()
    out_TH = out_TH.to(x_TH.dtype)
    return out_TH if residual is None else residual.reshape(out_TH.shape) + out_TH


def route_outputs(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF, keep_TK=None,
                  *, b_gate_up=None, b_down=None, act: ExpertAct = SWIGLU):
    """Y2 of every route, `[T, k, H]` (zeros for dropped routes), by a loop over experts."""
    num_tokens, top_k = topk_ids_TK.shape
    num_experts, two_f, hidden = w_gate_up_EFH.shape
    ffn = two_f // 2
    y_TKH = x_TH.new_zeros(num_tokens, top_k, hidden)
    selected = topk_ids_TK if keep_TK is None else torch.where(keep_TK, topk_ids_TK, -1)
    for e in range(num_experts):
        tok, j = torch.nonzero(selected == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        if b_gate_up is None:
            y1 = linear(x_TH[tok], w_gate_up_EFH[e])
        else:  # the fp32 product plus the bias, one rounding (the kernel's epilogue)
            y1 = (F.linear(x_TH[tok].float(), w_gate_up_EFH[e].float())
                  + b_gate_up[e].float()).to(x_TH.dtype)
        gate, up = y1[:, :ffn].float(), y1[:, ffn:].float()
        p = topk_weights_TK[tok, j, None].float()
        a = (gated_act(gate, up, act) * p).to(x_TH.dtype)
        if b_down is None:
            y2 = linear(a, w_down_EHF[e])
        else:
            y2 = (F.linear(a.float(), w_down_EHF[e].float())
                  + p * b_down[e].float()).to(x_TH.dtype)
        y_TKH = y_TKH.index_put((tok, j), y2)
    return y_TKH


def loop_moe(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF, keep_TK=None,
             *, b_gate_up=None, b_down=None, act: ExpertAct = SWIGLU):
    """The plainest oracle: a loop over tokens and their routes, in fp64, differentiable (in
    whatever of its inputs require grad). For tests only."""
    num_tokens, top_k = topk_ids_TK.shape
    ffn = w_gate_up_EFH.shape[1] // 2
    rows = []
    for t in range(num_tokens):
        row = torch.zeros(x_TH.shape[1], dtype=torch.float64)
        for j in range(top_k):
            if keep_TK is not None and not bool(keep_TK[t, j]):
                continue
            e = int(topk_ids_TK[t, j])
            h = w_gate_up_EFH[e].double() @ x_TH[t].double()
            if b_gate_up is not None:
                h = h + b_gate_up[e].double()
            y = w_down_EHF[e].double() @ gated_act(h[:ffn], h[ffn:], act)
            if b_down is not None:
                y = y + b_down[e].double()
            row = row + topk_weights_TK[t, j].double() * y
        rows.append(row)
    return torch.stack(rows) if rows else torch.zeros(0, x_TH.shape[1], dtype=torch.float64)
