"""Time estimates the planner weighs: what a graph replay saves, what recompute costs.

Savings: a replay removes the host cost of launching each kernel of the scope, LAUNCHES[kind]
launches (forward + backward) at LAUNCH_US each, unless `moegraph profile` measured them.

Recompute: a recomputed scope runs its forward twice. The extra time is its forward's FLOPs at
RECOMPUTE_TFLOPS (an estimate, not a measurement: the H200's sustained bf16 rate on these
GEMMs; the expert forward measured 445-520 TFLOP/s at the Qwen3 shape, T = 8192, attention
less, see benchmarks/results/), plus, for a scope that runs eagerly, the launches of its
forward (about half of LAUNCHES[kind]); inside a captured scope's backward graph the re-run
costs no launches. Forward FLOPs, T tokens of B sequences of S:
- attn: q/k/v/o projections 2T*H*(Q + 2KV) + 2T*Q*H, and causal SDPA 2*B*S^2*nh*(Dqk + Dv)/2;
- moe full: the router 2T*E*H, the experts 2T*k*3F*H, a shared expert 2T*3*Sh*H;
- moe fc1 (selective): FC1 alone, 2T*k*2F*H;
- mlp (dense layer): 2T*3I*H.
The MoE scope's `keep` (FC1's activation kept) recomputes nothing: 0. What it saves over `none`,
dA's recompute and store of that activation, is not modelled (about 1% of the experts'
fwd+bwd, benchmarks/results/experts_ab_keep_act_h100.json), so the ladder's first step, back
to `none`, costs 0 ms: the planner keeps the activation wherever the budget leaves room.
"""

from __future__ import annotations

from .simulation import StepModel

# Host cost of one kernel launch that a replay removes (cudaLaunchKernel / cuLaunchKernel plus
# PyTorch's dispatch of the op is more; 4-6 us is the launch alone on H100/H200-class hosts).
LAUNCH_US = 5.0
# Eager kernels of one scope's forward + backward. attn and mlp: non-view ATen ops counted
# with a TorchDispatchMode on the tiny profile (attn 122). moe: its norm/router/aux ops (~57)
# plus the permute-free path (RouteList build ~30 ops, 3 forward and ~10 backward launches).
LAUNCHES = {"attn": 120, "moe": 100, "mlp": 50}
FORWARD_SHARE = 0.5  # the forward's share of a scope's launches
# A kernel inside a graph still takes a few microseconds of GPU time however small it is: the
# floor of a captured recompute is its forward's kernels at this each.
KERNEL_MIN_US = 2.0
RECOMPUTE_TFLOPS = 400.0
NO_RERUN = ("none", "keep")  # the modes that re-run nothing


def forward_flops(model: StepModel, kind: str, mode: str) -> float:
    """One scope's forward FLOPs under `mode` (0 for none and keep), for one rank's tokens."""
    if mode in NO_RERUN:
        return 0.0
    c, run = model.prof.model, model.prof.run
    T, H = run.batch * run.seq_len, c.hidden_size
    if kind == "attn":
        dqk, dv = c.attn_head_dims
        q, kv, o = c.num_attention_heads * dqk, c.num_key_value_heads * (dqk + dv), \
            c.num_attention_heads * dv
        proj = 2 * T * H * (q + kv) + 2 * T * o * H
        sdpa = run.batch * run.seq_len ** 2 * c.num_attention_heads * (dqk + dv)
        return float(proj + sdpa)
    if kind == "mlp":
        return float(2 * T * 3 * c.intermediate_size * H)
    k, F, E = c.num_experts_per_tok, c.moe_intermediate_size, c.num_experts
    if mode == "fc1":
        return float(2 * T * k * 2 * F * H)
    return float(2 * T * E * H + 2 * T * k * 3 * F * H + 2 * T * 3 * c.shared_expert_width * H)


def recompute_ms(model: StepModel, kind: str, mode: str, captured: bool) -> float:
    """The extra time of one scope's recompute: its forward's FLOPs again, and its forward's
    launches where it runs eagerly; at least KERNEL_MIN_US for each of its kernels."""
    if mode in NO_RERUN:
        return 0.0
    ms = forward_flops(model, kind, mode) / (RECOMPUTE_TFLOPS * 1e12) * 1e3
    kernels = 1 if mode == "fc1" else LAUNCHES.get(kind, 0) * FORWARD_SHARE
    ms = max(ms, kernels * KERNEL_MIN_US / 1e3)
    return ms + (0.0 if captured else forward_launch_ms(kind, mode))


def forward_launch_ms(kind: str, mode: str) -> float:
    """The launches of a recomputed forward that runs eagerly (fc1: one kernel)."""
    if mode in NO_RERUN:
        return 0.0
    launches = 1 if mode == "fc1" else LAUNCHES.get(kind, 0) * FORWARD_SHARE
    return launches * LAUNCH_US / 1e3
