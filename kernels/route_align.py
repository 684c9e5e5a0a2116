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

How it is built. On CUDA (`impl="auto"`, or `impl="triton"` anywhere: under
TRITON_INTERPRET=1 on the CPU) a counting sort in four launches, every grid a function of N, E
and BM only, no atomics, so the layout is bit for bit the one of a stable sort by expert:
1. `_chunk_counts_kernel`, one program per chunk of BN consecutive routes: the chunk's
   per-expert histogram `chunk_counts [C, E]` (C = cdiv(N, BN)), from a one-hot reduction.
2. `_chunk_bases_kernel`, one program per group of experts: a column-wise exclusive scan over
   the chunks, in place (`chunk_counts` then holds each chunk's first rank per expert), and
   the totals `expert_counts`.
3. `_slot_blocks_kernel`, one program per BB slot blocks: every program rebuilds the segment
   table from `expert_counts` (E values) and writes its blocks' `block_expert` and the
   sentinels of their padding slots; program 0 writes `expert_starts`, `num_padded` and
   `num_dropped`.
4. `_place_routes_kernel`, one program per chunk: route r of expert e gets slot
   expert_starts[e] + chunk base + the number of earlier routes of e in its chunk (a pairwise
   count over the chunk), written to `token_slots`, `slot_token` and `slot_route`. It writes
   exactly the real slots, step 3 exactly the padding slots, so no slot is written twice.
A route whose id lies outside [0, E) counts as dropped. A kept route past the static S (a
`max_kept` that does not bound the kept routes: a broken contract) gets no slot write.
`build_route_list_ref` is the reference: torch's stable sort, searchsorted and scatters; the
CPU path (`impl="auto"` on the CPU, or `impl="reference"`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fp_fusion import FUSED

IMPLS = ("auto", "triton", "reference")


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
                     capacity: int | None = None, max_kept: int | None = None, *,
                     impl: str = "auto") -> RouteList:
    """Build the RouteList for `topk_ids_TK` [T, k] (ids in [0, E) where kept); sync-free,
    deterministic.

    Capacity mode takes the kept-route mask (moe/routing.capacity_keep_TK decides which routes
    survive) together with the capacity C that sizes the segments; C must bound every
    expert's kept count. Dropless mode may take a mask too; `max_kept` must then bound the
    number of kept routes. `impl`: auto (the counting-sort kernels on CUDA, the torch
    reference elsewhere) | triton | reference; both give the same RouteList bit for bit.
    """
    if capacity is not None and keep_TK is None:
        raise ValueError("build_route_list: capacity mode needs the kept-route mask keep_TK")
    if impl not in IMPLS:
        raise ValueError(f"build_route_list: impl must be one of {', '.join(IMPLS)}, "
                         f"got {impl!r}")
    if impl == "triton" or (impl == "auto" and topk_ids_TK.device.type == "cuda"):
        return _build_route_list_triton(topk_ids_TK, num_experts, block_m, keep_TK, capacity,
                                        max_kept)
    return build_route_list_ref(topk_ids_TK, num_experts, block_m, keep_TK, capacity, max_kept)


def build_route_list_ref(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int,
                         keep_TK: torch.Tensor | None = None,
                         capacity: int | None = None, max_kept: int | None = None) -> RouteList:
    """`build_route_list` in torch: a stable sort by expert, searchsorted and scatters."""
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


# -- the counting sort (CUDA; the CPU runs it only under TRITON_INTERPRET=1) ----------------

@triton.jit
def _route_keys(ids_ptr, keep_ptr, offs, num_routes, num_experts, HAS_KEEP: tl.constexpr):
    """Sort key of routes `offs`: the expert id, or E for a dropped (or out-of-range) route
    and for lanes past N."""
    ok = offs < num_routes
    e = tl.load(ids_ptr + offs, mask=ok, other=num_experts).to(tl.int32)
    if HAS_KEEP:
        kept = tl.load(keep_ptr + offs, mask=ok, other=0) != 0
        e = tl.where(kept, e, num_experts)
    return tl.where((e >= 0) & (e < num_experts), e, num_experts)


@triton.jit
def _chunk_counts_kernel(ids_ptr, keep_ptr, chunk_counts_ptr, num_routes, num_experts,
                         HAS_KEEP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    key = _route_keys(ids_ptr, keep_ptr, offs, num_routes, num_experts, HAS_KEEP)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.sum((key[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + chunk * num_experts + experts, counts,
             mask=experts < num_experts)


@triton.jit
def _chunk_bases_kernel(chunk_counts_ptr, expert_counts_ptr, num_chunks, num_experts,
                        BLOCK_C: tl.constexpr, BLOCK_EG: tl.constexpr):
    experts = tl.program_id(0) * BLOCK_EG + tl.arange(0, BLOCK_EG)
    e_ok = experts < num_experts
    carry = tl.zeros((BLOCK_EG,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        ptrs = chunk_counts_ptr + chunks[:, None] * num_experts + experts[None, :]
        ok = (chunks < num_chunks)[:, None] & e_ok[None, :]
        counts = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + carry[None, :], mask=ok)
        carry += tl.sum(counts, axis=0)
    tl.store(expert_counts_ptr + experts, carry, mask=e_ok)


@triton.jit
def _segments(expert_counts_ptr, num_experts, block_m, seg_capacity,
              CAPACITY: tl.constexpr, BLOCK_E: tl.constexpr):
    """(experts, counts, padded counts, segment starts, segment ends), each [BLOCK_E]; lanes
    past E hold zero counts and start at the end of the last segment."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(expert_counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + block_m - 1) // block_m * block_m
    if CAPACITY:
        starts = tl.minimum(experts, num_experts) * seg_capacity
        ends = starts + tl.where(experts < num_experts, seg_capacity, 0)
    else:
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
    return experts, counts, padded, starts, ends


@triton.jit
def _slot_blocks_kernel(expert_counts_ptr, expert_starts_ptr, block_expert_ptr,
                        slot_token_ptr, slot_route_ptr, num_padded_ptr, num_dropped_ptr,
                        num_blocks, num_experts, num_tokens, num_routes, block_m, seg_capacity,
                        CAPACITY: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_E: tl.constexpr):
    experts, counts, padded, starts, ends = _segments(
        expert_counts_ptr, num_experts, block_m, seg_capacity, CAPACITY, BLOCK_E)
    e_ok = experts < num_experts
    if tl.program_id(0) == 0:
        tl.store(expert_starts_ptr + experts, starts, mask=e_ok)
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        tl.store(num_dropped_ptr, num_routes - tl.sum(counts, axis=0))
    blocks = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    block_start = blocks * block_m
    # The block's expert: the first whose segment ends after the block's first slot (E if
    # none); it is live if it starts before that expert's padded kept extent.
    owner = tl.sum(((ends[None, :] <= block_start[:, None]) & e_ok[None, :]).to(tl.int32),
                   axis=1)
    mine = experts[None, :] == owner[:, None]
    start_b = tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
    count_b = tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
    padded_b = tl.sum(tl.where(mine, padded[None, :], 0), axis=1)
    live = (owner < num_experts) & (block_start < start_b + padded_b)
    b_ok = blocks < num_blocks
    tl.store(block_expert_ptr + blocks, tl.where(live, owner, -1), mask=b_ok)
    # Padding slots: every slot of the block that is not one of its expert's real slots.
    lanes = tl.arange(0, BLOCK_M)
    slots = block_start[:, None] + lanes[None, :]
    real = live[:, None] & (slots - start_b[:, None] < count_b[:, None])
    pad = (~real) & b_ok[:, None] & (lanes < block_m)[None, :]
    tl.store(slot_token_ptr + slots, tl.full((BLOCK_B, BLOCK_M), 0, tl.int32) + num_tokens,
             mask=pad)
    tl.store(slot_route_ptr + slots, tl.full((BLOCK_B, BLOCK_M), 0, tl.int32) + num_routes,
             mask=pad)


@triton.jit
def _place_routes_kernel(ids_ptr, keep_ptr, chunk_bases_ptr, expert_starts_ptr,
                         slot_token_ptr, slot_route_ptr, token_slots_ptr,
                         num_routes, num_experts, num_slots, top_k,
                         HAS_KEEP: tl.constexpr, BLOCK_N: tl.constexpr):
    chunk = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_N)
    offs = chunk * BLOCK_N + lanes
    key = _route_keys(ids_ptr, keep_ptr, offs, num_routes, num_experts, HAS_KEEP)
    kept = key < num_experts
    # Rank in the chunk: the earlier routes of the same expert (stable, no scan needed).
    earlier = (key[None, :] == key[:, None]) & (lanes[None, :] < lanes[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(chunk_bases_ptr + chunk * num_experts + key, mask=kept, other=0)
    start = tl.load(expert_starts_ptr + key, mask=kept, other=0)
    slot = start + base + rank
    tl.store(token_slots_ptr + offs, tl.where(kept, slot, -1), mask=offs < num_routes)
    placed = kept & (slot < num_slots)
    tl.store(slot_token_ptr + slot, offs // top_k, mask=placed)
    tl.store(slot_route_ptr + slot, offs, mask=placed)


def _tiles(num_experts: int, dev: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_E, BLOCK_N, BLOCK_B, warps) of the build's kernels."""
    block_e = max(16, triton.next_power_of_2(num_experts))
    if dev.type == "cuda":  # the one-hot count tile is BLOCK_N x BLOCK_E: 16K lanes at most
        return block_e, max(16, min(128, 16384 // block_e)), 16, 4
    return block_e, 16, 4, 1  # the interpreter: small chunks, so tests cross chunk bounds


def _count(ids_N, keep_N, has_keep: bool, num_experts: int):
    """Steps 1 and 2: (chunk_counts [C, E] scanned to each chunk's first rank, the totals
    expert_counts [E]), int32."""
    block_e, block_n, _, warps = _tiles(num_experts, ids_N.device)
    num_routes = ids_N.numel()
    num_chunks = max(1, triton.cdiv(num_routes, block_n))
    # The scan over chunks: on CUDA as few serial steps as a 16K-lane tile allows (its time
    # is the latency of each step's load, scan and store).
    block_c, block_eg = (4, 8) if ids_N.device.type != "cuda" else \
        (min(1024, max(128, triton.next_power_of_2(num_chunks))), 16)
    scan_warps = 8 if block_c >= 512 else warps
    chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32,
                               device=ids_N.device)
    expert_counts = torch.empty(num_experts, dtype=torch.int32, device=ids_N.device)
    _chunk_counts_kernel[(num_chunks,)](
        ids_N, keep_N, chunk_counts, num_routes, num_experts,
        HAS_KEEP=has_keep, BLOCK_N=block_n, BLOCK_E=block_e, num_warps=warps,
        enable_fp_fusion=FUSED)
    _chunk_bases_kernel[(triton.cdiv(num_experts, block_eg),)](
        chunk_counts, expert_counts, num_chunks, num_experts,
        BLOCK_C=block_c, BLOCK_EG=block_eg, num_warps=scan_warps, enable_fp_fusion=FUSED)
    return chunk_counts, expert_counts


def count_routes(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert [E] int32 by the build's steps 1 and 2: per-chunk one-hot sums, then
    a fixed-order sum over the chunks; no atomics, no sync. An id outside [0, E) is not
    counted. Any device where Triton runs (the interpreter on the CPU)."""
    ids_N = topk_ids_TK.reshape(-1).contiguous()
    return _count(ids_N, ids_N, False, num_experts)[1]


def _build_route_list_triton(topk_ids_TK, num_experts, block_m, keep_TK, capacity, max_kept):
    num_tokens, top_k = topk_ids_TK.shape
    num_routes = num_tokens * top_k
    dev = topk_ids_TK.device
    bound = num_routes if capacity is not None or max_kept is None else min(max_kept, num_routes)
    S = num_slots(bound, num_experts, block_m, capacity)
    num_blocks = S // block_m
    seg_capacity = 0 if capacity is None else -(-capacity // block_m) * block_m

    block_e, block_n, block_b, warps = _tiles(num_experts, dev)
    ids_N = topk_ids_TK.reshape(-1).contiguous()  # a [T, 1] slice may view with stride E
    keep_N = ids_N if keep_TK is None else keep_TK.reshape(-1).contiguous()  # unused if None
    chunk_counts, expert_counts = _count(ids_N, keep_N, keep_TK is not None, num_experts)
    num_chunks = chunk_counts.shape[0]
    i32 = dict(dtype=torch.int32, device=dev)
    expert_starts = torch.empty(num_experts, **i32)
    slot_token = torch.empty(S, **i32)
    slot_route = torch.empty(S, **i32)
    block_expert = torch.empty(num_blocks, **i32)
    token_slots = torch.empty(num_routes, **i32)
    num_padded = torch.empty(1, **i32)
    num_dropped = torch.empty(1, **i32)

    has_keep = keep_TK is not None
    _slot_blocks_kernel[(max(1, triton.cdiv(num_blocks, block_b)),)](
        expert_counts, expert_starts, block_expert, slot_token, slot_route, num_padded,
        num_dropped, num_blocks, num_experts, num_tokens, num_routes, block_m, seg_capacity,
        CAPACITY=capacity is not None, BLOCK_B=block_b,
        BLOCK_M=triton.next_power_of_2(block_m), BLOCK_E=block_e, num_warps=warps,
        enable_fp_fusion=FUSED)
    _place_routes_kernel[(num_chunks,)](
        ids_N, keep_N, chunk_counts, expert_starts, slot_token, slot_route, token_slots,
        num_routes, num_experts, S, top_k,
        HAS_KEEP=has_keep, BLOCK_N=block_n, num_warps=warps, enable_fp_fusion=FUSED)

    return RouteList(
        slot_token=slot_token,
        slot_route=slot_route,
        block_expert=block_expert,
        num_padded=num_padded,
        token_slots=token_slots.view(num_tokens, top_k),
        expert_counts=expert_counts,
        expert_starts=expert_starts,
        num_dropped=num_dropped,
        block_m=block_m,
    )
