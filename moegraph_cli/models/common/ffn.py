"""The `moe` scope (and its dense twin): y = h + ffn(post_norm(h)).

MoeScope: post norm, router (fp32 softmax, top-k, optional renormalisation; or DeepSeek-V3's
`router="sigmoid_grouped"`: sigmoid scores, group-limited top-k chosen with the
`e_score_correction_bias` buffer, scaled weights; or GPT-OSS's `router="topk_softmax"`: a
biased router, softmax over the top-k logits), experts (with `bias`, GPT-OSS: biases on both
projections, `b_gate_up` [E, 2F] in the [gate | up] halves order and `b_down` [E, H], and the
experts' activation `act`, moe/activation.py), combine, optional shared expert (a
SwiGLU every token passes through, scaled by `sigmoid(shared_expert_gate(x))` (Qwen2-MoE) or
ungated (`shared_gate=False`, DeepSeek-V3), added to the routed experts' output), residual.
With `moe.bias_update_rate` > 0 the grouped router also counts its routes per expert on the
device (`expert_load`); `update_router_bias_` applies the bias rule after the step. It
returns the layer output and the layer's `[2, E]` load-balancing statistics, an extra output
so the scope stays a pure tensors-in/tensors-out unit that can be graphed. Without a shared
expert the post norm hands the router and the experts each its own output, and its backward
kernel sums their two gradients (norm.rms_norm_fork, MOEGRAPH_NORM_FORK).
The experts run through `reference_experts` (pure torch, the CPU path) or
`permute_free_experts` (Triton, sync-free, the CUDA path); both have one signature. Without
EP or a shared expert the residual is handed to them (`residual=`): the permute-free combine
kernel adds it in the same pass, the same bits as the add after (MOEGRAPH_COMBINE_RESIDUAL).
With expert parallelism (`ep`) the scope holds only its EP rank's experts and the dispatch
and combine collectives run inside it (moe/ep.py), so a captured moe graph contains them; the
rows the bounded all-to-all could not send are added to `ep_overflow_rows` on the device (the
distributed trainer reads it after the backward and redoes such a step).
Routes dropped by capacity are counted on the device in `dropped_routes` (no sync).
"""

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from ... import grads
from ...config import ModelConfig, MoeConfig
from ...moe.activation import SWIGLU, ExpertAct
from ...moe.ep import EpGroup, ep_moe
from ...moe.ep_sizing import dispatch_kind
from ...moe.reference import reference_experts
from ...moe.routing import (aux_stats, expert_load_E, local_dispatch, route, route_grouped,
                            route_topk_softmax, update_correction_bias_)
from .linear import Linear
from .norm import RMSNorm
from .recompute import Scope, recomputing


# MOEGRAPH_COMBINE_RESIDUAL=0: the MoE layer's residual add runs after the experts, as its
# own elementwise pass, instead of inside their combine (the same bits either way).
COMBINE_RESIDUAL = os.environ.get("MOEGRAPH_COMBINE_RESIDUAL", "1") not in ("0", "")


def experts_fn(backend: str, device: torch.device, mode: str = "none"):
    """The expert implementation for a backend name; `auto` picks by device. `mode`, the MoE
    scope's recompute mode: `fc1`, the experts keep no FC1 output for their backward and re-run
    FC1 there; `keep`, they keep FC1's activation too (the permute-free path; see
    moe/experts.PermuteFreeMoE)."""
    if backend == "auto":
        backend = "permute_free" if device.type == "cuda" else "reference"
    if backend == "permute_free":
        from ...moe.experts import permute_free_experts
        fn = permute_free_experts
    else:
        fn = reference_experts
    if mode == "fc1":
        return functools.partial(fn, recompute_fc1=True)
    return functools.partial(fn, keep_act=True) if mode == "keep" else fn


class MoeScope(Scope):
    kind = "moe"

    def __init__(self, cfg: ModelConfig, moe: MoeConfig, ep: EpGroup | None = None,
                 router: str = "softmax", shared_gate: bool = True, bias: bool = False,
                 act: ExpertAct | None = None):
        super().__init__()
        if router not in ("softmax", "sigmoid_grouped", "topk_softmax"):
            raise ValueError(f"router must be 'softmax', 'sigmoid_grouped' or 'topk_softmax', "
                             f"got {router!r}")
        e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        local = e if ep is None else ep.num_local
        self.ep = ep
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.capacity_factor = moe.capacity
        self.backend = moe.backend
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.topk_softmax = router == "topk_softmax"
        self.router = nn.Linear(h, e, bias=self.topk_softmax)
        self.w_gate_up = nn.Parameter(torch.empty(local, 2 * f, h))
        self.w_down = nn.Parameter(torch.empty(local, h, f))
        self.b_gate_up = nn.Parameter(torch.empty(local, 2 * f)) if bias else None
        self.b_down = nn.Parameter(torch.empty(local, h)) if bias else None
        self.act = act
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_width > 0:
            self.shared_expert = SwiGLU(h, cfg.shared_expert_width)
            if shared_gate:
                self.shared_expert_gate = Linear(h, 1, bias=False)
        self.grouped = router == "sigmoid_grouped"
        self.bias_update_rate = 0.0
        if self.grouped:
            self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
            self.routed_scaling_factor = cfg.routed_scaling_factor
            self.bias_update_rate = moe.bias_update_rate
            # A buffer (in the checkpoint, never trained): it moves the choice of experts.
            # fp32 whatever the model dtype, as transformers keeps it (small bias updates
            # would round away in bf16); the state dict holds it in the model's dtype, as a
            # checkpoint holds one dtype.
            self.register_buffer("e_score_correction_bias", torch.zeros(e))
            self.register_buffer("expert_load", torch.zeros(e, dtype=torch.float32),
                                 persistent=False)
            self._register_state_dict_hook(_bias_in_model_dtype)
            self.register_load_state_dict_post_hook(lambda module, _keys: module._fp32_bias())
        self.register_buffer("dropped_routes", torch.zeros(1, dtype=torch.int64),
                             persistent=False)
        self.ep_dispatch, self.ep_capacity_factor = moe.ep_dispatch, moe.ep_capacity_factor
        if ep is not None:
            self.register_buffer("ep_overflow_rows", torch.zeros(1, dtype=torch.int64),
                                 persistent=False)
            self.ep_bounded: bool | None = None  # takes the all-to-all (set by the shapes)

    def _fp32_bias(self) -> None:
        """The router's bias and load count stay fp32 through `.to(dtype)` and loading."""
        for name in ("e_score_correction_bias", "expert_load"):
            buf = self._buffers.get(name)
            if buf is not None and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._fp32_bias()
        return out

    def body(self, h_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = h_BSH.shape
        if self.shared_expert is None:
            # The router and the experts read the norm's output: each its own, so the norm's
            # backward kernel sums their gradients (norm.rms_norm_fork).
            y_BSH, yr_BSH, skip = self.post_norm(h_BSH, skip=True, fork=True)
        else:
            y_BSH, skip = self.post_norm(h_BSH, skip=True)
            yr_BSH = y_BSH
        x_TH = y_BSH.view(batch * seq, hidden)
        xr_TH = yr_BSH.view(batch * seq, hidden)  # the router's operand
        if self.grouped:
            topk_ids_TK, topk_weights_TK, probs_TE = route_grouped(
                xr_TH, grads.through(self.router.weight), self.e_score_correction_bias,
                self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
                self.routed_scaling_factor)
            if self.bias_update_rate > 0 and not recomputing():
                self.expert_load.add_(expert_load_E(topk_ids_TK, self.expert_load.shape[0]))
        elif self.topk_softmax:
            topk_ids_TK, topk_weights_TK, probs_TE = route_topk_softmax(
                xr_TH, grads.through(self.router.weight), grads.through(self.router.bias),
                self.top_k)
        else:
            topk_ids_TK, topk_weights_TK, probs_TE = route(
                xr_TH, grads.through(self.router.weight), self.top_k, self.norm_topk_prob)
        experts = experts_fn(self.backend, x_TH.device, self.recompute)
        if self.ep is not None:
            kind = dispatch_kind(self.ep.size, x_TH.shape[0], self.top_k, self.ep.num_experts,
                                 self.ep_capacity_factor, self.ep_dispatch)
            self.ep_bounded = kind == "all_to_all"
            over = torch.zeros_like(self.ep_overflow_rows) if recomputing() \
                else self.ep_overflow_rows
            y_TH, dropped = ep_moe(x_TH, topk_ids_TK, topk_weights_TK, self.w_gate_up,
                                   self.w_down, self.capacity_factor, self.ep, experts,
                                   b_gate_up_local=self.b_gate_up, b_down_local=self.b_down,
                                   act=self.act, dispatch=kind,
                                   ep_capacity_factor=self.ep_capacity_factor,
                                   overflow_rows=over)
        else:
            dispatch = local_dispatch(topk_ids_TK, topk_weights_TK, self.w_gate_up.shape[0],
                                      self.capacity_factor)
            # Without a shared expert the residual add rides the experts' combine (the same
            # bits as adding it here, one pass over [T, H] fewer); with one, skip + (experts +
            # shared) keeps its order below.
            fold = COMBINE_RESIDUAL and self.shared_expert is None
            y_TH = experts(x_TH, topk_ids_TK, topk_weights_TK, self.w_gate_up, self.w_down,
                           dispatch, b_gate_up=self.b_gate_up, b_down=self.b_down,
                           act=self.act or SWIGLU, residual=skip if fold else None)
            if fold:
                skip = None
            dropped = None if dispatch.keep_TK is None else (~dispatch.keep_TK).sum()
        if dropped is not None and not recomputing():
            self.dropped_routes.add_(dropped.reshape(1))
        if self.shared_expert_gate is not None:
            y_TH = y_TH + torch.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
        elif self.shared_expert is not None:
            y_TH = y_TH + self.shared_expert(x_TH)
        y_BSH = y_TH.view(batch, seq, hidden)
        return y_BSH if skip is None else skip + y_BSH, aux_stats(topk_ids_TK, probs_TE)


def _bias_in_model_dtype(module, state_dict, prefix, _metadata):
    key = prefix + "e_score_correction_bias"
    if key in state_dict:
        state_dict[key] = state_dict[key].to(module.post_norm.weight.dtype)


@torch.no_grad()
def update_router_bias_(model: nn.Module) -> None:
    """After an optimizer step, outside any graph: every grouped router with a bias update
    rate moves its correction bias by the load it counted since the last call (on the device,
    no sync), and its count restarts. A model without such routers is left alone."""
    for module in model.modules():
        if isinstance(module, MoeScope) and module.bias_update_rate > 0:
            update_correction_bias_(module.e_score_correction_bias, module.expert_load,
                                    module.bias_update_rate)
            module.expert_load.zero_()


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = Linear(hidden, width, bias=False)
        self.up_proj = Linear(hidden, width, bias=False)
        self.down_proj = Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DenseMlpScope(Scope):
    kind = "mlp"

    """A layer listed in mlp_only_layers: SwiGLU MLP of width intermediate_size."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = Linear(h, i, bias=False)
        self.up_proj = Linear(h, i, bias=False)
        self.down_proj = Linear(i, h, bias=False)

    def body(self, h_BSH: torch.Tensor) -> torch.Tensor:
        y, skip = self.post_norm(h_BSH, skip=True)
        return self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y), residual=skip)
