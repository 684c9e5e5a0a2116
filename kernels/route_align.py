"""RouteList: the slot layout every expert kernel reads, built on the device without a sync.

Notation: T tokens, k routes per token, N = T*k routes (flat route r = t*k + j), E experts,
BM = `block_m` slot block size (the M tile of the slot GEMMs, or a multiple of it).

Layout contract (all int32, all on the routes' device, every shape static):
- Slots are grouped into per-expert *segments*, laid out in expert order. Within a segment the
  kept routes come first, in ascending route order (stable, so deterministic); the segment is
  then padded with sentinel slots up to a multiple of BM, so a BM-block of slots never mixes
  two experts and a GEMM program can load one expert's weights for its whole tile.
- dropless (keep_TK is None): S = (cdiv(N, BM) + E) * BM slots, the worst case of N routes
  plus at most BM - 1 padding slots per expert. Segments are packed: segment e starts where
  segment e - 1 ends. The real extent `num_padded` is a device scalar; slots past it are unused.
- capacity (keep_TK given, `capacity` = C): S = E * round_up(C, BM) exactly; segment e starts
  at e * round_up(C, BM). Routes with keep_TK False are dropped: they own no slot.
- dropless with a mask (keep_TK given, capacity None): segments packed as in dropless, only
  the kept routes own slots. `max_kept` bounds the kept routes (default N) and sizes
  S = (cdiv(max_kept, BM) + E) * BM. Expert parallelism uses it: a rank computes only the
  routes of the tokens it received whose expert it owns.
- `slot_token [S]`: token of the route in the slot, sentinel T for a padding slot.
- `slot_route [S]`: flat route id t*k + j, sentinel N.
- `block_expert [S // BM]`: expert owning the block, -1 when the block holds no kept route
  (every block past `num_padded`, and in capacity mode an under-full segment's empty tail).
  Programs of a -1 block exit at once and write nothing.
- `num_padded [1]`: number of slots in live blocks (the sum of the padded segment sizes).
- `token_slots [T, k]`: inverse map, the slot of route (t, j), -1 if the route was dropped.
- `expert_counts [E]`: kept routes per expert; `expert_starts [E]`: first slot of each segment.
  Real slots of expert e are exactly expert_starts[e] + [0, expert_counts[e]).
- `num_dropped [1]`: dropped routes (0 in dropless mode).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RouteList(NamedTuple):
    slot_token: torch.Tensor
    slot_route: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    token_slots: torch.Tensor
    expert_counts: torch.Tensor
    expert_starts: torch.Tensor
    num_dropped: torch.Tensor
    block_m: int

    @property
    def num_slots(self) -> int:
        return self.slot_token.shape[0]


def num_slots(num_routes: int, num_experts: int, block_m: int, capacity: int | None = None) -> int:
    """Static slot count S for a dispatch mode (see the module docstring); `num_routes` is the
    bound on kept routes in dropless mode."""
    if capacity is None:
        return (-(-num_routes // block_m) + num_experts) * block_m
    return num_experts * (-(-capacity // block_m) * block_m)


def build_route_list(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int,
                     keep_TK: torch.Tensor | None = None,
                     capacity: int | None = None, max_kept: int | None = None) -> RouteList:
    """Build the RouteList for `topk_ids_TK` [T, k] (ids in [0, E) where kept); sync-free,
    deterministic.

    Capacity mode takes the kept-route mask (moe/routing.capacity_keep_TK decides which routes
    survive) together with the capacity C that sizes the segments; C must bound every
    expert's kept count. Dropless mode may take a mask too; `max_kept` must then bound the
    number of kept routes.
    """
    if capacity is not None and keep_TK is None:
        raise ValueError("build_route_list: capacity mode needs the kept-route mask keep_TK")
    num_tokens, top_k = topk_ids_TK.shape
    num_routes = num_tokens * top_k
    dev = topk_ids_TK.device
    bound = num_routes if capacity is not None or max_kept is None else min(max_kept, num_routes)
    S = num_slots(bound, num_experts, block_m, capacity)

    ids_N = topk_ids_TK.reshape(-1).long()
    # Dropped routes get key E so the stable sort puts them after every expert's routes.
    key_N = ids_N if keep_TK is None else torch.where(keep_TK.reshape(-1), ids_N, num_experts)
    sorted_key, order_N = torch.sort(key_N, stable=True)
    bounds = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=dev))
    counts_E = bounds[1:] - bounds[:-1]
    padded_E = (counts_E + block_m - 1) // block_m * block_m
    if capacity is None:
        seg_size_E = padded_E
        seg_end_E = torch.cumsum(seg_size_E, 0)
        seg_start_E = seg_end_E - seg_size_E
    else:
        seg = -(-capacity // block_m) * block_m
        seg_start_E = torch.arange(num_experts, device=dev) * seg
        seg_end_E = seg_start_E + seg

    # Slot of the route at sorted position i: its segment start plus its rank in the expert.
    kept = sorted_key < num_experts
    e_sorted = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(num_routes, device=dev) - bounds[e_sorted]
    slot_sorted = torch.where(kept, seg_start_E[e_sorted] + rank, S)  # S: a discard slot

    slot_token = torch.full((S + 1,), num_tokens, dtype=torch.int32, device=dev)
    slot_token.scatter_(0, slot_sorted, (order_N // top_k).to(torch.int32))
    slot_route = torch.full((S + 1,), num_routes, dtype=torch.int32, device=dev)
    slot_route.scatter_(0, slot_sorted, order_N.to(torch.int32))
    token_slots = torch.empty(num_routes, dtype=torch.int32, device=dev)
    token_slots.scatter_(0, order_N, torch.where(kept, slot_sorted, -1).to(torch.int32))

    # Block b belongs to the first expert whose segment ends after its first slot; it is live
    # if it starts before that expert's padded kept extent.
    block_start = torch.arange(S // block_m, device=dev) * block_m
    e_block = torch.searchsorted(seg_end_E, block_start, right=True)
    e_clamped = e_block.clamp(max=num_experts - 1)
    live = (e_block < num_experts) & (block_start < seg_start_E[e_clamped] + padded_E[e_clamped])
    block_expert = torch.where(live, e_block, -1).to(torch.int32)

    return RouteList(
        slot_token=slot_token[:S],
        slot_route=slot_route[:S],
        block_expert=block_expert,
        num_padded=padded_E.sum().reshape(1).to(torch.int32),
        token_slots=token_slots.view(num_tokens, top_k),
        expert_counts=counts_E.to(torch.int32),
        expert_starts=seg_start_E.to(torch.int32),
        num_dropped=(num_routes - bounds[num_experts:]).to(torch.int32),
        block_m=block_m,
    )
