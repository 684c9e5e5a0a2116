"""The simulation of one step's memory: for a choice of captured scopes and a pool grouping,
the peak a `StepModel` (built by memory.step_model) predicts. It reads sizes; it never
allocates anything.

A step (see `StepModel.predict`):
- static: weights, grads (persistent `.grad` buffers) and AdamW's two states, all in the
  parameter dtype, plus the rope tables; RUNTIME_BYTES (RUNTIME_GRAPH_BYTES once graphs were
  captured) for cuBLAS workspaces.
- graph pools, reserved for the whole run. The simulation replays the capture order
  (forward graphs in execution order, backward graphs in reverse) over each pool's members
  and takes the largest live sum: for `shared` that is about sum(saved + out + in_grad) plus
  the largest transient; `per_scope` does that per scope kind; `per_entry` gives every graph
  its own pool, so each scope costs saved + out + fwd_transient (forward pool) plus
  bwd_transient (backward pool): the pools sum every transient.
- I/O buffers outside the pools: a captured scope whose input is not the previous captured
  scope's output keeps a static input [B,S,H]; one whose output does not feed a captured scope
  keeps a static grad-output buffer (moe's router statistics always do).
- eager live bytes at the worst moment of the step: eager scopes' saved activations and
  transients, the residual stream, and the loss: logits [T,V] in the model dtype (saved for
  backward, then overwritten by their gradient; no fp32 [T,V] exists, see loss.py) and the
  embedding's dense weight-gradient temporary [V,H] (and the lm head's where it is returned).
- allocator slack: `fragmentation` (default FRAGMENTATION) times the pools and the eager
  dynamic bytes, pools rounded up to 2 MiB segments.
The capture command first runs eager steps, so the prediction is the larger of that eager
phase and the graph phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from ..config import Profile
from ..report.summary import DTYPE_BYTES
from .scope_memory import ScopeMemory, loss_moments, recomputed

if TYPE_CHECKING:
    from .parallel import FsdpLayout, Parallel

FRAGMENTATION = 0.05  # caching-allocator slack on dynamic bytes (pools and eager activations)
PRIVATE_FRAGMENTATION = 0.01  # the same for a per-entry pool (one graph's, see _private_pools)
# cuBLAS keeps a workspace per stream that runs a matmul, 32 MiB each on Hopper: the main
# stream in eager steps; with graphs also capture's warm-up stream and its capture stream.
RUNTIME_BYTES = 32 * 2**20
RUNTIME_GRAPH_BYTES = 3 * 32 * 2**20
SEGMENT = 2 * 2**20  # the caching allocator's large-segment granularity
# The caching allocator serves 1-10 MiB requests from 20 MiB segments, reserved whole, and a
# pool whose blocks of that size are freed and requested again in other sizes keeps partly
# used ones. Measured on the H200 (benchmarks/results/capture.json, tiny-qwen3-moe, whose
# tensors are all 1-3 MiB): the shared pool reserved 72 MiB over its live peak, each private
# per-entry pool about 20 MiB, the default pool about 100 MiB over the modelled eager peak.
# Charged: one such segment per graph of a pool, up to MEDIUM_SEGMENTS_PER_POOL, and that many
# for the default pool. Negligible next to a large model's pools (4 x 20 MiB).
MEDIUM_SEGMENT = 20 * 2**20
MEDIUM_SEGMENTS_PER_POOL = 4
STRATEGIES = ("shared", "per_scope", "per_entry")
KIND_OF_SCOPE = {"attn": "attn", "moe": "moe", "mlp": "moe"}  # model kind -> requested scope


@dataclass
class Prediction:
    strategy: str
    captured: tuple[bool, ...]
    peak: int  # max(graph phase, eager phase)
    graph_phase_peak: int
    eager_phase_peak: int
    static_bytes: int
    eager_peak: int  # graph phase: bytes beyond static and pools at the worst moment
    pool_bytes: int
    pools: dict[str, int]
    io_bytes: int
    scope_bytes: dict[str, int]  # pool (and I/O) bytes attributable to each captured scope
    worst_moment: str
    headroom: int = 0  # the step's largest single allocation (see StepModel.headroom)

    @property
    def required(self) -> int:
        """The budget this choice needs: its peak plus room for the largest allocation."""
        return self.peak + self.headroom


@dataclass
class ScopeRef:
    name: str
    layer: int
    kind: str  # attn | moe | mlp


@dataclass
class StepModel:
    """Memory of one step of a profile's run; `predict` simulates a capture choice."""

    prof: Profile
    scopes: list[ScopeRef]
    kinds: dict[str, ScopeMemory]
    static: dict[str, int]
    stream: int  # one residual-stream tensor [B,S,H]
    tail: dict[str, int]
    fragmentation: float = FRAGMENTATION
    runtime: int = RUNTIME_BYTES
    runtime_graph: int = RUNTIME_GRAPH_BYTES
    eager_offset: int = 0  # calibration: measured minus modelled eager peak (allocator, libs)
    pool_offsets: dict[str, int] = field(default_factory=dict)  # calibration, per strategy
    source: str = "analytical"
    parallel: Parallel | None = None  # None: one process
    fsdp: FsdpLayout | None = None  # a distributed rank's FSDP2 units (parallel.py)
    static_breakdown: dict = field(default_factory=dict)  # dense / experts, this rank
    # Per scope (parallel to `scopes`), its recompute mode: none | full | fc1; empty: none.
    recompute: tuple[str, ...] = ()
    # Shared by the copies dataclasses.replace makes (the planner makes one per recompute
    # choice): recomputed scope memories and eager-phase peaks already worked out.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def memory(self, i: int) -> ScopeMemory:
        """Scope i's memory under its recompute mode."""
        m = self.kinds[self.scopes[i].kind]
        mode = self.recompute[i] if self.recompute else "none"
        if mode == "none":
            return m
        key = (id(m), mode)
        if key not in self.memo:
            self.memo[key] = recomputed(m, mode)
        return self.memo[key]

    def memories(self) -> list[ScopeMemory]:
        """`memory(i)` of every scope, worked out once per recompute choice (the planner's
        search predicts each choice many times)."""
        key = ("memories", self.recompute, id(self.scopes),
               tuple((k, id(m)) for k, m in self.kinds.items()))
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = [self.memory(i) for i in range(len(self.scopes))]
        return got

    # -- the simulation ---------------------------------------------------------------
    def predict(self, captured: Sequence[bool], strategy: str) -> Prediction:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown pool strategy {strategy!r}")
        captured = tuple(bool(c) for c in captured)
        if len(captured) != len(self.scopes):
            raise ValueError(f"{len(captured)} choices for {len(self.scopes)} scopes")
        frag = 1.0 + self.fragmentation
        pools, scope_bytes = self._pools(captured, strategy)
        io = self._io_buffers(captured, scope_bytes)
        eager_dyn, where = self._eager_dynamic(captured)
        static = self.static["total"]
        pool_total = sum(pools.values())
        runtime = self.runtime_graph if any(captured) else self.runtime
        slack = MEDIUM_SEGMENTS_PER_POOL * MEDIUM_SEGMENT  # the default pool's
        eager = int(eager_dyn * frag) + io + runtime + self.eager_offset + slack
        graph_phase = static + pool_total + eager
        key = ("eager phase", self.recompute, id(self.scopes), self.static["total"],
               self.eager_offset, self.fragmentation, self.runtime,
               tuple(id(m) for m in self.kinds.values()), tuple(sorted(self.tail.items())))
        if key not in self.memo:
            self.memo[key] = self._eager_phase(
                self._eager_dynamic((False,) * len(self.scopes))[0])
        eager_phase = self.memo[key]
        return Prediction(strategy=strategy, captured=captured,
                          peak=max(graph_phase, eager_phase),
                          graph_phase_peak=graph_phase, eager_phase_peak=eager_phase,
                          static_bytes=static, eager_peak=eager, pool_bytes=pool_total,
                          pools=pools, io_bytes=io, scope_bytes=scope_bytes,
                          worst_moment=where, headroom=self.headroom())

    def predict_step(self) -> Prediction:
        """The whole step as one graph (`--scopes step`): everything a step allocates, eager
        activations, the loss and every transient, comes from the step graph's one pool, so
        the pool is the eager step's dynamic peak (with the allocator's slack and its medium
        segments); outside it stay the static bytes and the batch. The capture command runs
        eager steps first, so the peak is the larger of that phase and the graph phase."""
        frag = 1.0 + self.fragmentation
        none = (False,) * len(self.scopes)
        dyn, where = self._eager_dynamic(none)
        pool = _round_up(int(dyn * frag) + max(self.pool_offsets.get("shared", 0), 0),
                         SEGMENT) + MEDIUM_SEGMENTS_PER_POOL * MEDIUM_SEGMENT
        static = self.static["total"]
        slack = MEDIUM_SEGMENTS_PER_POOL * MEDIUM_SEGMENT
        eager = self.runtime_graph + self.eager_offset + slack
        graph_phase = static + pool + eager
        eager_phase = self._eager_phase(dyn)
        return Prediction(strategy="step", captured=(True,) * len(self.scopes),
                          peak=max(graph_phase, eager_phase), graph_phase_peak=graph_phase,
                          eager_phase_peak=eager_phase, static_bytes=static, eager_peak=eager,
                          pool_bytes=pool, pools={"step": pool}, io_bytes=0,
                          scope_bytes={"step": pool}, worst_moment=f"{where} (in the step pool)",
                          headroom=self.headroom())

    def _eager_phase(self, eager_dynamic: int) -> int:
        """The peak of the eager steps the capture command runs first (nothing captured)."""
        return (self.static["total"] + int(eager_dynamic * (1.0 + self.fragmentation))
                + self.runtime + self.eager_offset + MEDIUM_SEGMENTS_PER_POOL * MEDIUM_SEGMENT)

    def headroom(self) -> int:
        """Under a memory cap the caching allocator must still find the step's largest block
        (the logits [T, V] or a chunk of them, or one layer's expert weight grad) in one
        piece, and cached, partly used segments can strand about that much: measured on the
        H200, a 12-layer Qwen3-30B step whose unconstrained reserved peak was 75.3 GiB ran
        out of memory under a 76.2 GiB cap while allocating its 2.3 GiB log-softmax. A plan
        keeps this much beyond its predicted peak."""
        biggest_param = max((self._param_block(k) for k in self.kinds), default=0)
        room = max(self.tail["loss_saved"], self.tail["biggest"], biggest_param)
        if self.fsdp is not None:  # FSDP2's flat fp32 reduce-scatter input of the root
            room = max(room, self.fsdp.largest_block())
        return room

    def _param_block(self, kind: str) -> int:
        c, b = self.prof.model, DTYPE_BYTES[self.prof.run.dtype]
        if kind == "moe":
            experts = c.num_experts // (self.parallel.ep if self.parallel else 1)
            return b * experts * 2 * c.moe_intermediate_size * c.hidden_size
        if kind == "mlp":
            return b * c.intermediate_size * c.hidden_size
        return b * c.num_attention_heads * max(c.attn_head_dims) * c.hidden_size

    def _pools(self, captured, strategy) -> tuple[dict[str, int], dict[str, int]]:
        frag = 1.0 + self.fragmentation
        pools: dict[str, int] = {}
        scope_bytes: dict[str, int] = {}
        members: dict[str, list[int]] = {}
        mems = self.memories()
        for i, (ref, cap) in enumerate(zip(self.scopes, captured)):
            if not cap:
                continue
            m = mems[i]
            if strategy == "per_entry":
                fwd, bwd = _private_pools(m, 1.0 + min(self.fragmentation,
                                                       PRIVATE_FRAGMENTATION))
                pools[f"{ref.name}.fwd"], pools[f"{ref.name}.bwd"] = fwd, bwd
                scope_bytes[ref.name] = fwd + bwd
            else:
                members.setdefault("shared" if strategy == "shared" else ref.kind, []).append(i)
                scope_bytes[ref.name] = m.saved + m.out + m.in_grad
        for name, idx in members.items():
            live = peak = 0
            for i in idx:  # forward graphs in execution order
                m = mems[i]
                peak = max(peak, live + m.saved + m.out + m.fwd_transient)
                live += m.saved + m.out
            for i in reversed(idx):  # backward graphs in reverse
                m = mems[i]
                peak = max(peak, live + m.bwd_transient)
                live += m.in_grad - m.saved
            offset = self.pool_offsets.get(strategy, 0)
            medium = min(MEDIUM_SEGMENTS_PER_POOL, 2 * len(idx)) * MEDIUM_SEGMENT
            pools[name] = _round_up(int(peak * frag) + max(offset, 0), SEGMENT) + medium
        return pools, scope_bytes

    def _io_buffers(self, captured, scope_bytes: dict[str, int]) -> int:
        """Static inputs / grad-outputs of captured scopes not chained to a captured
        neighbour: allocated outside the pools, kept for the run."""
        total = 0
        for i, (ref, cap) in enumerate(zip(self.scopes, captured)):
            if not cap:
                continue
            extra = 0
            if i == 0 or not captured[i - 1]:
                extra += self.stream  # static input
            if i + 1 == len(captured) or not captured[i + 1]:
                extra += self.stream  # static grad-output
            if ref.kind == "moe":
                extra += 8 * self.prof.model.num_experts  # router statistics' grad-output
            scope_bytes[ref.name] = scope_bytes.get(ref.name, 0) + extra
            total += extra
        if self.fsdp is not None:  # moving parameters' static value and gradient buffers
            total += self.fsdp.moving_buffers(self.scopes, captured, scope_bytes)
        return total

    def _eager_dynamic(self, captured) -> tuple[int, str]:
        """Peak live bytes in the default pool over one step (static excluded)."""
        if self.fsdp is not None:
            return self.fsdp.eager_dynamic(self, captured)
        t = self.tail
        live = peak = self.stream  # embedding output: the residual stream
        where = "embedding"
        kept: list[int] = []
        prev_eager = True
        mems = self.memories()
        for i, (ref, cap) in enumerate(zip(self.scopes, captured)):
            if cap:
                kept.append(0)
                prev_eager = False
                continue
            m = mems[i]
            top = live + m.saved + m.out + m.fwd_transient
            if top > peak:
                peak, where = top, f"forward of {ref.name}"
            keep = m.saved + (self.stream if m.saves_input and prev_eager else 0)
            live += keep
            kept.append(keep)
            prev_eager = True
        live, peak, where = loss_moments(t, live, peak, where)
        for i in range(len(self.scopes) - 1, -1, -1):
            ref, cap, keep = self.scopes[i], captured[i], kept[i]
            if cap:
                continue
            m = mems[i]
            if live + m.bwd_transient > peak:
                peak, where = live + m.bwd_transient, f"backward of {ref.name}"
            live -= keep
        if live + t["embed_bwd_transient"] > peak:
            peak, where = live + t["embed_bwd_transient"], "embedding backward"
        return peak, where


def _private_pools(m: ScopeMemory, frag: float) -> tuple[int, int]:
    """A graph's own pool: its live peak, rounded. One capture's few large blocks leave
    little slack (measured on the H200 over every family's 4-layer slice at 4 x 4096:
    the private pools reserved within about 1% of their live peaks), so the fragmentation
    charged (`frag`, by the caller) is at most PRIVATE_FRAGMENTATION, not the shared pools'."""
    if m.private_pools is not None:
        return m.private_pools
    fwd = _round_up(int((m.saved + m.out + m.fwd_transient) * frag), SEGMENT) + MEDIUM_SEGMENT
    bwd = _round_up(int(m.bwd_transient * frag), SEGMENT) + MEDIUM_SEGMENT
    return fwd, bwd


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def scope_refs(prof: Profile) -> list[ScopeRef]:
    out = []
    for i in range(prof.model.num_hidden_layers):
        out.append(ScopeRef(f"layers.{i}.attn", i, "attn"))
        kind = "moe" if prof.model.is_moe_layer(i) else "mlp"
        out.append(ScopeRef(f"layers.{i}.{kind}", i, kind))
    return out
