"""Rotary position embedding, with cos/sin precomputed per sequence length.

cos/sin are computed exactly as transformers does (fp32 `pos * inv_freq`, duplicated halves,
times the rope's attention factor, cast to the activation dtype), so the attention matches
transformers' bit for bit in fp32. Two frequency rules: HF "default" (Qwen3-MoE, Mixtral,
OLMoE, Qwen2-MoE) and "yarn" (`rope_scaling`, DeepSeek-V3: NTK-by-parts interpolation and an
attention factor from `mscale` / `mscale_all_dim`, as transformers' `_compute_yarn_parameters`).
Two layouts: halves (`apply_rope`) and interleaved pairs (`apply_rope_interleaved`, DeepSeek's
`rope_interleave`). The tables are plain tensors owned by the model, which keeps them at a
stable address: a captured attention graph reads them in place. On CUDA the attention scope
runs the halves rope (with the per-head q/k norm before it) as one Triton kernel each way
(fused.py, kernels/rope.py), with these functions' roundings.
"""

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  max_position_embeddings: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32, attention factor) of the default or yarn rope."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return 1.0 / (theta ** exponents), 1.0
    factor = scaling.get("factor")
    original = scaling["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale)
                                     / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low),
                       0, 1)
    pos_freqs = theta ** exponents
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """DeepSeek's attention scale: qk_head_dim^-0.5, times mscale^2 under yarn with
    `mscale_all_dim` (transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        if scaling.get("mscale_all_dim"):
            m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
            scale = scale * m * m
    return scale


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype, device,
                 scaling: dict | None = None, max_position_embeddings: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    inv_freq = inv_freq.to(device)
    pos = torch.arange(seq_len, device=device, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    return x_BNSD * cos_SD + rotate_half(x_BNSD) * sin_SD


def apply_rope_interleaved(x_BNSD: torch.Tensor, cos_SD: torch.Tensor,
                           sin_SD: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... each rotated by one frequency; the output holds the
    rotated even elements then the odd ones (transformers' apply_rotary_pos_emb_interleave)."""
    half = cos_SD.shape[-1] // 2
    cos, sin = cos_SD[..., :half], sin_SD[..., :half]
    x1, x2 = x_BNSD[..., 0::2], x_BNSD[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
