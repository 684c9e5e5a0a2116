"""The `attn` scope: h = x + o_proj(attention(input_norm(x))).

q/k/v projections (optional biases, and on o), then the family's q/k treatment before RoPE:
RMSNorm per head (`qk_norm="head"`, Qwen3), RMSNorm over the whole projection (`"proj"`,
OLMoE) or none; optional clamping of q/k/v to +-clip_qkv (OLMoE); SDPA causal with grouped KV
heads, within a sliding window when one is set (Mixtral); with `sinks`, a learned logit per
head in every softmax row (GPT-OSS; common/sinks.py); o projection. The scope is one
graphable unit: tensors in, tensors out, parameters and the rope tables owned by the module.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from . import fused
from .linear import Linear, projections
from .norm import RMSNorm
from .recompute import Scope
from .rope import apply_rope
from .sinks import sink_attention

# Grouped K/V heads: "native" (default) hands SDPA the grouped heads (`enable_gqa=True`) on the
# plain causal path; "expand" repeats them to the query heads first, in q's layout (the sinks
# and sliding-window paths always do). MOEGRAPH_ATTN_GQA. On an H200 (torch 2.11) native is the
# faster (benchmarks/results/attention_scope_gqa.json), and neither is deterministic: SDPA's
# flash and cuDNN backwards accumulate dq in an order that varies from run to run
# (attention_det.json), so attention's input gradients may differ in the last bits between
# two runs of the same step.
GQA = os.environ.get("MOEGRAPH_ATTN_GQA", "native")


class AttentionScope(Scope):
    kind = "attn"

    def __init__(self, cfg: ModelConfig, qk_norm: str | None = "head", qkv_bias: bool = False,
                 o_bias: bool = False, clip_qkv: float | None = None,
                 sliding_window: int | None = None, sinks: bool = False):
        super().__init__()
        if qk_norm not in ("head", "proj", None):
            raise ValueError(f"qk_norm must be 'head', 'proj' or None, got {qk_norm!r}")
        self.qk_norm = qk_norm
        self.clip_qkv = clip_qkv
        self.sliding_window = sliding_window
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, qd, kvd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
            cfg.num_key_value_heads * cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = Linear(h, qd, bias=qkv_bias)
        self.k_proj = Linear(h, kvd, bias=qkv_bias)
        self.v_proj = Linear(h, kvd, bias=qkv_bias)
        self.o_proj = Linear(qd, h, bias=o_bias)
        if qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif qk_norm == "proj":
            self.q_norm = RMSNorm(qd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kvd, cfg.rms_norm_eps)
        self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads)) if sinks else None
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the model

    def graph_state(self) -> tuple[torch.Tensor, ...]:
        """Tensors the forward reads besides inputs and parameters (checked by graph contracts)."""
        return tuple(self.rope) if self.rope is not None else ()

    def body(self, x_BSH: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x_BSH.shape
        cos_SD, sin_SD = self.rope
        y, skip = self.input_norm(x_BSH, skip=True)
        q, k, v = projections(y, (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos_SD, sin_SD = cos_SD[:seq], sin_SD[:seq]
        head_norm = self.qk_norm == "head"
        if fused.rope_active(q, cos_SD, self.q_norm.weight if head_norm else None):
            # One kernel each for q and k: [per-head RMSNorm,] rope, written as [B, N, S, D].
            if head_norm:
                q = fused.rope(q, cos_SD, sin_SD, self.q_norm.weight, self.q_norm.eps)
                k = fused.rope(k, cos_SD, sin_SD, self.k_norm.weight, self.k_norm.eps)
            else:
                q, k = fused.rope(q, cos_SD, sin_SD), fused.rope(k, cos_SD, sin_SD)
        else:
            if head_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q, k = apply_rope(q, cos_SD, sin_SD), apply_rope(k, cos_SD, sin_SD)
        scale = self.head_dim ** -0.5
        windowed = self.sliding_window is not None and seq > self.sliding_window
        grouped = self.num_kv_heads != self.num_heads
        # SDPA's own grouped heads: the plain causal call only
        native = grouped and GQA == "native" and self.sinks is None and not windowed
        if grouped and not native:
            rep = self.num_heads // self.num_kv_heads
            k, v = expand_heads(k, rep, like=q), expand_heads(v, rep, like=q)
        if self.sinks is not None:
            o = sink_attention(q, k, v, self.sinks, scale, self.sliding_window)
        elif windowed:
            # Query i sees keys i - window < j <= i (transformers' sliding-window mask).
            i = torch.arange(seq, device=q.device)
            offset = i[:, None] - i[None, :]
            mask = (offset >= 0) & (offset < self.sliding_window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=native)
        o = o.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(o, residual=skip)


def expand_heads(x_BNSD: torch.Tensor, rep: int, like: torch.Tensor) -> torch.Tensor:
    """x [B, Nkv, S, D] with each head repeated `rep` times, [B, Nkv * rep, S, D], in the
    memory layout of `like`: the [B, N, S, D] view of a contiguous [B, S, N, D] tensor when
    `like` is one (so SDPA reads q, k and v alike), else contiguous [B, N, S, D]."""
    B, Nkv, S, D = x_BNSD.shape
    if like.dim() == 4 and like.transpose(1, 2).is_contiguous() and not like.is_contiguous():
        x = x_BNSD.transpose(1, 2)[:, :, :, None].expand(B, S, Nkv, rep, D)
        return x.reshape(B, S, Nkv * rep, D).transpose(1, 2)
    return x_BNSD[:, :, None].expand(B, Nkv, rep, S, D).reshape(B, Nkv * rep, S, D)
