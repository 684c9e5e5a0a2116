"""Expert parallelism: each rank of an EP group owns a contiguous range of experts; tokens go to
the ranks that own their experts and the results come back. Static shapes, no host sync, so
the whole exchange sits inside a captured moe graph.

Notation: P ranks in the EP group, this rank q owns global experts [q*E_l, (q+1)*E_l),
T tokens per rank, k routes per token, R = P*T received tokens.

Dispatch is an all-gather over the EP group of x [T, H], the top-k weights [T, k] and ids
[T, k]: rank q receives R rows, block s from EP rank s, and keeps the routes whose expert it
owns. Why not an all_to_all of the routed rows: a static (capturable) exchange must size every
destination's block for the worst case, every token to one rank, i.e. T rows per destination,
so an equal-split all_to_all moves exactly the bytes of an all-gather; the all-gather reads x
in place, where the all_to_all needs a packed send copy. The permute-free kernels then read
the received rows in place through the RouteList (no permuted copy on either side).
The receive buffers are the worst case ([R, H]); the real per-expert counts stay on the
device in the RouteList.

Combine: each rank's partial output [R, H] (per received token, the fp32 sum of its local
routes in j order, rounded once) goes back with an equal-split all_to_all_single; the source
sums the P partials in fp32 in rank order and rounds once. Deterministic, no atomics.

Backward is the exact transpose: the gradient of the all-gather is an all_to_all of the
gradient blocks back to their sources, summed in fp32 in rank order; the gradient of the
combine is an all-gather of dOut.

Capacity mode: the source keeps at most C = ceil(T*k*F/E) routes per expert over its own T
tokens (moe/routing.capacity_keep_TK), marks the dropped ones with id E (owned by no rank) and
counts them. A receiver then holds at most P*C routes per local expert: segments of
round_up(P*C, BM) slots, every shape static.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .routing import Dispatch, local_dispatch


@dataclass(frozen=True)
class EpGroup:
    """This rank's place in its expert-parallel group."""

    group: object  # a torch.distributed ProcessGroup
    size: int  # P
    rank: int  # q, the rank within the group
    num_experts: int  # E, global

    @property
    def num_local(self) -> int:
        return self.num_experts // self.size

    @property
    def expert_range(self) -> tuple[int, int]:
        return self.rank * self.num_local, (self.rank + 1) * self.num_local


_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(x: torch.Tensor, ep: EpGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((ep.size * x.shape[0], *x.shape[1:]))
    _gather(out, x, group=ep.group)
    return out


def _return_and_sum(blocks: torch.Tensor, ep: EpGroup) -> torch.Tensor:
    """Send block s of `blocks` [P*T, ...] to EP rank s; sum what comes back in fp32 in rank
    order and round once."""
    recv = torch.empty_like(blocks)
    dist.all_to_all_single(recv, blocks.contiguous(), group=ep.group)
    parts = recv.view(ep.size, -1, *recv.shape[1:])
    acc = parts[0].float()
    for r in range(1, ep.size):
        acc = acc + parts[r].float()
    return acc.to(blocks.dtype)


class _GatherTokens(torch.autograd.Function):
    """Forward: all-gather over the EP group. Backward: all_to_all back, fp32 sum."""

    @staticmethod
    def forward(ctx, x, ep):
        ctx.ep = ep
        return _all_gather(x, ep)

    @staticmethod
    def backward(ctx, grad):
        return _return_and_sum(grad, ctx.ep), None


class _ReturnPartials(torch.autograd.Function):
    """Forward: all_to_all of partial outputs back to their sources, fp32 sum. Backward:
    all-gather of dOut (every received token's partial gets its source token's gradient)."""

    @staticmethod
    def forward(ctx, partial, ep):
        ctx.ep = ep
        return _return_and_sum(partial, ep)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.ep), None


class _Connect(torch.autograd.Function):
    """Make `out` depend on `deps` (zero gradients): when a rank computes no route at all the
    pure-torch experts return a constant, and autograd would skip this rank's half of the
    backward collectives while the other ranks wait in them."""

    @staticmethod
    def forward(ctx, out, *deps):
        ctx.deps = [(d.shape, d.dtype, d.device) for d in deps]
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, *[torch.zeros(s, dtype=t, device=d) for s, t, d in ctx.deps])


def ep_moe(x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
           w_gate_up_local: torch.Tensor, w_down_local: torch.Tensor,
           capacity_factor: float | None, ep: EpGroup, experts, *,
           b_gate_up_local: torch.Tensor | None = None,
           b_down_local: torch.Tensor | None = None,
           act=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y_TH, dropped [1] int64) for this rank's tokens. `experts(x, ids, weights, w_gate_up,
    w_down, dispatch)` computes the local experts (reference_experts or permute_free_experts);
    the expert weights are this rank's slice [E_l, ...], and so are the optional biases, which
    are passed on (with `act`, an ExpertAct) as the experts' keyword arguments when given.
    Each route is computed on exactly one rank, so its p * b_down term is counted once."""
    num_tokens, top_k = topk_ids_TK.shape
    # Capacity is decided at the source, over this rank's own tokens (the one-process rule).
    keep_TK, cap, _ = local_dispatch(topk_ids_TK, topk_weights_TK, ep.num_experts,
                                     capacity_factor)
    if keep_TK is None:
        sent_ids = topk_ids_TK
        dropped = torch.zeros(1, dtype=torch.int64, device=x_TH.device)
    else:
        sent_ids = torch.where(keep_TK, topk_ids_TK, ep.num_experts)
        dropped = (~keep_TK).sum().reshape(1)

    ids_RK = _all_gather(sent_ids, ep)
    x_RH = _GatherTokens.apply(x_TH, ep)
    w_RK = _GatherTokens.apply(topk_weights_TK, ep)

    lo, hi = ep.expert_range
    mine_RK = (ids_RK >= lo) & (ids_RK < hi)
    local_RK = torch.where(mine_RK, ids_RK - lo, 0)
    received = ep.size * num_tokens
    if cap is None:
        dispatch = Dispatch(mine_RK, None, received * min(top_k, ep.num_local))
    else:
        dispatch = Dispatch(mine_RK, ep.size * cap, None)
    extras = {name: v for name, v in (("b_gate_up", b_gate_up_local),
                                      ("b_down", b_down_local), ("act", act)) if v is not None}
    partial_RH = experts(x_RH, local_RK, w_RK, w_gate_up_local, w_down_local, dispatch,
                         **extras)
    if torch.is_grad_enabled() and x_RH.requires_grad and not partial_RH.requires_grad:
        partial_RH = _Connect.apply(partial_RH, x_RH, w_RK)
    return _ReturnPartials.apply(partial_RH, ep), dropped
