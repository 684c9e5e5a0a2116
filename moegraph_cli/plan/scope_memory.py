"""Memory of one scope (attn, moe, mlp) of a step, and of the loss tail: the analytical
formulas the step model (memory.py, simulation.py) is built from. They read configs; nothing
here allocates.

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
  (grads.py) and memory.written_grads takes them out.
Transients are upper estimates from the largest temporaries alive together; a calibration
(measured on the GPU by `moegraph profile --calibrate`) replaces all of these numbers.
- fc1_saved / fc1_transient (moe): what the selective recompute of FC1 takes out of `saved`
  (Y1 [S, 2F] on the permute-free path; the reference path's whole expert loop) and the
  short-lived buffer its re-run adds in the backward (its activation [S, F], which dW_down
  then reads).
- keep_saved / keep_fwd_less / keep_bwd_less (moe, permute-free): what the `keep` mode adds to
  `saved` (FC1's activation [S, F]) and takes off the forward's and the backward's transients
  (the activation no longer freed in the forward, nor allocated by dA in the backward).
`recomputed(m, mode)` gives a scope's numbers under recompute (models/common/recompute.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from moegraph_kernels.env import flag_from_env

from ..config import Profile
from ..report.summary import DTYPE_BYTES, layer_shapes


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
    fc1_saved: int = 0
    fc1_transient: int = 0
    keep_saved: int = 0
    keep_fwd_less: int = 0
    keep_bwd_less: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def recomputed(m: ScopeMemory, mode: str) -> ScopeMemory:
    """A scope's memory under a recompute mode (models/common/recompute.py):
    - full: only the input is kept (`saves_input`); the forward's saved tensors become a
      transient of the forward (built, then dropped) and come back in the backward, where the
      re-run's outputs and the larger of its forward and backward transients sit on them.
    - fc1 (moe): `fc1_saved` leaves `saved` and lives through the backward, beside the larger
      of the re-run's activation and the backward's own transient.
    - keep (moe): `keep_saved` joins `saved`; the transients lose what it takes off them."""
    gone = dict(private_pools=None, fc1_saved=0, fc1_transient=0, keep_saved=0,
                keep_fwd_less=0, keep_bwd_less=0)
    if mode == "full":
        return dataclasses.replace(
            m, saved=0, saves_input=True, fwd_transient=m.saved + m.fwd_transient,
            bwd_transient=m.saved + m.out + max(m.fwd_transient, m.bwd_transient), **gone)
    if mode == "fc1" and m.fc1_saved:
        return dataclasses.replace(
            m, saved=m.saved - m.fc1_saved,
            bwd_transient=m.fc1_saved + max(m.fc1_transient, m.bwd_transient), **gone)
    if mode == "keep" and m.keep_saved:
        return dataclasses.replace(
            m, saved=m.saved + m.keep_saved,
            fwd_transient=max(0, m.fwd_transient - m.keep_fwd_less),
            bwd_transient=max(0, m.bwd_transient - m.keep_bwd_less), **gone)
    return m


def route_block(num_routes: int, num_experts: int, device_type: str) -> int:
    """Slot block BM; mirrors kernels/gemm_config.route_block_m (a test keeps them equal)."""
    if device_type != "cuda":
        return 16
    return 128 if num_routes >= 256 * num_experts else 64


def dp_part_bytes(slots: int, ffn: int, block: int, device_type: str) -> int:
    """dA's dp_part [S, columns] fp32: one column a 128-wide tile, or, where
    moe/experts.tile_configs picks dA's paired tile (a GPU, 128-row blocks, 256 dividing F,
    MOEGRAPH_DACT_PAIRED not 0), one a 64-column quarter (kernels/dact_swiglu.dp_tiles; a test
    keeps them equal)."""
    paired = (device_type == "cuda" and block >= 128 and ffn % 256 == 0
              and flag_from_env("MOEGRAPH_DACT_PAIRED", True))
    return 4 * slots * (ffn // 64 if paired else max(1, ffn // 128))


def expert_slots(num_tokens: int, top_k: int, num_experts: int, block: int,
                 capacity: int | None) -> int:
    """S of kernels/route_align.num_slots: padded slot count for a dispatch mode."""
    if capacity is None:
        return (-(-num_tokens * top_k // block) + num_experts) * block
    return num_experts * (-(-capacity // block) * block)


def fused_norms(device_type: str) -> bool:
    """Whether the norms run as Triton kernels (models/common/fused.py): on CUDA unless
    MOEGRAPH_FUSED=0 (read the same way, without importing torch)."""
    return device_type == "cuda" and os.environ.get("MOEGRAPH_FUSED", "1") not in ("0", "")


def gqa_native() -> bool:
    """Whether attention hands SDPA its grouped K/V heads (models/common/attention.GQA, read
    the same way, without importing torch)."""
    return os.environ.get("MOEGRAPH_ATTN_GQA", "native") == "native"


def rms_saved(rows: int, width: int, b: int, input_external: bool, fused: bool = False) -> int:
    """moegraph's torch rms_norm saves x.float() (the input itself in fp32), rsqrt [rows, 1]
    fp32 and the normalised value in the model dtype (the weight multiply's other operand).
    The fused kernel (`fused`, on CUDA) saves x itself and rstd [rows] fp32 only; x is the
    scope's input (not counted here, `saves_input`) where `input_external`."""
    if fused:
        return (0 if input_external else b * rows * width) + 4 * rows
    upcast = 0 if (b == 4 and input_external) else 4 * rows * width
    return upcast + 4 * rows + b * rows * width


SINK_PAD = 8  # common/sinks.PAD (not imported: the planner runs without torch)


def attn_memory(prof: Profile, device_type: str = "cuda") -> ScopeMemory:
    c, b, T = prof.model, DTYPE_BYTES[prof.run.dtype], prof.run.batch * prof.run.seq_len
    fused = fused_norms(device_type)
    H, D, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    Q = nh * D
    shapes = layer_shapes(c, 0)
    if "attn.kv_b_proj.weight" in shapes:
        return mla_memory(prof, device_type)
    # With sinks (GPT-OSS, common/sinks.py) SDPA runs at head dim D + PAD over S + 1 keys.
    sdpa_dim = D + SINK_PAD if "attn.sinks" in shapes else D
    windowed = c.sliding_window is not None and prof.run.seq_len > c.sliding_window
    # K/V heads as SDPA keeps them: its own grouped heads on the plain causal path
    # (attention.GQA "native"), else expanded to the query heads.
    kv_kept = nkv if (gqa_native() and "attn.sinks" not in shapes and not windowed) else nh
    saved = (rms_saved(T, H, b, True, fused) + b * T * H  # input norm; its output y (q/k/v in)
             + 2 * b * T * (nh + kv_kept) * sdpa_dim  # SDPA's q, k, v and its output
             + 4 * T * nh)  # SDPA's logsumexp
    for name, heads in (("attn.q_norm.weight", nh), ("attn.k_norm.weight", nkv)):
        if name in shapes:  # the family's q/k norm: per head ([D]) or over the projection
            width = shapes[name][0]
            saved += rms_saved(T * heads * D // width, width, b, False, fused)
    if c.clip_qkv is not None:  # each clamp keeps its input
        saved += b * T * (Q + 2 * nkv * D)
    if windowed:
        saved += b * prof.run.seq_len ** 2  # SDPA keeps the window as an additive [S, S] mask
    params = param_bytes(prof, 0, "attn.")
    wide = max(H, Q)
    # rms_norm's fp32 temporaries next to the projection output; fused: the q and k
    # projections beside their normalised copies
    fwd = 2 * b * T * wide if fused else (4 + b) * T * wide
    if sdpa_dim != D:
        # The sink layout's SDPA backward (the memory-efficient kernel over S + 1 keys): the
        # padded dq, dk, dv and their fp32 accumulators, beside dO (padded and not) and the
        # unpadded copies its slicing hands back. Measured on the H200 (gpt-oss-20b-4layer,
        # per-entry pools): 1.49 GiB on full-attention layers, 1.11 GiB on sliding ones;
        # this is the former.
        Qp = nh * sdpa_dim
        sdpa = b * T * Qp + 3 * b * T * Qp + 12 * T * Qp
        bwd = params + b * T * Q + max(sdpa, 12 * T * wide if not fused else 0)
    elif fused:
        # SDPA's backward: dO [T, Q] in, dq / dk / dv and flash's fp32 dq accumulator out
        # (dk / dv counted at the query heads also for grouped heads: the backward's own
        # expanded workspace is not modelled); the input gradient [T, H] comes later.
        bwd = params + b * T * Q + 3 * b * T * Q + 4 * T * Q + 4 * T * nh
    else:  # torch rms_norm's fp32 backward temporaries dominate
        bwd = (b * T * H + params + b * T * Q
               + max(3 * b * T * Q + 4 * T * Q + 4 * T * nh, 12 * T * wide))
    return ScopeMemory("attn", saved, b * T * H, b * T * H, fwd, bwd, params,
                       saves_input=fused or b == 4)


def mla_memory(prof: Profile, device_type: str = "cuda") -> ScopeMemory:
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
    fused = fused_norms(device_type)
    saved = rms_saved(T, H, b, True, fused) + b * T * H
    if c.q_lora_rank is not None:
        saved += rms_saved(T, c.q_lora_rank, b, False, fused) + b * T * c.q_lora_rank
    saved += (4 * T * (R + r) if b == 4 else 4 * T * R) + 4 * T + 2 * b * T * R
    saved += 4 * b * T * Q + 4 * T * nh + b * T * V
    params = param_bytes(prof, 0, "attn.")
    wide = max(H, Q, nh * (c.qk_nope_head_dim + c.v_head_dim))
    kv_b = b * T * nh * (c.qk_nope_head_dim + c.v_head_dim)  # the kv_b projection's output
    if fused:
        # forward: q and k zero-padded to Dp beside kv_b's output (the fused norms' own
        # temporaries come first, before anything is saved); backward: SDPA's dO, dq / dk / dv
        # and fp32 dq accumulator, then the slices' copies (dv unpadded) and kv_b's input grad.
        fwd = 2 * b * T * Q + kv_b
        bwd = (params + b * T * Q + 3 * b * T * Q + 4 * T * Q + 4 * T * nh + kv_b
               + b * T * nh * c.v_head_dim)
    else:
        fwd = (4 + b) * T * wide + 2 * b * T * Q  # torch rms_norm's fp32 temporaries; q/k
        bwd = (b * T * H + params + b * T * Q
               + max(3 * b * T * Q + 4 * T * Q + 4 * T * nh, 12 * T * wide))
    return ScopeMemory("attn", saved, b * T * H, b * T * H, fwd, bwd, params,
                       saves_input=fused or b == 4)


def moe_memory(prof: Profile, device_type: str = "cuda") -> ScopeMemory:
    c, run, b = prof.model, prof.run, DTYPE_BYTES[prof.run.dtype]
    T, H, E, k, F = run.batch * run.seq_len, c.hidden_size, c.num_experts, \
        c.num_experts_per_tok, c.moe_intermediate_size
    N = T * k
    capacity = None
    if prof.moe.capacity is not None:
        capacity = max(1, math.ceil(N * prof.moe.capacity / E))
    fused = fused_norms(device_type)
    saved = rms_saved(T, H, b, True, fused) + b * T * H  # post norm; x_TH (router, experts)
    saved += 4 * T * E + 8 * N  # softmax (or sigmoid) probs (fp32), top-k indices (int64)
    if c.norm_topk_prob:
        saved += 4 * N + 4 * T  # renormalisation's operands: fp32 top-k values and their sum
    if "moe.e_score_correction_bias" in layer_shapes(c, first_moe_layer(prof)):
        # the grouped sigmoid router (DeepSeek-V3): the per-token score sum of its
        # statistics; below fp32, the fp32 copies of x and the router weight its logits read
        saved += 4 * T + (0 if b == 4 else 4 * T * H + 4 * E * H)
    backend = prof.moe.backend
    if backend == "auto":
        backend = "permute_free" if device_type == "cuda" else "reference"
    params = param_bytes(prof, first_moe_layer(prof), "moe.")
    if backend == "reference":
        # (capacity_keep_TK's sort saves its indices, but nothing differentiable uses the
        # sorted values, so that node and its indices are freed at once.)
        routes = N if capacity is None else min(N, E * capacity)
        # per route: nonzero's (token, j) int64, gathered x, 8F of fp32 gate/up (or Y1 in
        # fp32), silu(gate) and silu*up in fp32, the fp32 probability, the act in b.
        fc1_saved = routes * (16 + b * H + 16 * F + 4 + b * F)
        fc1_transient = 0
        saved += fc1_saved
        fwd = 2 * b * N * H + 8 * T * H  # two [T,k,H] index_put copies, fp32 combine
        bwd = b * T * H + params + 2 * b * N * H + 12 * T * H
    else:
        S = expert_slots(T, k, E, route_block(N, E, device_type), capacity)
        block = route_block(N, E, device_type)
        saved += b * N  # the top-k weights the experts read (model dtype)
        saved += b * S * 2 * F  # Y1, the only F-scale tensor kept
        fc1_saved, fc1_transient = b * S * 2 * F, b * S * F
        saved += 8 * (S + 1) + 4 * (S // block) + 4 * N + 8 * E + 8  # the RouteList
        tok, act, y2 = b * T * H, b * S * F, b * S * H
        dp_part = dp_part_bytes(S, F, block, device_type)

        def transients(kept: int) -> tuple[int, int]:
            # FC2 writes Y2 beside the activation; the activation (unless kept: then it is
            # saved) is freed before the combine's output [T, H] is allocated, which takes
            # its block where it fits. Backward: dY1 throughout; beside it first the
            # activation (FC2's dW; dA's own unless kept) and dp's partials, then the slots'
            # dX with its combine and the router's and the residual's [T, H] grads.
            routed = max((2 * b if fused else 4 + b) * T * H, y2 + max(act - kept, tok))
            bwd = params + b * S * 2 * F + max(act - kept + dp_part, y2 + 3 * tok) + 4 * T * E
            return routed, bwd

        routed, bwd = transients(0)
        routed_kept, bwd_kept = transients(act)
        shared_saved, _, shared_bwd = shared_expert_memory(prof)

        def fwd_transient(routed: int) -> int:
            # The shared expert runs after the routed ones: its tensors are allocated when the
            # routed transients are gone; at its sum three [T, H] are live beside everything
            # saved (the routed output, the scaled or unsaved shared output, the sum).
            peak = max(saved + routed, saved + shared_saved + (3 * tok if shared_saved else tok))
            return peak - saved - shared_saved - tok

        fwd = fwd_transient(routed)
        return ScopeMemory("moe", saved + shared_saved, tok + 8 * E, tok, fwd,
                           bwd + shared_bwd, params, saves_input=fused or b == 4,
                           fc1_saved=fc1_saved, fc1_transient=fc1_transient, keep_saved=act,
                           keep_fwd_less=fwd - fwd_transient(routed_kept),
                           keep_bwd_less=bwd - bwd_kept)
    shared = shared_expert_memory(prof)
    return ScopeMemory("moe", saved + shared[0], b * T * H + 8 * E, b * T * H, fwd + shared[1],
                       bwd + shared[2], params, saves_input=fused or b == 4,
                       fc1_saved=fc1_saved, fc1_transient=fc1_transient)


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
    if "moe.shared_expert_gate.weight" not in layer_shapes(c, first_moe_layer(prof)):
        # ungated (DeepSeek-V3): no sigmoid multiply, nothing beyond its own four tensors
        return 4 * b * T * width, b * T * H + b * T * width, 3 * b * T * width + 2 * b * T * H
    saved = 4 * b * T * width + b * T * H + b * T
    return saved, b * T * H + b * T * width, 3 * b * T * width + 2 * b * T * H


def mlp_memory(prof: Profile, device_type: str = "cuda") -> ScopeMemory:
    c, b, T = prof.model, DTYPE_BYTES[prof.run.dtype], prof.run.batch * prof.run.seq_len
    H, inter = c.hidden_size, c.intermediate_size
    fused = fused_norms(device_type)
    saved = rms_saved(T, H, b, True, fused) + b * T * H + 4 * b * T * inter  # g, silu(g), u, g*u
    dense = [i for i in range(c.num_hidden_layers) if not c.is_moe_layer(i)]
    params = param_bytes(prof, dense[0], "mlp.") if dense else 0
    if fused:
        # gate/up, silu and the product are all saved and the down projection writes the
        # output: nothing short-lived beyond the norm's, which comes before any of them.
        # Backward: d(product) [T, I] and d(gate/up) [T, 2I].
        fwd, bwd = 0, params + 3 * b * T * inter
    else:
        fwd = (4 + b) * T * H + b * T * inter
        bwd = b * T * H + params + 3 * b * T * inter + 12 * T * H
    return ScopeMemory("mlp", saved, b * T * H, b * T * H, fwd, bwd, params,
                       saves_input=fused or b == 4)


def loss_chunk_of(prof: Profile) -> int:
    """The rows a chunk of the loss head that run.loss_chunk fixes (auto: 0, the logits
    whole, unless a plan chooses chunks: planner.py)."""
    setting = prof.run.loss_chunk
    return 0 if setting == "auto" else int(setting)


def tail_memory(prof: Profile, sinks: bool = True, device_type: str = "cuda",
                chunk_rows: int | None = None) -> dict[str, int]:
    """Final norm, lm head and loss.linear_cross_entropy (the trainers' keep_logits=False):
    the logits [T, V] in the model dtype are the only [T, V] tensor; their gradient
    overwrites them in backward; fp32 exists per row only (lse, per-token loss). `sinks`
    (one process): the lm head's dW is written into `.grad` by its GEMM, else returned.
    `chunk_rows` > 0 (None: run.loss_chunk's): loss_chunked.py's head, whose forward holds one
    chunk's logits and keeps dx [T, H] and dW [V, H] for the backward instead of the logits
    (`logits` then names those kept bytes; `biggest`: the largest one block of the tail)."""
    c, b, T = prof.model, DTYPE_BYTES[prof.run.dtype], prof.run.batch * prof.run.seq_len
    H, V = c.hidden_size, c.vocab_size
    fused = fused_norms(device_type)
    rows = loss_chunk_of(prof) if chunk_rows is None else chunk_rows
    tail = _whole_tail(b, T, H, V, fused, sinks)
    if rows <= 0:
        return tail
    rows = min(rows, T)
    return {**tail,
            "logits": b * T * H + b * V * H,  # dx and dW, from the forward to the backward
            # one chunk's logits (their dlogits written over them), its loss and lse
            "loss_fwd_transient": b * rows * V + 8 * T + 8 * rows,
            "head_bwd_transient": 0,  # dx and dW are scaled in place (a sink's: into .grad)
            "biggest": max(b * rows * V, b * V * H),
            "chunk_rows": rows}


def _whole_tail(b: int, T: int, H: int, V: int, fused: bool, sinks: bool) -> dict[str, int]:
    return {
        # the final norm (fused: its input, the last layer's output, and rstd), the lm-head
        # input, the labels
        "norm_saved": rms_saved(T, H, b, False, fused) + b * T * H + 8 * T if fused
        else rms_saved(T, H, b, True) + b * T * H + 8 * T,
        "logits": b * T * V,
        "loss_fwd_transient": 8 * T,  # per-token loss and the shifted labels
        "loss_saved": 4 * T + 8 * T,  # lse, labels
        "loss_bwd_transient": 0,  # dlogits are written over the logits
        # dX, and the lm head's dW where it is returned rather than written
        "head_bwd_transient": b * T * H + (0 if sinks else b * V * H),
        "embed_bwd_transient": b * V * H + 4 * T * H + 32 * T,  # dense grad, fp32 partials
        "biggest": b * T * V,
        "chunk_rows": 0,
    }


def loss_moments(t: dict[str, int], live: int, peak: int, where: str,
                 backward_extra: int = 0) -> tuple[int, int, str]:
    """Final norm, lm head and loss over `live` bytes: (live after them, peak, where). The
    logits live from the head's forward to its backward (the trainers keep none), their
    gradient written over them. `backward_extra`: bytes beside the backward moments only
    (an FSDP2 all-gather the head's backward prefetches, parallel.py)."""
    live += t["norm_saved"] + t["logits"]
    if live + t["loss_fwd_transient"] > peak:
        peak, where = live + t["loss_fwd_transient"], "loss forward"
    live += t["loss_saved"]
    if live + t["loss_bwd_transient"] + backward_extra > peak:
        peak, where = live + t["loss_bwd_transient"] + backward_extra, "loss backward"
    if live + t["head_bwd_transient"] + backward_extra > peak:
        peak, where = live + t["head_bwd_transient"] + backward_extra, "lm-head backward"
    live -= t["norm_saved"] + t["loss_saved"] + t["logits"]
    return live, peak, where


def first_moe_layer(prof: Profile) -> int:
    for i in range(prof.model.num_hidden_layers):
        if prof.model.is_moe_layer(i):
            return i
    return 0


def param_bytes(prof: Profile, layer: int, prefix: str) -> int:
    b = DTYPE_BYTES[prof.run.dtype]
    n = 0
    for name, shape in layer_shapes(prof.model, layer).items():
        if name.startswith(prefix):
            n += math.prod(shape)
    return n * b
