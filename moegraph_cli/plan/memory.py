"""Memory model of one training step, and the simulation that predicts its peak for a choice of
captured scopes and pool grouping. It reads configs (and, when given, a GPU calibration); it
never allocates anything.

Notation: b bytes per element of the model dtype, T = batch * seq_len tokens, H hidden, V vocab,
nh / nkv heads, D head_dim, Q = nh*D, KV = nkv*D, E experts, k top-k, F moe_intermediate,
I dense intermediate, S expert slots (dropless (cdiv(T*k, BM) + E)*BM, capacity
E*round_up(C, BM), BM the slot block), N = T*k routes.

Parameters come from the family's key map (summary.layer_shapes), so biases, q/k norms and a
shared expert are counted wherever a family has them; the attention variants (clip_qkv,
sliding window) and a shared expert add their activations below.

Per scope (one of attn, moe, mlp) the model counts, in bytes:
- saved: tensors autograd keeps from forward to backward (parameters and the rope tables
  excluded; the scope's input is excluded too and flagged by `saves_input`, which holds in
  fp32 where `x.float()` returns `x` itself). Exact for both expert paths; checked against
  `saved_tensors_hooks` in tests/plan/test_memory.py (the Triton one under its interpreter).
- out / in_grad: the scope's output(s) and its input's gradient ([B,S,H]; moe adds its
  [2,E] fp32 router statistics).
- fwd_transient: the forward's peak above saved + out (short-lived temporaries).
- bwd_transient: the backward's peak above what was live before it. It includes the input
  gradient and, where gradients are returned rather than written (a distributed rank's FSDP2
  parameters, the reference experts), every parameter gradient of the scope (for moe the
  expert grads [E,2F,H] and [E,H,F]); in one process they are written straight into `.grad`
  (grads.py) and `written_grads` takes them out.
Transients are upper estimates from the largest temporaries alive together; a calibration
(measured on the GPU by `moegraph profile --calibrate`) replaces all of these numbers.

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

Distributed runs (`parallel`, W ranks, P-way expert parallel): the same model predicts ONE
rank; plan/parallel.py supplies its static memory (FSDP2-sharded dense parameters, E/P
experts), its moe scope and the FSDP2 working set of the eager part. W = P = 1 is this file's
single-process model, unchanged.

Calibration (plan/calibration.py): measured per-scope sizes and per-entry pools replace the
formulas; the same simulation run over the calibration's one-layer model, against that model's
measured pools and eager peak reserved, gives offsets (allocator rounding, fragmentation,
library workspaces) that are added to every prediction for the full model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from ..config import Profile
from ..io.documents import at, is_int, is_number, show
from ..errors import UsageError
from ..report.summary import DTYPE_BYTES, layer_shapes, rope_buffer_bytes, static_memory

if TYPE_CHECKING:
    from .parallel import FsdpLayout, Parallel

FRAGMENTATION = 0.05  # caching-allocator slack on dynamic bytes (pools and eager activations)
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


def route_block(num_routes: int, num_experts: int, device_type: str) -> int:
    """Slot block BM; mirrors kernels/gemm_config.route_block_m (a test keeps them equal)."""
    if device_type != "cuda":
        return 16
    return 128 if num_routes >= 256 * num_experts else 64


def expert_slots(num_tokens: int, top_k: int, num_experts: int, block: int,
                 capacity: int | None) -> int:
    """S of kernels/route_align.num_slots: padded slot count for a dispatch mode."""
    if capacity is None:
        return (-(-num_tokens * top_k // block) + num_experts) * block
    return num_experts * (-(-capacity // block) * block)


def model_hash(prof: Profile) -> str:
    """Identity of the model architecture (every config.json field), 16 hex digits."""
    text = json.dumps(dataclasses.asdict(prof.model), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_key(prof: Profile, world: int = 1, ep: int = 1) -> dict:
    """What a plan, a calibration or a savings file is valid for: the run, and its ranks
    (`world` processes, `ep`-way expert parallel; batch is per rank)."""
    return {"profile": prof.name, "batch": prof.run.batch, "seq_len": prof.run.seq_len,
            "dtype": prof.run.dtype, "moe_mode": prof.moe.mode,
            "capacity_factor": prof.moe.capacity, "model_hash": model_hash(prof),
            "world": world, "ep": ep}


def check_key(key, where: str, field: str = "key") -> dict:
    """A key read from a plan, savings or calibration file (`where`, e.g. "plan p.yaml"; the
    key is its `field`), checked field by field against run_key's types. world and ep may be
    absent: files written before distributed runs are one process."""
    if not isinstance(key, dict):
        raise UsageError(f"{where}: {field} must be a mapping of the run's batch, seq_len, "
                         f"dtype, moe_mode and model_hash, got {show(key)}")
    positive = (lambda v: is_int(v) and v > 0, "a positive integer")
    text = (lambda v: isinstance(v, str) and v.isprintable(), "a one-line string")
    rules = {"batch": positive, "seq_len": positive, "dtype": text, "moe_mode": text,
             "model_hash": text, "profile": text,
             "capacity_factor": (lambda v: v is None or is_number(v), "a number or null"),
             "world": (lambda v: v is None or positive[0](v), "a positive integer"),
             "ep": (lambda v: v is None or positive[0](v), "a positive integer")}
    for name, (ok, what) in rules.items():
        if name not in key:
            if name in ("batch", "seq_len", "dtype", "moe_mode", "model_hash"):
                raise UsageError(f"{at(where, key)}: {field} has no {name!r}")
        elif not ok(key[name]):
            raise UsageError(f"{at(where, key, name)}: {field}.{name} must be {what}, got "
                             f"{show(key[name])}")
    return key


def ranks_of(key: dict) -> tuple[int, int]:
    """(world, ep) of a key; files written before distributed runs have neither: (1, 1)."""
    return int(key.get("world") or 1), int(key.get("ep") or 1)


def same_run(a: dict, b: dict) -> bool:
    """Keys equal except the profile name (a checkpoint's name is its directory)."""
    fields = ("batch", "seq_len", "dtype", "moe_mode", "capacity_factor", "model_hash")
    return all(a.get(f) == b.get(f) for f in fields) and ranks_of(a) == ranks_of(b)


def describe_ranks(key: dict) -> str:
    world, ep = ranks_of(key)
    return "one process" if (world, ep) == (1, 1) else f"--nproc {world} --ep {ep}"


def describe_key(key: dict) -> str:
    mode = key.get("moe_mode")
    if key.get("capacity_factor") is not None:
        mode = f"{mode} {key['capacity_factor']}"
    ranks = "" if ranks_of(key) == (1, 1) else f", {describe_ranks(key)}"
    return (f"{key.get('profile')} (batch {key.get('batch')}, seq_len {key.get('seq_len')}, "
            f"{key.get('dtype')}, {mode}, model {key.get('model_hash')}{ranks})")


@dataclass
class ScopeMemory:
    kind: str
    saved: int
    out: int
    in_grad: int
    fwd_transient: int
    bwd_transient: int
    param_grads: int
    saves_input: bool = False
    source: str = "analytical"
    # Measured private pools of one scope (per_entry), from a calibration: (fwd, bwd).
    private_pools: tuple[int, int] | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
        eager_phase = self._eager_phase(self._eager_dynamic((False,) * len(self.scopes))[0])
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
        (the logits [T, V], or one layer's expert weight grad) in one piece, and
        cached, partly used segments can strand about that much: measured on the H200, a
        12-layer Qwen3-30B step whose unconstrained reserved peak was 75.3 GiB ran out of
        memory under a 76.2 GiB cap while allocating its 2.3 GiB log-softmax. A plan keeps
        this much beyond its predicted peak."""
        biggest_param = max((self._param_block(k) for k in self.kinds), default=0)
        room = max(self.tail["loss_saved"], self.tail["logits"], biggest_param)
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
        for i, (ref, cap) in enumerate(zip(self.scopes, captured)):
            if not cap:
                continue
            m = self.kinds[ref.kind]
            if strategy == "per_entry":
                fwd, bwd = _private_pools(m, frag)
                pools[f"{ref.name}.fwd"], pools[f"{ref.name}.bwd"] = fwd, bwd
                scope_bytes[ref.name] = fwd + bwd
            else:
                members.setdefault("shared" if strategy == "shared" else ref.kind, []).append(i)
                scope_bytes[ref.name] = m.saved + m.out + m.in_grad
        for name, idx in members.items():
            live = peak = 0
            for i in idx:  # forward graphs in execution order
                m = self.kinds[self.scopes[i].kind]
                peak = max(peak, live + m.saved + m.out + m.fwd_transient)
                live += m.saved + m.out
            for i in reversed(idx):  # backward graphs in reverse
                m = self.kinds[self.scopes[i].kind]
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
        for ref, cap in zip(self.scopes, captured):
            if cap:
                kept.append(0)
                prev_eager = False
                continue
            m = self.kinds[ref.kind]
            top = live + m.saved + m.out + m.fwd_transient
            if top > peak:
                peak, where = top, f"forward of {ref.name}"
            keep = m.saved + (self.stream if m.saves_input and prev_eager else 0)
            live += keep
            kept.append(keep)
            prev_eager = True
        live, peak, where = loss_moments(t, live, peak, where)
        for ref, cap, keep in zip(reversed(self.scopes), reversed(captured), reversed(kept)):
            if cap:
                continue
            m = self.kinds[ref.kind]
            if live + m.bwd_transient > peak:
                peak, where = live + m.bwd_transient, f"backward of {ref.name}"
            live -= keep
        if live + t["embed_bwd_transient"] > peak:
            peak, where = live + t["embed_bwd_transient"], "embedding backward"
        return peak, where


def loss_moments(t: dict[str, int], live: int, peak: int, where: str) -> tuple[int, int, str]:
    """Final norm, lm head and loss over `live` bytes: (live after them, peak, where). The
    logits live from the head's forward to its backward (the trainers keep none), their
    gradient written over them."""
    live += t["norm_saved"] + t["logits"]
    if live + t["loss_fwd_transient"] > peak:
        peak, where = live + t["loss_fwd_transient"], "loss forward"
    live += t["loss_saved"]
    if live + t["loss_bwd_transient"] > peak:
        peak, where = live + t["loss_bwd_transient"], "loss backward"
    if live + t["head_bwd_transient"] > peak:
        peak, where = live + t["head_bwd_transient"], "lm-head backward"
    live -= t["norm_saved"] + t["loss_saved"] + t["logits"]
    return live, peak, where


def _private_pools(m: ScopeMemory, frag: float) -> tuple[int, int]:
    if m.private_pools is not None:
        return m.private_pools
    fwd = _round_up(int((m.saved + m.out + m.fwd_transient) * frag), SEGMENT) + MEDIUM_SEGMENT
    bwd = _round_up(int(m.bwd_transient * frag), SEGMENT) + MEDIUM_SEGMENT
    return fwd, bwd


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# -- analytical formulas ------------------------------------------------------------------
def rms_saved(rows: int, width: int, b: int, input_external: bool) -> int:
    """moegraph's rms_norm saves x.float() (the input itself in fp32), rsqrt [rows, 1] fp32
    and the normalised value in the model dtype (the weight multiply's other operand)."""
    upcast = 0 if (b == 4 and input_external) else 4 * rows * width
    return upcast + 4 * rows + b * rows * width


SINK_PAD = 8  # common/sinks.PAD (not imported: the planner runs without torch)


def attn_memory(prof: Profile) -> ScopeMemory:
    c, b, T = prof.model, DTYPE_BYTES[prof.run.dtype], prof.run.batch * prof.run.seq_len
    H, D, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    Q = nh * D
    shapes = layer_shapes(c, 0)
    if "attn.kv_b_proj.weight" in shapes:
        return mla_memory(prof)
    # With sinks (GPT-OSS, common/sinks.py) SDPA runs at head dim D + PAD over S + 1 keys.
    sdpa_dim = D + SINK_PAD if "attn.sinks" in shapes else D
    saved = (rms_saved(T, H, b, True) + b * T * H  # input norm; its output y (q/k/v input)
             + 4 * b * T * nh * sdpa_dim  # SDPA's q, k, v (GQA-expanded) and its output
             + 4 * T * nh)  # SDPA's logsumexp
    for name, heads in (("attn.q_norm.weight", nh), ("attn.k_norm.weight", nkv)):
        if name in shapes:  # the family's q/k norm: per head ([D]) or over the projection
            width = shapes[name][0]
            saved += rms_saved(T * heads * D // width, width, b, False)
    if c.clip_qkv is not None:  # each clamp keeps its input
        saved += b * T * (Q + 2 * nkv * D)
    if c.sliding_window is not None and prof.run.seq_len > c.sliding_window:
        saved += b * prof.run.seq_len ** 2  # SDPA keeps the window as an additive [S, S] mask
    params = _param_bytes(prof, 0, "attn.")
    wide = max(H, Q)
    fwd = (4 + b) * T * wide  # rms_norm's fp32 temporaries next to the projection output
    bwd = (b * T * H + params + b * T * Q
           + max(3 * b * T * Q + 4 * T * Q + 4 * T * nh, 12 * T * wide))
    return ScopeMemory("attn", saved, b * T * H, b * T * H, fwd, bwd, params,
                       saves_input=b == 4)


def mla_memory(prof: Profile) -> ScopeMemory:
    """Multi-head latent attention (common/mla.py; DeepSeek-V3). Rq the q LoRA rank (none:
    a plain q_proj), R kv_lora_rank, r the rope part, Dp = max(q/k head dim, v_head_dim) the
    width SDPA runs at (v or q/k zero-padded). Saved: the input norm and y; the q LoRA norm and
    its output; the kv latent norm (its fp32 input: in fp32 the whole [T, R + r] projection
    it is a view of) and its output; SDPA's padded q, k, v and output and its logsumexp; the
    o projection's input [T, nh * v_head_dim] (a copy: the output is sliced)."""
    c, b, T = prof.model, DTYPE_BYTES[prof.run.dtype], prof.run.batch * prof.run.seq_len
    H, nh, R, r = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    Dp = max(c.qk_nope_head_dim + r, c.v_head_dim)
    Q, V = nh * Dp, nh * c.v_head_dim
    saved = rms_saved(T, H, b, True) + b * T * H
    if c.q_lora_rank is not None:
        saved += rms_saved(T, c.q_lora_rank, b, False) + b * T * c.q_lora_rank
    saved += (4 * T * (R + r) if b == 4 else 4 * T * R) + 4 * T + 2 * b * T * R
    saved += 4 * b * T * Q + 4 * T * nh + b * T * V
    params = _param_bytes(prof, 0, "attn.")
    wide = max(H, Q, nh * (c.qk_nope_head_dim + c.v_head_dim))
    fwd = (4 + b) * T * wide + 2 * b * T * Q  # fp32 norm temporaries; q/k before padding
    bwd = (b * T * H + params + b * T * Q
           + max(3 * b * T * Q + 4 * T * Q + 4 * T * nh, 12 * T * wide))
    return ScopeMemory("attn", saved, b * T * H, b * T * H, fwd, bwd, params,
                       saves_input=b == 4)


def moe_memory(prof: Profile, device_type: str = "cuda") -> ScopeMemory:
    c, run, b = prof.model, prof.run, DTYPE_BYTES[prof.run.dtype]
    T, H, E, k, F = run.batch * run.seq_len, c.hidden_size, c.num_experts, \
        c.num_experts_per_tok, c.moe_intermediate_size
    N = T * k
    capacity = None
    if prof.moe.capacity is not None:
        capacity = max(1, math.ceil(N * prof.moe.capacity / E))
    saved = rms_saved(T, H, b, True) + b * T * H  # post norm; x_TH (router and experts)
    saved += 4 * T * E + 8 * N  # softmax (or sigmoid) probs (fp32), top-k indices (int64)
    if c.norm_topk_prob:
        saved += 4 * N + 4 * T  # renormalisation's operands: fp32 top-k values and their sum
    if "moe.e_score_correction_bias" in layer_shapes(c, _first_moe_layer(prof)):
        # the grouped sigmoid router (DeepSeek-V3): the per-token score sum of its
        # statistics; below fp32, the fp32 copies of x and the router weight its logits read
        saved += 4 * T + (0 if b == 4 else 4 * T * H + 4 * E * H)
    backend = prof.moe.backend
    if backend == "auto":
        backend = "permute_free" if device_type == "cuda" else "reference"
    params = _param_bytes(prof, _first_moe_layer(prof), "moe.")
    if backend == "reference":
        # (capacity_keep_TK's sort saves its indices, but nothing differentiable uses the
        # sorted values, so that node and its indices are freed at once.)
        routes = N if capacity is None else min(N, E * capacity)
        # per route: nonzero's (token, j) int64, gathered x, 8F of fp32 gate/up (or Y1 in
        # fp32), silu(gate) and silu*up in fp32, the fp32 probability, the act in b.
        saved += routes * (16 + b * H + 16 * F + 4 + b * F)
        fwd = 2 * b * N * H + 8 * T * H  # two [T,k,H] index_put copies, fp32 combine
        bwd = b * T * H + params + 2 * b * N * H + 12 * T * H
    else:
        S = expert_slots(T, k, E, route_block(N, E, device_type), capacity)
        block = route_block(N, E, device_type)
        saved += b * N  # the top-k weights the experts read (model dtype)
        saved += b * S * 2 * F  # Y1, the only F-scale tensor kept
        saved += 8 * (S + 1) + 4 * (S // block) + 4 * N + 8 * E + 8  # the RouteList
        fwd = max((4 + b) * T * H, b * S * F + b * S * H) + b * T * H  # act + Y2; combine out
        dp_part = 4 * S * max(1, F // 128)
        bwd = (b * T * H + params + b * S * 2 * F  # dx, all grads, dY1
               + max(b * S * F + dp_part, b * S * H) + b * T * H + 4 * T * E)
    shared = shared_expert_memory(prof)
    return ScopeMemory("moe", saved + shared[0], b * T * H + 8 * E, b * T * H, fwd + shared[1],
                       bwd + shared[2], params, saves_input=b == 4)


def shared_expert_memory(prof: Profile) -> tuple[int, int, int]:
    """(saved, fwd, bwd) a moe scope adds for a shared expert of width Sh (0 without one):
    gate, silu(gate), up and their product [T, Sh]; sigmoid(gate logit) [T, 1] and the shared
    output [T, H] (the scaling multiply's operands). Its input is x_TH, saved already. Forward:
    the sum with the routed output [T, H]; backward: the [T, Sh] gradients and dx [T, H]
    (its weight gradients are in the scope's parameter bytes)."""
    c, b, T = prof.model, DTYPE_BYTES[prof.run.dtype], prof.run.batch * prof.run.seq_len
    width, H = c.shared_expert_width, c.hidden_size
    if width == 0:
        return 0, 0, 0
    if "moe.shared_expert_gate.weight" not in layer_shapes(c, _first_moe_layer(prof)):
        # ungated (DeepSeek-V3): no sigmoid multiply, nothing beyond its own four tensors
        return 4 * b * T * width, b * T * H + b * T * width, 3 * b * T * width + 2 * b * T * H
    saved = 4 * b * T * width + b * T * H + b * T
    return saved, b * T * H + b * T * width, 3 * b * T * width + 2 * b * T * H


def mlp_memory(prof: Profile) -> ScopeMemory:
    c, b, T = prof.model, DTYPE_BYTES[prof.run.dtype], prof.run.batch * prof.run.seq_len
    H, inter = c.hidden_size, c.intermediate_size
    saved = rms_saved(T, H, b, True) + b * T * H + 4 * b * T * inter  # g, silu(g), u, g*u
    dense = [i for i in range(c.num_hidden_layers) if not c.is_moe_layer(i)]
    params = _param_bytes(prof, dense[0], "mlp.") if dense else 0
    fwd = (4 + b) * T * H + b * T * inter
    bwd = b * T * H + params + 3 * b * T * inter + 12 * T * H
    return ScopeMemory("mlp", saved, b * T * H, b * T * H, fwd, bwd, params,
                       saves_input=b == 4)


def tail_memory(prof: Profile, sinks: bool = True) -> dict[str, int]:
    """Final norm, lm head and loss.linear_cross_entropy (the trainers' keep_logits=False):
    the logits [T, V] in the model dtype are the only [T, V] tensor; their gradient
    overwrites them in backward; fp32 exists per row only (lse, per-token loss). `sinks`
    (one process): the lm head's dW is written into `.grad` by its GEMM, else returned."""
    c, b, T = prof.model, DTYPE_BYTES[prof.run.dtype], prof.run.batch * prof.run.seq_len
    H, V = c.hidden_size, c.vocab_size
    return {
        "norm_saved": rms_saved(T, H, b, True) + b * T * H + 8 * T,  # + lm-head input, labels
        "logits": b * T * V,
        "loss_fwd_transient": 8 * T,  # per-token loss and the shifted labels
        "loss_saved": 4 * T + 8 * T,  # lse, labels
        "loss_bwd_transient": 0,  # dlogits are written over the logits
        # dX, and the lm head's dW where it is returned rather than written
        "head_bwd_transient": b * T * H + (0 if sinks else b * V * H),
        "embed_bwd_transient": b * V * H + 4 * T * H + 32 * T,  # dense grad, fp32 partials
    }


def _first_moe_layer(prof: Profile) -> int:
    for i in range(prof.model.num_hidden_layers):
        if prof.model.is_moe_layer(i):
            return i
    return 0


def _param_bytes(prof: Profile, layer: int, prefix: str) -> int:
    b = DTYPE_BYTES[prof.run.dtype]
    n = 0
    for name, shape in layer_shapes(prof.model, layer).items():
        if name.startswith(prefix):
            n += math.prod(shape)
    return n * b


def scope_refs(prof: Profile) -> list[ScopeRef]:
    out = []
    for i in range(prof.model.num_hidden_layers):
        out.append(ScopeRef(f"layers.{i}.attn", i, "attn"))
        kind = "moe" if prof.model.is_moe_layer(i) else "mlp"
        out.append(ScopeRef(f"layers.{i}.{kind}", i, kind))
    return out


def step_model(prof: Profile, device_type: str = "cuda", calibration: dict | None = None,
               fragmentation: float = FRAGMENTATION, parallel=None) -> StepModel:
    """The analytical model of `prof`'s step; a calibration entry (calibration.py) for the
    same run replaces the per-scope numbers and adds the measured allocator offsets.
    `parallel` (parallel.Parallel(world, ep)): the model of one rank of that distributed run;
    None or (1, 1) is one process."""
    from .parallel import Parallel, fsdp_layout, moe_memory_ep, static_per_rank

    b = DTYPE_BYTES[prof.run.dtype]
    T, H = prof.run.batch * prof.run.seq_len, prof.model.hidden_size
    if parallel is not None and parallel.single:
        parallel = None
    if parallel is not None and calibration is not None:
        raise ValueError("a calibration is measured in one process; it cannot model a rank "
                         f"of --nproc {parallel.world} --ep {parallel.ep}")
    moe = moe_memory(prof, device_type) if parallel is None or parallel.ep == 1 else \
        moe_memory_ep(prof, parallel, device_type)
    kinds = {"attn": attn_memory(prof), "moe": moe, "mlp": mlp_memory(prof)}
    if parallel is None:
        kinds = written_grads(kinds, prof, device_type)
    if parallel is None:
        static = dict(static_memory(prof.model, prof.run.dtype))
    else:
        static = static_per_rank(prof, parallel)[0]
    breakdown = static_per_rank(prof, parallel or Parallel())[1]
    static["buffers"] = rope_buffer_bytes(prof.model, prof.run.seq_len, prof.run.dtype)
    static["total"] += static["buffers"]
    breakdown.update(buffer_bytes=static["buffers"], total_bytes=static["total"])
    model = StepModel(prof=prof, scopes=scope_refs(prof), kinds=kinds, static=static,
                      stream=b * T * H, tail=tail_memory(prof, sinks=parallel is None),
                      fragmentation=fragmentation,
                      runtime=RUNTIME_BYTES if device_type == "cuda" else 0,
                      runtime_graph=RUNTIME_GRAPH_BYTES if device_type == "cuda" else 0,
                      parallel=parallel, static_breakdown=breakdown,
                      fsdp=fsdp_layout(prof, parallel) if parallel is not None else None)
    if calibration is not None:
        apply_calibration(model, calibration)
    return model


def written_grads(kinds: dict[str, ScopeMemory], prof: Profile, device_type: str
                  ) -> dict[str, ScopeMemory]:
    """One process: every parameter is a gradient sink (grads.py), so a scope's backward
    writes its weight gradients straight into the persistent `.grad` buffers (static memory)
    and they leave its transient. The reference experts (the CPU path) still materialise
    theirs before depositing them."""
    backend = prof.moe.backend
    if backend == "auto":
        backend = "permute_free" if device_type == "cuda" else "reference"
    out = {}
    for name, m in kinds.items():
        if name == "moe" and backend == "reference":
            out[name] = m
        else:
            out[name] = dataclasses.replace(m, bwd_transient=m.bwd_transient - m.param_grads)
    return out


def apply_calibration(model: StepModel, entry: dict) -> None:
    """Measured per-scope numbers replace the formulas; offsets absorb what the formulas miss
    (allocator rounding and fragmentation, library workspaces), measured on one layer."""
    for kind, s in entry.get("scopes", {}).items():
        if kind not in model.kinds:
            continue
        old = model.kinds[kind]
        saved, out = int(s["saved_bytes"]), int(s["out_bytes"])
        pools = s.get("private_pools")
        model.kinds[kind] = ScopeMemory(
            kind=kind, saved=saved, out=out, in_grad=int(s.get("in_grad_bytes", old.in_grad)),
            fwd_transient=max(0, int(s["fwd_peak_bytes"]) - saved - out),
            bwd_transient=max(0, int(s["bwd_peak_bytes"])),
            param_grads=old.param_grads, saves_input=bool(s.get("saves_input", False)),
            source="calibration",
            private_pools=(int(pools[0]), int(pools[1])) if pools else None)
    layer = entry.get("layer_model")
    if layer:
        # The same simulation over the calibration's one-layer model, against its measurement.
        probe = _one_layer_probe(model)
        everything = (True,) * len(probe.scopes)
        for strategy, measured in layer.get("pools", {}).items():
            predicted = probe.predict(everything, strategy).pool_bytes if strategy in \
                STRATEGIES and strategy != "per_entry" else None
            if predicted is not None:
                n_pools = max(1, len(probe.predict(everything, strategy).pools))
                model.pool_offsets[strategy] = int((int(measured) - predicted) / n_pools)
        if layer.get("eager_peak_reserved"):
            base = probe.predict((False,) * len(probe.scopes), "shared").eager_phase_peak
            model.eager_offset = int(layer["eager_peak_reserved"]) - base
    model.source = "calibration"


def one_layer_profile(prof: Profile) -> Profile:
    """The profile cut to one MoE layer: what a calibration builds and measures."""
    cfg = dataclasses.replace(prof.model, num_hidden_layers=1, mlp_only_layers=[],
                              decoder_sparse_step=1)
    return dataclasses.replace(prof, model=cfg, run=dataclasses.replace(prof.run),
                               moe=dataclasses.replace(prof.moe))


def _one_layer_probe(model: StepModel) -> StepModel:
    prof = one_layer_profile(model.prof)
    static = dict(static_memory(prof.model, prof.run.dtype))
    static["total"] += model.static.get("buffers", 0)
    probe = dataclasses.replace(model, prof=prof, scopes=scope_refs(prof), static=static,
                                pool_offsets={}, eager_offset=0)
    return probe
