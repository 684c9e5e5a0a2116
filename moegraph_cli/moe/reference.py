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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import grads
from .routing import Dispatch, local_dispatch


def reference_moe(x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  w_gate_up_EFH: torch.Tensor, w_down_EHF: torch.Tensor,
                  capacity_factor: float | None = None) -> torch.Tensor:
    """y_TH = sum_j p_tj * expert_{e_tj}(x_t), differentiable in x, weights and both w."""
    dispatch = local_dispatch(topk_ids_TK, topk_weights_TK, w_gate_up_EFH.shape[0],
                              capacity_factor)
    return reference_experts(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                             dispatch)


def reference_experts(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                      dispatch: Dispatch) -> torch.Tensor:
    """The experts over the routes `dispatch` keeps (all when keep_TK is None). A sink's
    gradient is deposited whole (an expert with no routes gets exact zeros)."""
    top_k = topk_ids_TK.shape[1]
    w_gate_up_EFH, w_down_EHF = grads.through(w_gate_up_EFH), grads.through(w_down_EHF)
    y_TKH = route_outputs(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF,
                          dispatch.keep_TK)
    out_TH = y_TKH[:, 0].float()
    for j in range(1, top_k):
        out_TH = out_TH + y_TKH[:, j].float()
    return out_TH.to(x_TH.dtype)


def route_outputs(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF, keep_TK=None):
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
        y1 = F.linear(x_TH[tok], w_gate_up_EFH[e])
        gate, up = y1[:, :ffn].float(), y1[:, ffn:].float()
        act = (F.silu(gate) * up * topk_weights_TK[tok, j, None].float()).to(x_TH.dtype)
        y_TKH = y_TKH.index_put((tok, j), F.linear(act, w_down_EHF[e]))
    return y_TKH


def loop_moe(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_EFH, w_down_EHF, keep_TK=None):
    """The plainest oracle: a loop over tokens and their routes, in fp32. For tests only."""
    num_tokens, top_k = topk_ids_TK.shape
    ffn = w_gate_up_EFH.shape[1] // 2
    out = torch.zeros(num_tokens, x_TH.shape[1], dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(top_k):
            if keep_TK is not None and not bool(keep_TK[t, j]):
                continue
            e = int(topk_ids_TK[t, j])
            h = w_gate_up_EFH[e].double() @ x_TH[t].double()
            a = F.silu(h[:ffn]) * h[ffn:] * float(topk_weights_TK[t, j])
            out[t] += w_down_EHF[e].double() @ a
    return out
