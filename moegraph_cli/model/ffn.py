"""The `moe` scope (and its dense twin): y = h + ffn(post_norm(h)).

MoeScope: post norm, router (fp32 softmax, top-k, optional renormalisation), experts, combine,
residual. It returns the layer output and the layer's `[2, E]` load-balancing statistics, an
extra output so the scope stays a pure tensors-in/tensors-out unit that can be graphed.
The experts run through `reference_moe` (pure torch, the CPU path) or `permute_free_moe`
(Triton, sync-free, the CUDA path); both have one signature.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, MoeConfig
from ..moe.reference import reference_moe
from ..moe.routing import aux_stats, route
from .norm import RMSNorm


def experts_fn(backend: str, device: torch.device):
    """The expert implementation for a backend name; `auto` picks by device."""
    if backend == "auto":
        backend = "permute_free" if device.type == "cuda" else "reference"
    if backend == "permute_free":
        from ..moe.experts import permute_free_moe
        return permute_free_moe
    return reference_moe


class MoeScope(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoeConfig):
        super().__init__()
        e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.capacity_factor = moe.capacity
        self.backend = moe.backend
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.router = nn.Linear(h, e, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * f, h))
        self.w_down = nn.Parameter(torch.empty(e, h, f))

    def forward(self, h_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = h_BSH.shape
        x_TH = self.post_norm(h_BSH).view(batch * seq, hidden)
        topk_ids_TK, topk_weights_TK, probs_TE = route(
            x_TH, self.router.weight, self.top_k, self.norm_topk_prob)
        experts = experts_fn(self.backend, x_TH.device)
        y_TH = experts(x_TH, topk_ids_TK, topk_weights_TK, self.w_gate_up, self.w_down,
                       self.capacity_factor)
        return h_BSH + y_TH.view(batch, seq, hidden), aux_stats(topk_ids_TK, probs_TE)


class DenseMlpScope(nn.Module):
    """A layer listed in mlp_only_layers: SwiGLU MLP of width intermediate_size."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, h_BSH: torch.Tensor) -> torch.Tensor:
        y = self.post_norm(h_BSH)
        return h_BSH + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
