"""Expert parallelism: each rank of an EP group owns a contiguous range of experts; tokens go to
the ranks that own their experts and the results come back. Static shapes, no host sync, so
the whole exchange sits inside a captured moe graph.

Notation: P ranks in the EP group, this rank q owns global experts [q*E_l, (q+1)*E_l),
T tokens per rank, k routes per token. Two exchanges, picked per call from static shapes by
moe/ep_sizing.dispatch_kind (`moe.ep_dispatch`: auto | all_gather | all_to_all):

all_gather, the worst case (exact for any routing; P*T received rows, so memory grows with P):
an all-gather over the EP group of x [T, H], the top-k weights [T, k] and ids [T, k]: rank q
receives R = P*T rows, block s from EP rank s, and keeps the routes whose expert it owns. The
permute-free kernels read the received rows in place through the RouteList (no permuted
copy). Combine: each rank's partial output [R, H] (per received token, the fp32 sum of its
local routes in j order, rounded once) goes back with an equal-split all_to_all_single; the
source sums the P partials in fp32 in rank order and rounds once. Deterministic, no atomics.
Backward, the exact transpose: the gradient of the all-gather is an all_to_all of the gradient
blocks back to their sources, summed in fp32 in rank order; that of the combine an all-gather
of dOut.

all_to_all, bounded (`moe.ep_capacity_factor` f): a token is sent ONCE to each rank that owns
one of its experts (not once per route), in an equal-split all_to_all_single with a fixed
C = ceil(f * T * d / P) rows per (source, destination) pair, d the expected number of distinct
ranks of a token under balanced routing (ep_sizing: P * (1 - C(E - E_l, k) / C(E, k)), exact
for distinct top-k experts). A rank receives R = P*C ~ f * T * d rows: flat in P.
- Send layout [P*C, ...]: block d for destination d holds, in token order, the tokens with a
  route to d (`peer_rows`; a padding row after the last is zero, token index T). With the
  rows go their routes to d's experts: local ids [P*C, k] (-1: another rank's expert, a
  route dropped at the source, a padding row) and the top-k weights [P*C, k]. The receiver's
  block s comes from source s; the experts read the received rows in place with the received
  ids and weights (no permuted copy).
- Combine: each destination sends back its per-row partial sums [P*C, H] (the fp32 sum of
  its local routes in j order, rounded once); the source sums a token's partials over the
  destinations in rank order in fp32 (zero where it sent the token nowhere) and rounds once:
  the additions of the all-gather's combine, so both exchanges give the same bits wherever
  the experts compute the same rows (tests/moe/test_ep_dispatch.py checks it, both backends).
- Backward, the exact transpose (_SendRows, _ReturnRows): a received row's gradient goes back
  to its source, which sums it over destinations like the combine; the combine's backward
  packs dOut like the forward packed x.
- Overflow: routing that needs more than C rows to some destination sends the first C (in
  token order) and truncates the rest: static shapes, so nothing waits or deadlocks, graphed
  or not. The rows that did not fit, sum over destinations of max(0, n_d - C), are added on
  the device to `overflow_rows` (no sync), and such a step's result is never applied:
  distributed/overflow.py agrees the count over the world after the backward (one small
  all-reduce), discards the gradients and redoes the step eagerly through the all-gather
  (`worst_case_dispatch()`; installed graphs are suspended, not re-captured), so losses and
  gradients stay dropless. A redo costs one more eager forward and backward: on CPU (gloo,
  2 ranks, tiny-qwen3-moe at 2 x 32 tokens a rank, fp32; benchmarks/ep_capacity.py) a step
  that overflowed took 5281 ms against 2515 ms without (2.1x: the second pass, 2499 ms,
  plus one all-reduce and one host read). An overflowed step's peak memory is the
  all-gather's (P*T rows): the bound saves memory on the steps that fit.
- Default f = 2.0 (`moe.ep_capacity_factor`, at least 1), from the per-pair loads in
  benchmarks/results/ep_capacity.json (rows a pair needs over T * d / P, max over pairs,
  layers and batches, T = 4096): balanced routing needs 1.01-1.10 (E = 8) and up to 1.19
  (E = 128, P = 64) from sampling noise alone; tiny-qwen3-moe's router (E = 8, k = 2) after
  20 training steps needs 1.24 / 1.77 / 3.25 at P = 2 / 4 / 8 and overflows on 0 / 0 / 50% of
  its 8 calls at f = 2.0 (at 1.25: 0 / 88 / 100%, at 1.5: 0 / 50 / 88%); zipf-skewed routers
  need 1.5 to 8. 2.0 keeps redos (2.1x a step) rare up to the imbalance measured at P = 4,
  with a margin over balanced noise, while a rank still receives about 2 * T * d <= 2 * T * k
  rows whatever P; a better-balanced router may lower it (1.25 covered balanced routing at
  T >= 1024 up to P = 16).
- `auto` keeps the all-gather where C >= T (P small against k: it moves no more bytes and
  needs no packed send copy; ep_sizing.dispatch_kind).

Capacity mode (both exchanges): the source keeps at most C_e = ceil(T*k*F/E) routes per expert
over its own T tokens (moe/routing.capacity_keep_TK), marks the dropped ones with id E (owned
by no rank: they never travel) and counts them. A receiver then holds at most P*C_e routes per
local expert: segments of round_up(P*C_e, BM) slots, every shape static.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .ep_sizing import dispatch_kind, peer_capacity
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


# True while a step is redone after an overflow: every call takes the all-gather. A module
# global, not thread-local: a recomputed scope re-runs its forward in autograd's thread.
_WORST_CASE = False


@contextlib.contextmanager
def worst_case_dispatch():
    """Every ep_moe call inside takes the all-gather, whatever it was asked (an eager redo)."""
    global _WORST_CASE
    before, _WORST_CASE = _WORST_CASE, True
    try:
        yield
    finally:
        _WORST_CASE = before


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


# -- the bounded all-to-all ----------------------------------------------------------------
class PeerRows(NamedTuple):
    """Where this rank's T tokens go in an all-to-all of C rows per peer (device tensors)."""

    send_token_R: torch.Tensor  # [P*C] int64: the token of each sent row, T for padding
    slot_TP: torch.Tensor  # [T, P] int64: row d*C + position of (t, d), clamped to block d
    sent_TP: torch.Tensor  # [T, P] bool: t has a route to rank d and fit in its C rows
    over: torch.Tensor  # [1] int64: rows that needed a peer and did not fit
    capacity: int  # C


def peer_rows(topk_ids_TK: torch.Tensor, ep: EpGroup, capacity: int) -> PeerRows:
    """The send layout, sync-free: a token needs rank d when one of its ids is d's expert
    (id E, dropped at the source, needs none); the tokens needing d fill d's block in token
    order, and those past C are not sent."""
    num_tokens, dev = topk_ids_TK.shape[0], topk_ids_TK.device
    dest_TK = topk_ids_TK // ep.num_local  # id E -> P: no rank
    needs_TP = torch.zeros(num_tokens, ep.size + 1, dtype=torch.bool, device=dev)
    needs_TP = needs_TP.scatter_(1, dest_TK, True)[:, :ep.size]
    count_TP = needs_TP.long().cumsum(0)  # tokens needing d up to and with t
    pos_TP = count_TP - 1
    sent_TP = needs_TP & (pos_TP < capacity)
    over = (needs_TP.sum(0) - capacity).clamp(min=0).sum().reshape(1)
    start_P = torch.arange(ep.size, device=dev) * capacity
    slot_TP = start_P + pos_TP.clamp(0, capacity - 1)
    # Row c of block d is the (c+1)-th token needing d: the first t whose count reaches c+1
    # (T where fewer need d: a padding row).
    wanted_PC = torch.arange(1, capacity + 1, device=dev).expand(ep.size, capacity)
    send_token_R = torch.searchsorted(count_TP.t().contiguous(), wanted_PC.contiguous())
    return PeerRows(send_token_R.reshape(-1), slot_TP, sent_TP, over, capacity)


def _pack(rows_TX: torch.Tensor, pr: PeerRows, fill=0) -> torch.Tensor:
    """[P*C, ...]: this rank's rows in send order, padding rows set to `fill`."""
    num_tokens = rows_TX.shape[0]
    packed = rows_TX.index_select(0, pr.send_token_R.clamp(max=max(num_tokens - 1, 0)))
    pad = (pr.send_token_R == num_tokens).view(-1, *[1] * (rows_TX.dim() - 1))
    return packed.masked_fill_(pad, fill)


def _exchange(send: torch.Tensor, ep: EpGroup) -> torch.Tensor:
    """Equal-split all_to_all_single: block d of `send` to EP rank d, block s of the result
    from EP rank s."""
    send = send.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    return recv


def _unpack_sum(blocks: torch.Tensor, pr: PeerRows, num_tokens: int) -> torch.Tensor:
    """[T, ...] from blocks [P*C, ...] in destination order: each token's rows summed over
    the destinations in rank order in fp32 (zero where it was not sent), rounded once."""
    acc = None
    for d in range(pr.sent_TP.shape[1]):
        part = blocks.index_select(0, pr.slot_TP[:, d]).float()
        mask = pr.sent_TP[:, d].view(-1, *[1] * (blocks.dim() - 1))
        part = torch.where(mask, part, 0.0)
        acc = part if acc is None else acc + part
    return acc.to(blocks.dtype)


class _SendRows(torch.autograd.Function):
    """Forward: pack rows by destination, all_to_all. Backward: the received rows' gradients
    all_to_all back and summed at the source over destinations (fp32, rank order)."""

    @staticmethod
    def forward(ctx, rows, pr, ep):
        ctx.pr, ctx.ep, ctx.num_tokens = pr, ep, rows.shape[0]
        return _exchange(_pack(rows, pr), ep)

    @staticmethod
    def backward(ctx, grad):
        return _unpack_sum(_exchange(grad, ctx.ep), ctx.pr, ctx.num_tokens), None, None


class _ReturnRows(torch.autograd.Function):
    """Forward: the received rows' partial outputs all_to_all back, summed at the source over
    destinations (fp32, rank order). Backward: dOut packed like the forward's rows, all_to_all."""

    @staticmethod
    def forward(ctx, partial, pr, ep, num_tokens):
        ctx.pr, ctx.ep = pr, ep
        return _unpack_sum(_exchange(partial, ep), pr, num_tokens)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(_pack(grad, ctx.pr), ctx.ep), None, None, None


def _send_local_ids(sent_ids_TK: torch.Tensor, pr: PeerRows, ep: EpGroup) -> torch.Tensor:
    """Received local expert ids [P*C, k]: a sent row's routes to its destination's experts,
    -1 for any other route and for padding rows."""
    rows = _pack(sent_ids_TK, pr, fill=ep.num_experts)
    dest = torch.arange(rows.shape[0], device=rows.device) // pr.capacity
    lo = (dest * ep.num_local)[:, None]
    mine = (rows >= lo) & (rows < lo + ep.num_local)
    return _exchange(torch.where(mine, rows - lo, -1), ep)


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
           act=None, dispatch: str = "all_gather", ep_capacity_factor: float | None = None,
           overflow_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y_TH, dropped [1] int64) for this rank's tokens. `experts(x, ids, weights, w_gate_up,
    w_down, dispatch)` computes the local experts (reference_experts or permute_free_experts);
    the expert weights are this rank's slice [E_l, ...], and so are the optional biases, which
    are passed on (with `act`, an ExpertAct) as the experts' keyword arguments when given.
    Each route is computed on exactly one rank, so its p * b_down term is counted once.
    `dispatch` (auto | all_gather | all_to_all, with `ep_capacity_factor`) picks the exchange;
    the all-to-all adds its rows over the bound to `overflow_rows` ([1] int64, required: an
    overflowed step's result is wrong and must be redone, see the module docstring)."""
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

    if dispatch != "all_gather" and ep_capacity_factor is None:
        raise ValueError(f"EP dispatch {dispatch!r} needs ep_capacity_factor")
    kind = "all_gather" if _WORST_CASE or dispatch == "all_gather" else dispatch_kind(
        ep.size, num_tokens, top_k, ep.num_experts, ep_capacity_factor, dispatch)
    if kind == "all_gather":
        ids_RK = _all_gather(sent_ids, ep)
        x_RH = _GatherTokens.apply(x_TH, ep)
        w_RK = _GatherTokens.apply(topk_weights_TK, ep)
        lo, hi = ep.expert_range
        mine_RK = (ids_RK >= lo) & (ids_RK < hi)
        local_RK = torch.where(mine_RK, ids_RK - lo, 0)
    else:
        if overflow_rows is None:
            raise ValueError("the bounded all-to-all dispatch needs an overflow_rows buffer: "
                             "a step that overflows must be redone")
        pr = peer_rows(sent_ids, ep, peer_capacity(num_tokens, top_k, ep.size, ep.num_experts,
                                                   ep_capacity_factor))
        overflow_rows.add_(pr.over)
        recv_ids_RK = _send_local_ids(sent_ids, pr, ep)
        x_RH = _SendRows.apply(x_TH, pr, ep)
        w_RK = _SendRows.apply(topk_weights_TK, pr, ep)
        mine_RK = recv_ids_RK >= 0
        local_RK = recv_ids_RK.clamp(min=0)
    received = x_RH.shape[0]
    if cap is None:
        kept = Dispatch(mine_RK, None, received * min(top_k, ep.num_local))
    else:
        kept = Dispatch(mine_RK, ep.size * cap, None)
    extras = {name: v for name, v in (("b_gate_up", b_gate_up_local),
                                      ("b_down", b_down_local), ("act", act)) if v is not None}
    partial_RH = experts(x_RH, local_RK, w_RK, w_gate_up_local, w_down_local, kept, **extras)
    if torch.is_grad_enabled() and x_RH.requires_grad and not partial_RH.requires_grad:
        partial_RH = _Connect.apply(partial_RH, x_RH, w_RK)
    if kind == "all_gather":
        return _ReturnPartials.apply(partial_RH, ep), dropped
    return _ReturnRows.apply(partial_RH, pr, ep, num_tokens), dropped
