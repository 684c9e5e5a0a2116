"""The `attn` scope with multi-head latent attention (DeepSeek-V2/V3's MLA):
h = x + o_proj(attention(input_norm(x))).

Queries: `q_proj` (q_lora_rank null) or the low-rank `q_b_proj(q_a_norm(q_a_proj(y)))`, per
head [qk_nope_head_dim | qk_rope_head_dim]. Keys and values come from one latent:
`kv_a_proj_with_mqa(y)` = [kv latent (kv_lora_rank) | k_rot (qk_rope_head_dim, one head shared
by all)]; `kv_b_proj(kv_a_norm(latent))` gives per head [k_nope | v (v_head_dim)]. Rope acts on
the rope parts only (halves, or interleaved pairs with `rope_interleave`); the tables carry
yarn's attention factor and the softmax scale its mscale^2 (rope.softmax_scale). SDPA causal,
v zero-padded to the q/k head dim (or q/k to v's) so the fused kernels run, not the math
fallback that keeps the [S, S] weights. The latent norms use eps 1e-6, as
transformers' (it does not pass rms_norm_eps to them). Projections and norms write their
gradients through common.linear / common.norm, as every scope does.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from .linear import Linear
from .norm import RMSNorm
from .recompute import Scope
from .rope import apply_rope, apply_rope_interleaved, softmax_scale

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default


class MlaScope(Scope):
    kind = "attn"

    def __init__(self, cfg: ModelConfig, bias: bool = False):
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh
        self.nope, self.rot, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, \
            cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.q_lora_rank = cfg.q_lora_rank
        self.interleave = cfg.rope_interleave
        self.scale = softmax_scale(self.nope + self.rot, cfg.rope_scaling)
        qk = self.nope + self.rot
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, nh * qk, bias=False)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_rank + self.rot, bias=bias)
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(nh * self.v_dim, h, bias=bias)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the model

    def graph_state(self) -> tuple[torch.Tensor, ...]:
        """Tensors the forward reads besides inputs and parameters (checked by graph contracts)."""
        return tuple(self.rope) if self.rope is not None else ()

    def body(self, x_BSH: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x_BSH.shape
        nh = self.num_heads
        cos_SD, sin_SD = self.rope[0][:seq], self.rope[1][:seq]
        rope = apply_rope_interleaved if self.interleave else apply_rope
        y, skip = self.input_norm(x_BSH, skip=True)
        if self.q_lora_rank is None:
            q = self.q_proj(y)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(y)))
        q_BNSQ = q.view(batch, seq, nh, self.nope + self.rot).transpose(1, 2)
        q_pass, q_rot = torch.split(q_BNSQ, [self.nope, self.rot], dim=-1)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(y), [self.kv_rank, self.rot], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent))
        kv_BNSK = kv.view(batch, seq, nh, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v_BNSV = torch.split(kv_BNSK, [self.nope, self.v_dim], dim=-1)
        q_rot = rope(q_rot, cos_SD, sin_SD)
        k_rot = rope(k_rot.view(batch, 1, seq, self.rot), cos_SD, sin_SD)
        q_BNSQ = torch.cat((q_pass, q_rot), dim=-1)
        k_BNSQ = torch.cat((k_nope, k_rot.expand(batch, nh, seq, self.rot)), dim=-1)
        # One head dim for q, k and v: the fused SDPA kernels (flash on CPU and CUDA) need it;
        # zeros change neither q.k nor the first v_head_dim outputs.
        width = max(self.nope + self.rot, self.v_dim)
        q_BNSQ = F.pad(q_BNSQ, (0, width - q_BNSQ.shape[-1]))
        k_BNSQ = F.pad(k_BNSQ, (0, width - k_BNSQ.shape[-1]))
        v_BNSV = F.pad(v_BNSV, (0, width - self.v_dim))
        o = F.scaled_dot_product_attention(q_BNSQ, k_BNSQ, v_BNSV, is_causal=True,
                                           scale=self.scale)[..., :self.v_dim]
        o = o.transpose(1, 2).reshape(batch, seq, nh * self.v_dim)
        return self.o_proj(o, residual=skip)
