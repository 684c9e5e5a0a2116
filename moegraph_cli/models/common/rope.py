"""Rotary position embedding (HF "default" rope), with cos/sin precomputed per sequence length.

cos/sin are computed exactly as transformers does (fp32 `pos * inv_freq`, duplicated halves,
cast to the activation dtype), so the attention matches transformers' (Qwen3-MoE, Mixtral,
OLMoE, Qwen2-MoE: all "default" rope) bit for bit in fp32. They are plain tensors owned by the
model, which keeps them at a stable address: a captured attention graph reads them in place.
"""

import torch


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype,
                 device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                .to(device=device, dtype=torch.float) / head_dim))
    pos = torch.arange(seq_len, device=device, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    return x_BNSD * cos_SD + rotate_half(x_BNSD) * sin_SD
