"""Memory of ONE rank of a distributed run (dist/): what `moegraph plan --nproc W --ep P`
predicts. Nothing here allocates; memory.step_model uses it when W > 1 (W = P = 1 is the
single process, modelled without this file).

The run (dist/model.py, moe/ep.py, graphs/params.py), per rank, T = batch * seq_len tokens of
its own (run.batch is per rank), b bytes per element of the run dtype:
- Experts: E_l = E / P of every MoE layer's experts, plain tensors: weights, `.grad` and the
  two AdamW states, 4 copies in b (as summary.static_memory counts a single process).
- Dense parameters (embedding, lm head, attention, norms, router, dense MLP layers): FSDP2
  `fully_shard` on dim 0 over all W ranks, by torch.chunk rules: rank 0 holds ceil(rows / W)
  rows of every tensor, the most, so the plan is for rank 0. Sharded weight, grad and AdamW
  states in b. One FSDP unit per decoder layer (its experts ignored); with an untied head one
  for the embedding and one for the final norm with the lm head, the root holding nothing;
  with a tied head the root holds the embedding and the final norm.
- FSDP2 working set (eager part of the step, graphs or not: collectives stay outside graphs):
  a layer's unsharded parameters (b * U_i) live from its forward all-gather to the end of its
  forward (reshard after forward), and again in its backward; the all-gather lands in a flat
  buffer (b * G_i, G_i = W * shard_i with the per-tensor padding) and is copied out, and the
  next unit is gathered while one runs (backward prefetch; in forward the next all-gather's
  stream cannot reuse the blocks the default stream just freed), so a layer costs
  b * (U_i + U_next + G) in forward and b * (U_i + U_prev + G) in backward. Its backward
  leaves unsharded grads (b * U_i) that post-backward copies into an fp32 reduce-scatter
  input (4 * G_i, MixedPrecisionPolicy(reduce_dtype=float32)) with an fp32 output shard
  (4 * shard_i). Untied: the embedding unit is resharded after its forward and gathered again
  during layer 0's backward (prefetch) for the embedding backward, then reduce-scattered; the
  head unit is gathered before the final norm and kept into its backward (the backward's
  first), then reduce-scattered, its grads freed and its weights resharded before layer
  n - 1's backward. Tied: the root is not resharded after forward: its unsharded parameters
  live for the whole step, the head's grad from the lm-head backward to the root's
  reduce-scatter, which runs last with all its grads and an fp32 buffer of the same numel.
- MoE with P > 1 (moe/ep.py): the scope all-gathers x [T, H], the top-k weights and ids over
  P ranks (R = P*T received rows) and runs its E_l experts over them; see `moe_memory_ep`.
- Graphs: FSDP-sharded parameters are "moving" (graphs/params.py): the session keeps one set of
  static value buffers and one of gradient buffers per scope kind (attn: every attention
  parameter; moe: router and post norm; mlp: the whole dense MLP), unsharded, in b, outside
  the pools, for the run; each backward replay returns a clone of the grads (the layer's
  unsharded grads FSDP2 then reduce-scatters). Expert weights are read in place.
Pools, I/O buffers, fragmentation, runtime workspaces and headroom are simulation.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..distributed.layout import expert_shard_dim, experts_sharded
from ..models.common.shapes import param_shapes
from ..config import Profile
from ..report.summary import DTYPE_BYTES, layer_shapes
from .scope_memory import (ScopeMemory, dp_part_bytes, expert_slots, first_moe_layer,
                           fused_norms, loss_moments, param_bytes, rms_saved,
                           route_block, shared_expert_memory)

EXPERT_STACKS = ("moe.w_gate_up", "moe.w_down", "moe.b_gate_up", "moe.b_down")


@dataclass(frozen=True)
class Parallel:
    """W ranks (--nproc), P-way expert parallelism (--ep); (1, 1) is one process."""

    world: int = 1
    ep: int = 1

    @property
    def single(self) -> bool:
        return self.world == 1 and self.ep == 1


def shard_numel(shape, world: int) -> int:
    """Rank 0's share of a tensor sharded on dim 0 by torch.chunk (ceil(rows / W) rows); FSDP2
    pads every rank's shard to this size."""
    if not shape:
        return 1
    return -(-shape[0] // world) * math.prod(shape[1:])


@dataclass
class FsdpUnit:
    name: str
    numel: int  # U: unsharded elements
    shard: int  # rank 0's (padded) shard elements
    world: int
    # elements sharded on dim 1 (expert stacks, distributed/layout.expert_shard_dim): FSDP2
    # copies their all-gather out through a temporary of their size, and their gradients into
    # dim-0 order through another, before the reduce-scatter
    rows: int = 0

    @property
    def gathered(self) -> int:
        """G: the all-gather's flat output (and the reduce-scatter's input), padded."""
        return self.world * self.shard


@dataclass
class FsdpLayout:
    """The FSDP2 units of one rank and the bytes the simulation charges for them."""

    b: int
    world: int
    dp: int  # expert replicas (W / P): each expert FSDP2-sharded over them when > 1
    root: FsdpUnit  # with an untied head it holds nothing
    layers: list[FsdpUnit]
    kind_dense: dict[str, int]  # per scope kind: its moving (FSDP-sharded) parameter elements
    head_grad: int  # bytes of the lm head's (or tied embedding's) unsharded grad
    expert_block: int  # elements of the largest local expert stack [E_l, 2F, H]
    embed: FsdpUnit | None = None  # untied head: the embedding's unit
    head: FsdpUnit | None = None  # untied head: the final norm's and lm head's unit
    # experts whole on each of their dp > 1 replicas (a torch without a per-parameter mesh):
    # the trainer all-reduces their grads after the backward, one fp32 copy at a time
    replicated_experts: bool = False
    # working sets and block sizes worked out once: the planner's search runs eager_dynamic
    # thousands of times on one layout (which nothing changes once built); not an init field,
    # so a dataclasses.replace copy with other units starts its own
    cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def units(self) -> tuple[FsdpUnit, ...]:
        return tuple(u for u in (self.root, self.embed, self.head) if u is not None) + \
            tuple(self.layers)

    # -- working sets -------------------------------------------------------------------
    def _neighbour(self, layer: int, step: int) -> FsdpUnit | None:
        """The unit gathered while `layer` runs: the next layer (forward prefetch, or the
        all-gather stream not reusing the blocks just freed), the previous one in backward
        (FSDP2's implicit prefetch), which for layer 0 is the embedding's unit."""
        j = layer + step
        if 0 <= j < len(self.layers):
            return self.layers[j]
        return self.embed if j < 0 else None

    def working_set(self, layer: int, step: int) -> int:
        """Unsharded params of `layer` and of the unit gathered next (forward: step +1,
        backward: step -1) and one all-gather buffer, in b."""
        return self.working_sets(step)[layer]

    def working_sets(self, step: int) -> list[int]:
        """`working_set(layer, step)` of every layer."""
        got = self.cache.get(("working_sets", step))
        if got is None:
            got = self.cache[("working_sets", step)] = [
                self._working_set(layer, step) for layer in range(len(self.layers))]
        return got

    def _working_set(self, layer: int, step: int) -> int:
        unit, nxt = self.layers[layer], self._neighbour(layer, step)
        numel = unit.numel + (nxt.numel if nxt else 0)
        return self.b * (numel + max(unit.gathered + unit.rows,
                                     nxt.gathered + nxt.rows if nxt else 0))

    def reduce_scatter(self, unit: FsdpUnit) -> int:
        """fp32 reduce-scatter input (padded, W shards) and its fp32 output shard, and the
        dim-0 copy of the gradients sharded on dim 1."""
        return 4 * unit.gathered + 4 * unit.shard + self.b * unit.rows

    def largest_block(self) -> int:
        """The largest single FSDP2 allocation: a flat fp32 reduce-scatter input."""
        if "largest_block" not in self.cache:
            self.cache["largest_block"] = max(4 * u.gathered for u in self.units())
        return self.cache["largest_block"]

    def side_streams(self) -> int:
        """Bytes FSDP2 allocates on its own streams, which the caching allocator keeps
        reserved for those streams once freed: the all-gather stream's flat output (the
        largest unit's, in b) and the reduce-scatter stream's fp32 output shard and its cast
        back to b. Measured on 2 H200s (qwen3-30b-a3b-4layer, ep 2): the eager step reserved
        21.03 GiB where the rest of this model predicted 18.03 GiB; these two account for
        2.9 GiB of the gap (the root's 1.24 GB gather, its 1.24 GB fp32 shard and 0.62 GB
        cast: the root then held the embedding and the lm head, now units of their own)."""
        if "side_streams" not in self.cache:
            units = self.units()
            self.cache["side_streams"] = self.b * max(u.gathered for u in units) + \
                (4 + self.b) * max(u.shard for u in units)
        return self.cache["side_streams"]

    # -- graphs: moving parameters --------------------------------------------------------
    def moving_buffers(self, scopes, captured, scope_bytes: dict[str, int]) -> int:
        """One value and one gradient buffer set per captured scope kind, attributed to the
        kind's first captured scope (so per-layer bytes still sum to pools + I/O)."""
        total = 0
        seen: set[str] = set()
        for ref, cap in zip(scopes, captured):
            if not cap or ref.kind in seen:
                continue
            seen.add(ref.kind)
            extra = 2 * self.b * self.kind_dense.get(ref.kind, 0)
            scope_bytes[ref.name] = scope_bytes.get(ref.name, 0) + extra
            total += extra
        return total

    # -- the eager part of the step -----------------------------------------------------
    def eager_dynamic(self, model, captured) -> tuple[int, str]:
        """simulation.StepModel._eager_dynamic with the FSDP2 working set; the moments of a
        captured scope are its all-gather (forward) and its gradient clone (backward)."""
        t, b, root, embed, head = model.tail, self.b, self.root, self.embed, self.head
        live = b * root.numel  # the root's unsharded parameters: gathered once, kept all step
        peak, where = live + b * root.gathered, "root all-gather"
        if embed is not None:  # the embedding's, from its all-gather to the end of its forward
            if live + b * (embed.numel + embed.gathered) > peak:
                peak, where = live + b * (embed.numel + embed.gathered), "embedding all-gather"
            live += b * embed.numel
        live += model.stream
        if live > peak:
            peak, where = live, "embedding"
        if embed is not None:
            live -= b * embed.numel  # resharded after its forward
        kept: list[int] = []
        prev_eager = True
        mems, ws_fwd, ws_bwd = model.memories(), self.working_sets(+1), self.working_sets(-1)
        for i, (ref, cap) in enumerate(zip(model.scopes, captured)):
            ws = ws_fwd[ref.layer]
            if cap:
                top, label = live + ws, f"forward of {ref.name} (FSDP all-gather)"
                kept.append(0)
                prev_eager = False
            else:
                m = mems[i]
                top, label = live + ws + m.saved + m.out + m.fwd_transient, \
                    f"forward of {ref.name}"
                keep = m.saved + (model.stream if m.saves_input and prev_eager else 0)
                live += keep
                kept.append(keep)
                prev_eager = True
            if top > peak:
                peak, where = top, label
        prefetch = 0
        if head is not None:  # gathered before the final norm, kept into its backward
            if live + b * (head.numel + head.gathered) > peak:
                peak, where = live + b * (head.numel + head.gathered), "head all-gather"
            live += b * head.numel
            # its pre-backward (the loss's gradient) prefetches the last layer's unit
            last = self.layers[-1] if self.layers else FsdpUnit("none", 0, 0, self.world)
            prefetch = b * (last.numel + last.gathered + last.rows)
        live, peak, where = loss_moments(t, live, peak, where, prefetch)
        live += self.head_grad  # unsharded until its unit's reduce-scatter
        if head is not None:  # the head's post-backward: all its grads, then freed, resharded
            top = live - self.head_grad + b * head.numel + self.reduce_scatter(head) + prefetch
            if top > peak:
                peak, where = top, "reduce-scatter of the head"
            live -= self.head_grad + b * head.numel
        grads = 0  # this layer's unsharded grads so far (the scopes done in its backward)
        n = len(model.scopes)
        for i in range(n - 1, -1, -1):
            ref, cap, keep = model.scopes[i], captured[i], kept[i]
            ws = ws_bwd[ref.layer]
            if cap:  # the replay's transients are in its pool; it returns a clone of the grads
                top = live + ws + grads + b * self.kind_dense.get(ref.kind, 0)
                label = f"backward of {ref.name} (gradient clone)"
            else:
                top = live + ws + grads + mems[i].bwd_transient
                label = f"backward of {ref.name}"
            if top > peak:
                peak, where = top, label
            live -= keep
            grads += b * self.kind_dense.get(ref.kind, 0)
            if i == 0 or model.scopes[i - 1].layer != ref.layer:  # the layer's post-backward
                unit = self.layers[ref.layer]
                top = live + ws + grads + self.reduce_scatter(unit)
                if top > peak:
                    peak, where = top, f"reduce-scatter of {unit.name}"
                grads = 0
        if embed is not None:  # gathered again during layer 0's backward (its prefetch)
            live += b * embed.numel
        if live + t["embed_bwd_transient"] > peak:
            peak, where = live + t["embed_bwd_transient"], "embedding backward"
        if embed is not None:  # its params and grads, then resharded and freed
            top = live + b * embed.numel + self.reduce_scatter(embed)
            if top > peak:
                peak, where = top, "reduce-scatter of the embedding"
            live -= b * embed.numel
        if root.numel:  # last: all its grads (the head's among them, unless its own unit)
            head_grad = self.head_grad if head is None else 0
            top = live - head_grad + b * root.numel + self.reduce_scatter(root)
            if top > peak:
                peak, where = top, "reduce-scatter of the root"
            live -= head_grad
        if self.replicated_experts and live + 4 * self.expert_block > peak:
            peak, where = live + 4 * self.expert_block, "all-reduce of the expert grads"
        return peak + self.side_streams(), where


def expert_dim(prof: Profile, parallel: Parallel) -> int:
    """The dim the run's expert stacks are FSDP2-sharded on (distributed/layout.py's rule, as
    distributed/model.py applies it)."""
    c = prof.model
    if not c.num_experts or not experts_sharded(parallel.world, parallel.ep):
        return 0
    rows = {shape[1] for name, shape in param_shapes(c).items()
            if name.endswith(EXPERT_STACKS) and len(shape) > 1}
    return expert_shard_dim(c.num_experts // parallel.ep, parallel.world // parallel.ep, rows)


def expert_shard_numel(local, replicas: int, dim: int) -> int:
    """Rank 0's share of a local expert stack over its replicas: dim 0 by torch.chunk rules
    (shard_numel), dim 1 evenly."""
    if dim == 0 or replicas <= 1:
        return shard_numel(local, replicas)
    return math.prod(local) // replicas


def local_expert_shape(shape, parallel: Parallel) -> tuple[int, ...]:
    """One EP rank's slice [E / P, ...] of an expert stack."""
    return (shape[0] // parallel.ep, *shape[1:])


def fsdp_layout(prof: Profile, parallel: Parallel) -> FsdpLayout:
    """A rank's FSDP2 units. With dp = W / P > 1 replicas of each expert, a layer's unit
    also holds its local expert stacks, sharded over the dp ranks (distributed/model.py):
    gathered per layer like the dense parameters, moving parameters of the moe graphs."""
    c, b, W = prof.model, DTYPE_BYTES[prof.run.dtype], parallel.world
    dp = W // parallel.ep
    sharded = experts_sharded(W, parallel.ep)  # else whole on each replica, outside FSDP2
    dim = expert_dim(prof, parallel)
    shapes = param_shapes(c)
    numel: dict[str, int] = {}
    shard: dict[str, int] = {}
    rows: dict[str, int] = {}
    split = not c.tie_word_embeddings  # distributed/model.py: the embedding, the head
    outer = {"embed_tokens.weight": "embed", "norm.weight": "head", "lm_head.weight": "head"}
    for name, shape in shapes.items():
        if name.startswith("layers."):
            unit = ".".join(name.split(".")[:2])
        else:
            unit = outer.get(name, "root") if split else "root"
        if name.endswith(EXPERT_STACKS):
            if not sharded:
                continue  # plain stacks at stable addresses, no FSDP2
            local = local_expert_shape(shape, parallel)
            numel[unit] = numel.get(unit, 0) + math.prod(local)
            # the dp-way all-gather's output, counted in the unit's W-way terms
            shard[unit] = shard.get(unit, 0) + -(-dp * expert_shard_numel(local, dp, dim) // W)
            if dim == 1:
                rows[unit] = rows.get(unit, 0) + math.prod(local)
            continue
        numel[unit] = numel.get(unit, 0) + math.prod(shape)
        shard[unit] = shard.get(unit, 0) + shard_numel(shape, W)
    kind_dense: dict[str, int] = {}  # the moving parameters of one scope of each kind
    for i in range(c.num_hidden_layers):
        per_kind: dict[str, int] = {}
        for name, shape in layer_shapes(c, i).items():
            kind = name.split(".")[0]
            if name.endswith(EXPERT_STACKS):
                dense_part = math.prod(local_expert_shape(shape, parallel)) if sharded else 0
            else:
                dense_part = math.prod(shape)
            per_kind[kind] = per_kind.get(kind, 0) + dense_part
        for kind, n in per_kind.items():
            kind_dense.setdefault(kind, n)
    head = shapes.get("lm_head.weight", shapes["embed_tokens.weight"])
    units = [FsdpUnit(f"layers.{i}", numel.get(f"layers.{i}", 0),
                      shard.get(f"layers.{i}", 0), W, rows.get(f"layers.{i}", 0))
             for i in range(c.num_hidden_layers)]
    def outer_unit(name: str) -> FsdpUnit:
        return FsdpUnit(name, numel.get(name, 0), shard.get(name, 0), W)

    return FsdpLayout(
        b=b, world=W, dp=dp, root=outer_unit("root"), layers=units,
        kind_dense=kind_dense, head_grad=b * math.prod(head),
        expert_block=(c.num_experts // parallel.ep) * 2 * c.moe_intermediate_size
        * c.hidden_size,
        embed=outer_unit("embed") if split else None,
        head=outer_unit("head") if split else None,
        replicated_experts=dp > 1 and not sharded)


def static_per_rank(prof: Profile, parallel: Parallel) -> tuple[dict[str, int], dict]:
    """(static in memory.step_model's layout: weights, grads, optimizer, total; the
    breakdown: rank 0's dense shard and its local experts, 4 copies each in b)."""
    c, b, W = prof.model, DTYPE_BYTES[prof.run.dtype], parallel.world
    dense = dense_shard = experts = 0
    for name, shape in param_shapes(c).items():
        if name.endswith(EXPERT_STACKS):
            experts += math.prod(shape)
        else:
            dense += math.prod(shape)
            dense_shard += shard_numel(shape, W)
    # each rank's slice of its E / P experts: FSDP2-sharded over the dp = W / P replicas, or
    # whole on each where this torch cannot (distributed/layout.experts_sharded)
    dim = expert_dim(prof, parallel)
    sharded = experts_sharded(W, parallel.ep)
    local_experts = sum(expert_shard_numel(local_expert_shape(shape, parallel),
                                           W // parallel.ep if sharded else 1, dim)
                        for name, shape in param_shapes(c).items()
                        if name.endswith(EXPERT_STACKS))
    n = dense_shard + local_experts
    static = {"weights": n * b, "grads": n * b, "optimizer": 2 * n * b}
    static["total"] = sum(static.values())
    breakdown = {
        "world": W, "ep": parallel.ep,
        "dense_params": dense, "dense_params_per_rank": dense_shard,
        "expert_params": experts, "expert_params_per_rank": local_experts,
        "local_experts": c.num_experts // parallel.ep if c.num_experts else 0,
        "dense_bytes": 4 * b * dense_shard, "expert_bytes": 4 * b * local_experts,
        "expert_replicas": W // parallel.ep, "expert_shard_dim": dim,
        "experts_sharded": sharded,
        "padding_replicas": padding_replicas(c.num_experts // parallel.ep, W // parallel.ep)
        if c.num_experts and sharded and dim == 0 else 0,
    }
    return static, breakdown


def padding_replicas(local_experts: int, replicas: int) -> int:
    """Of an expert stack's `replicas` FSDP2 shards (dim 0, torch.chunk rules: ceil-sized
    chunks of whole experts), how many hold no expert at all, only the padding FSDP2 gives
    every rank. Past `local_experts` replicas each further one is such a rank, so per-rank
    expert memory stops falling there (one expert a layer at least)."""
    if replicas <= 1 or local_experts == 0:
        return 0
    step = -(-local_experts // replicas)
    return replicas - -(-local_experts // step)


def moe_memory_ep(prof: Profile, parallel: Parallel, device_type: str = "cuda") -> ScopeMemory:
    """The moe scope of one EP rank (moe/ep.ep_moe), P > 1. Per rank: T source tokens (routed
    here: norm, router, top-k as scope_memory.moe_memory), R = P*T received rows, E_l local
    experts.

    Forward: the all-gathers of x [T, H], the top-k weights [T, k] and the ids [T, k] give
    x_RH, w_RK (both saved: the experts read them in backward) and ids_RK; the owned mask
    (bool) and local ids (int64) [R, k] live through the experts. The permute-free experts run
    over the received rows: dropless S = (cdiv(R*min(k, E_l), BM) + E_l) * BM slots with
    BM = route_block(R*min(k, E_l), E_l); capacity C = ceil(T*k*cf/E) per expert at the source,
    S = E_l * round_up(P*C, BM) with BM = route_block(R*k, E_l). Y1 [S, 2F] and the RouteList
    over N = R*k routes are saved. The partial output [R, H] goes back by an all_to_all into a
    receive buffer [R, H], summed in fp32 ([T, H]: the accumulator, one upcast block and the
    sum alive together). Backward: the all-gather of dOut [R, H], the experts' backward over R
    rows (dx_R [R, H], the weights' grads [R, k]), then the all_to_all back of dx_R into
    [R, H] with the same fp32 sum. The reference backend's route count is data dependent:
    bounded by R*min(k, E_l) (capacity: E_l*P*C). `saved` of the permute-free path is checked
    against saved_tensors_hooks on two gloo ranks (tests/plan/test_parallel.py).

    The bounded all-to-all (moe/ep.py; chosen by moe/ep_sizing.dispatch_kind, the rule the
    dispatch itself uses) receives R = P * C rows, C = peer_capacity(T, k, P, E, factor), flat
    in P, instead of P * T: the same terms with that R, plus the packed send copy [R, H] of x
    on the source (forward) and of dOut (backward)."""
    from ..moe.ep_sizing import dispatch_kind, received_rows

    c, run, b = prof.model, prof.run, DTYPE_BYTES[prof.run.dtype]
    T, H, E, k, F = run.batch * run.seq_len, c.hidden_size, c.num_experts, \
        c.num_experts_per_tok, c.moe_intermediate_size
    P = parallel.ep
    factor, requested = prof.moe.ep_capacity_factor, prof.moe.ep_dispatch
    bounded = dispatch_kind(P, T, k, E, factor, requested) == "all_to_all"
    E_l, R = E // P, received_rows(P, T, k, E, factor, requested)
    N, NR = T * k, R * k
    send = b * R * H if bounded else 0  # the all-to-all's packed send copy
    capacity = None
    if prof.moe.capacity is not None:
        from ..moe.routing import expert_capacity  # imports torch: only for capacity mode
        capacity = expert_capacity(T, k, E, prof.moe.capacity)
    fused = fused_norms(device_type)
    saved = rms_saved(T, H, b, True, fused) + b * T * H  # post norm; x_TH (router, all-gather)
    saved += 4 * T * E + 8 * N  # softmax probs (fp32), top-k indices (int64)
    if c.norm_topk_prob:
        saved += 4 * N + 4 * T
    backend = prof.moe.backend
    if backend == "auto":
        backend = "permute_free" if device_type == "cuda" else "reference"
    full = param_bytes(prof, first_moe_layer(prof), "moe.")
    expert_bytes = b * E * 3 * F * H
    params = full - expert_bytes + expert_bytes // P  # router, post norm, E_l experts
    ids = 17 * NR  # ids_RK (int64), the owned mask (bool), local ids (int64)
    combine = 2 * b * R * H + 12 * T * H + send  # partial / dx_R and its receive buffer, fp32 sum
    if backend == "reference":
        routes = NR if capacity is None else min(NR, E_l * P * capacity)
        routes = min(routes, R * min(k, E_l))
        fc1_saved, fc1_transient = routes * (16 + b * H + 16 * F + 4 + b * F), 0
        saved += fc1_saved
        fwd = max(2 * b * NR * H + 8 * R * H + b * R * H, combine) + b * T * H + ids
        bwd = (b * T * H + params + 4 * T * E
               + max(b * R * H + 2 * b * NR * H + 12 * R * H, combine + 2 * b * NR))
        keep = {}
    else:
        if capacity is None:
            bound = R * min(k, E_l)
            block = route_block(bound, E_l, device_type)
            S = expert_slots(bound, 1, E_l, block, None)
        else:
            block = route_block(NR, E_l, device_type)
            S = expert_slots(NR, 1, E_l, block, P * capacity)
        saved += b * R * H + b * NR  # x_RH, w_RK
        saved += b * S * 2 * F  # Y1
        fc1_saved, fc1_transient = b * S * 2 * F, b * S * F
        saved += 8 * (S + 1) + 4 * (S // block) + 4 * NR + 8 * E_l + 8  # the RouteList
        dp_part = dp_part_bytes(S, F, block, device_type)

        def transients(kept: int) -> tuple[int, int]:
            # experts: the activation (unless kept: then saved) + Y2 + the partial [R, H];
            # the combine
            fwd = (max((4 + b) * T * H, b * S * F - kept + b * S * H + b * R * H, combine)
                   + b * T * H + ids)
            experts_bwd = (b * R * H + b * S * 2 * F  # gathered dOut, dY1
                           + max(b * S * F - kept + dp_part, b * S * H + b * R * H)  # act | dx
                           + 4 * S + (4 + b) * NR)  # the weights' grads
            return fwd, (b * T * H + params + max(experts_bwd, combine + 2 * b * NR)
                         + 4 * T * E)

        fwd, bwd = transients(0)
        fwd_kept, bwd_kept = transients(b * S * F)
        keep = dict(keep_saved=b * S * F, keep_fwd_less=fwd - fwd_kept,
                    keep_bwd_less=bwd - bwd_kept)
    shared = shared_expert_memory(prof)
    return ScopeMemory("moe", saved + shared[0], b * T * H + 8 * E, b * T * H, fwd + shared[1],
                       bwd + shared[2], params, saves_input=fused or b == 4, fc1_saved=fc1_saved,
                       fc1_transient=fc1_transient, **keep)

