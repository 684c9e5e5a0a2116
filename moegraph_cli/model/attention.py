"""The `attn` scope: h = x + o_proj(attention(input_norm(x))).

Qwen3 attention: q/k/v projections, per-head RMSNorm on q and k *before* RoPE, SDPA causal
with grouped KV heads, o projection. The scope is one graphable unit: tensors in, tensors
out, parameters and the rope tables owned by the module.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .linear import Linear
from .norm import RMSNorm
from .rope import apply_rope


class AttentionScope(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, qd, kvd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
            cfg.num_key_value_heads * cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = Linear(h, qd, bias=False)
        self.k_proj = Linear(h, kvd, bias=False)
        self.v_proj = Linear(h, kvd, bias=False)
        self.o_proj = Linear(qd, h, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the model

    def graph_state(self) -> tuple[torch.Tensor, ...]:
        """Tensors the forward reads besides inputs and parameters (checked by graph contracts)."""
        return tuple(self.rope) if self.rope is not None else ()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x_BSH.shape
        cos_SD, sin_SD = self.rope
        y = self.input_norm(x_BSH)
        q = self.q_norm(self.q_proj(y).view(batch, seq, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(y).view(batch, seq, self.num_kv_heads, self.head_dim))
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(y).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos_SD[:seq], sin_SD[:seq]), apply_rope(k, cos_SD[:seq], sin_SD[:seq])
        if self.num_kv_heads != self.num_heads:
            # Expanded rather than `enable_gqa=True`: the fused SDPA kernels then run on every
            # torch we support, and the expand is a view until SDPA reads it.
            rep = self.num_heads // self.num_kv_heads
            k = k[:, :, None].expand(batch, self.num_kv_heads, rep, seq, self.head_dim) \
                .reshape(batch, self.num_heads, seq, self.head_dim)
            v = v[:, :, None].expand(batch, self.num_kv_heads, rep, seq, self.head_dim) \
                .reshape(batch, self.num_heads, seq, self.head_dim)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim ** -0.5)
        o = o.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return x_BSH + self.o_proj(o)
