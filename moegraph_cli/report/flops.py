"""Model FLOPs of a training step (for MFU) and the device's peak rate."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .summary import param_counts

# Dense bf16 tensor-core peak by device name (datasheet, FLOP/s). MFU is reported only for
# devices listed here.
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "B200": 2250e12}


def step_flops(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """6 * active matmul params * tokens (fwd + bwd) plus causal attention scores."""
    p = param_counts(cfg)
    matmul_params = p["active_per_token"] - p["embedding"] + (
        p["embedding"] if cfg.tie_word_embeddings else 0)
    tokens = batch * seq_len
    dense = 6.0 * matmul_params * tokens
    # Key positions summed over queries, doubled: S^2 for causal attention (the half of S x S,
    # times two), 2Sw - w^2 within a sliding window w < S (per layer: GPT-OSS mixes them).
    pairs = 0
    for i in range(cfg.num_hidden_layers):
        w = cfg.layer_window(i)
        pairs += seq_len * seq_len if w is None or w >= seq_len else 2 * seq_len * w - w * w
    qk_dim, v_dim = cfg.attn_head_dims
    attn = 3.0 * batch * pairs * \
        cfg.num_attention_heads * (qk_dim + v_dim)  # QK^T and PV, causal half, x3 fwd+bwd
    return dense + attn


def peak_flops(device: torch.device | None = None) -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, rate in PEAK_BF16.items():
        if key in name:
            return rate
    return None
