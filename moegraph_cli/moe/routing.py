"""Router (HF semantics), the load-balancing statistics, and capacity selection.

Router: logits in the model dtype -> fp32 softmax -> top-k -> optional renormalisation ->
weights cast back to the model dtype (exactly as transformers' Qwen3MoeTopKRouter, and the
Mixtral (always renormalised), OLMoE and Qwen2-MoE routers, which compute the same).
GPT-OSS (`route_topk_softmax`): biased logits, top-k of the logits, softmax over those k;
DeepSeek-V3 (`route_grouped`): sigmoid scores, group-limited top-k.

Aux loss: transformers pools all MoE layers before normalising
(`load_balancing_loss_func`): aux = E * sum_e (N_e / (L*T)) * (P_e / (L*T)), N_e the top-k
assignments of expert e summed over layers and P_e its softmax mass. So each layer emits its
raw statistics `[2, E]` (counts, prob sums) and the model combines them: the per-layer scope
stays self-contained (and graphable) while the loss matches HF to the bit of its formula.

Everything here is sync-free: no .item(), no bincount, no nonzero.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..matmul import linear

# The top-k of the softmax and GPT-OSS routers by kernels/router_topk.py on CUDA (a tie to the
# lower index; torch.topk's order of ties is unspecified): MOEGRAPH_ROUTER_TOPK=0 turns it
# off. ON_CPU (tests) runs it on CPU, under TRITON_INTERPRET=1 and in fp32 only.
TOPK_KERNEL = os.environ.get("MOEGRAPH_ROUTER_TOPK", "1") not in ("0", "")
ON_CPU = False


def _topk(x_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of each row's top_k, as torch.topk returns them; values differentiable."""
    if TOPK_KERNEL and (x_TE.is_cuda or ON_CPU) and x_TE.dim() == 2 and x_TE.stride(-1) == 1 \
            and x_TE.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from moegraph_kernels import router_topk  # Triton: only where it runs
        if x_TE.shape[-1] <= router_topk.MAX_E:
            ids_TK = router_topk.topk_ids(x_TE.detach(), top_k)
            return x_TE.gather(1, ids_TK), ids_TK
    return torch.topk(x_TE, top_k, dim=-1)


def route(x_TH: torch.Tensor, w_router_EH: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """Return (topk_ids_TK int64, topk_weights_TK in x's dtype, probs_TE fp32)."""
    return _softmax_topk(linear(x_TH, w_router_EH), top_k, norm_topk_prob)


def skewed_route(x_TH: torch.Tensor, w_router_EH: torch.Tensor, top_k: int,
                 norm_topk_prob: bool):
    """`route` with +8 on the logits of experts 0..k-1 for the tokens whose first feature is
    above -1.5 (about 93% of them after a norm): a router that sends most tokens to the first
    EP rank's experts. Not a model's router: benchmarks/ep_capacity.py and the overflow tests
    patch it over models/common/ffn.route to force bounded-dispatch overflow."""
    logits_TE = linear(x_TH, w_router_EH)
    hot_E = torch.zeros(logits_TE.shape[1], dtype=logits_TE.dtype)
    hot_E[:top_k] = 8.0
    logits_TE = logits_TE + (x_TH[:, :1] > -1.5).to(logits_TE.dtype) * hot_E
    return _softmax_topk(logits_TE, top_k, norm_topk_prob)


def _softmax_topk(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool):
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    topk_weights_TK, topk_ids_TK = _topk(probs_TE, top_k)
    if norm_topk_prob:
        topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
    return topk_ids_TK, topk_weights_TK.to(logits_TE.dtype), probs_TE


def route_topk_softmax(x_TH: torch.Tensor, w_router_EH: torch.Tensor, b_router_E: torch.Tensor,
                       top_k: int):
    """GPT-OSS's router (transformers' GptOssTopKRouter): logits = x W^T + b in the model
    dtype, top-k over the logits, softmax over the k picked logits in the model dtype. Return
    (topk_ids_TK int64, topk_weights_TK in x's dtype, probs_TE fp32 softmax over every expert,
    for the statistics as transformers' load_balancing_loss_func takes them)."""
    logits_TE = linear(x_TH, w_router_EH, b_router_E)
    top_TK, topk_ids_TK = _topk(logits_TE, top_k)
    topk_weights_TK = torch.softmax(top_TK, dim=-1, dtype=top_TK.dtype)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    return topk_ids_TK, topk_weights_TK, probs_TE


def _top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties to the lower index (a stable sort;
    torch.topk leaves the order of ties unspecified). A copy: autograd keeps [.., k], not
    the whole sort."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()


def route_grouped(x_TH: torch.Tensor, w_router_EH: torch.Tensor, bias_E: torch.Tensor,
                  top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                  scaling: float):
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter). Return (topk_ids_TK int64,
    topk_weights_TK in x's dtype, scores_TE fp32 normalised per token, for the statistics).

    fp32 logits -> sigmoid scores; selection reads scores + bias (the correction bias moves
    the choice, never the weights): experts fall in n_group equal groups, a group scores the
    sum of its two best, the topk_group best groups stay and top_k experts are picked among
    them (ties to the lower group / expert index). Weights are the picked raw scores,
    renormalised (+1e-20) when norm_topk_prob, then times `scaling`."""
    num_tokens, num_experts = x_TH.shape[0], w_router_EH.shape[0]
    logits_TE = F.linear(x_TH.float(), w_router_EH.float())
    scores_TE = logits_TE.sigmoid()
    choice_TE = scores_TE.detach() + bias_E.float()
    groups_TGX = choice_TE.view(num_tokens, n_group, num_experts // n_group)
    group_scores_TG = groups_TGX.topk(min(2, groups_TGX.shape[-1]), dim=-1).values.sum(dim=-1)
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    keep_TG.scatter_(1, _top_indices(group_scores_TG, topk_group), True)
    keep_TE = keep_TG[:, :, None].expand_as(groups_TGX).reshape(num_tokens, num_experts)
    topk_ids_TK = _top_indices(choice_TE.masked_fill(~keep_TE, float("-inf")), top_k)
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if norm_topk_prob:
        topk_weights_TK = topk_weights_TK / (topk_weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights_TK = topk_weights_TK * scaling
    probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    return topk_ids_TK, topk_weights_TK.to(x_TH.dtype), probs_TE


def expert_counts_E(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert [E] fp32, counted on the device with no sync (bincount syncs): on
    CUDA by route_align.count_routes (one-hot sums per chunk, no atomics: 0.0175 ms against
    0.0300 for a float scatter_add of ones at 131072 routes, results/elementwise_ab.json), on
    the CPU by scatter_add. Exact while no expert has 2**24 routes."""
    if topk_ids_TK.is_cuda:
        from moegraph_kernels.route_align import count_routes
        return count_routes(topk_ids_TK, num_experts).float()
    ids = topk_ids_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.float32, device=ids.device).scatter_add_(
        0, ids, torch.ones(ids.numel(), dtype=torch.float32, device=ids.device))


def expert_load_E(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert [E] fp32 (DeepSeek-V3's balancing load)."""
    return expert_counts_E(topk_ids_TK, num_experts)


@torch.no_grad()
def update_correction_bias_(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place on the device:
    bias_e += rate * sign(mean load - load_e); an underloaded expert's bias rises."""
    bias_E.add_((load_E.mean() - load_E).sign().to(bias_E.dtype), alpha=rate)


def aux_stats(topk_ids_TK: torch.Tensor, probs_TE: torch.Tensor) -> torch.Tensor:
    """Per-layer load-balancing statistics `[2, E]` fp32: row 0 top-k counts, row 1 prob sums."""
    counts_E = expert_counts_E(topk_ids_TK, probs_TE.shape[-1])
    return torch.stack([counts_E, probs_TE.sum(dim=0)])


def aux_loss_from_stats(stats: list[torch.Tensor], num_tokens: int, reduce=None) -> torch.Tensor:
    """HF's pooled load-balancing loss from every MoE layer's `[2, E]` statistics; `reduce`
    (distributed) sums the pooled statistics over ranks, num_tokens then counts all ranks'."""
    total = torch.stack(stats).sum(dim=0)
    if reduce is not None:
        total = reduce(total)
    rows = num_tokens * len(stats)
    num_experts = total.shape[-1]
    return torch.sum((total[0] / rows) * (total[1] / rows)) * num_experts


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(T*k*F/E) routes per expert."""
    return max(1, math.ceil(num_tokens * top_k * capacity_factor / num_experts))


def capacity_keep_TK(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int,
                     capacity: int) -> torch.Tensor:
    """Bool [T, k]: per expert keep the `capacity` routes of highest weight, ties to lower token.

    Two stable sorts: by weight descending, then by expert. Route ids r = t*k+j grow with the
    token index and a token routes to an expert at most once, so stability gives the
    lower-token tie break.
    """
    ids_N = topk_ids_TK.reshape(-1)
    w_N = topk_weights_TK.reshape(-1).float()
    by_weight = torch.sort(w_N, descending=True, stable=True).indices
    by_expert = torch.sort(ids_N[by_weight], stable=True).indices
    order_N = by_weight[by_expert]  # routes grouped by expert, best first
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=ids_N.device)
    counts_E.scatter_add_(0, ids_N, torch.ones_like(ids_N))
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_sorted = torch.arange(ids_N.numel(), device=ids_N.device) - start_E[ids_N[order_N]]
    keep_N = torch.empty_like(ids_N, dtype=torch.bool)
    keep_N[order_N] = rank_sorted < capacity
    return keep_N.view_as(topk_ids_TK)


class Dispatch(NamedTuple):
    """Which routes the experts compute, and how their slots are sized (static shapes).

    keep_TK None: every route (dropless). With `capacity` C: at most C kept routes per expert
    (segments of round_up(C, BM) slots). keep_TK without capacity: dropless over the kept routes
    only, at most `max_kept` of them (expert parallelism: the routes a rank owns)."""
    keep_TK: torch.Tensor | None = None
    capacity: int | None = None
    max_kept: int | None = None


def local_dispatch(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int,
                   capacity_factor: float | None) -> Dispatch:
    """One process's dispatch: dropless, or capacity C = ceil(T*k*F/E) with the keep rule."""
    if capacity_factor is None:
        return Dispatch()
    num_tokens, top_k = topk_ids_TK.shape
    cap = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    return Dispatch(capacity_keep_TK(topk_ids_TK, topk_weights_TK, num_experts, cap), cap)
