"""Attention with a learned sink logit per head (GPT-OSS), through stock SDPA.

transformers' GptOssAttention appends one logit per head, `sinks[h]`, to every softmax row and
drops its column after the softmax: the row's weights sum to less than one by
exp(sink) / (exp(sink) + sum exp(scores)). Here that column is one extra key, put first:

    q' = [q | 1 | 0...]   k_sink = [0... | sink_h / scale | 0...]   v_sink = 0
    k' = [k | 0 | 0...]   for the real keys (the head dim padded by PAD to stay a multiple of 8)

so q'.k_sink * scale = sink_h exactly where scale is a power of two (head_dim 64: 1/8), and
within an ulp otherwise, q'.k' = q.k, and the sink key adds nothing to the output. Query i sees
the sink and real keys j <= i (within the window): with the sink first that is SDPA's
lower-right causal alignment over S + 1 keys (`causal_lower_right`, which the fused CUDA
kernels take), or a boolean [S, S + 1] mask for a sliding window.

Why this and not the alternatives: an additive float mask carrying the sink as its last
column is [heads, S, S + 1] per call (2 GiB in bf16 at 64 heads and S = 4096) and costs a
materialised gradient; FlexAttention is capturable but its backward needs torch.compile and
gives a score_mod no gradient path to a per-head parameter on every torch we support. Here
shapes are static (capturable), the sink's gradient is SDPA's own dK of the sink key, and the
fused kernels still run; the price is PAD extra head dims (+12.5% attention FLOPs at 64).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ... import grads

PAD = 8  # extra head dims carrying the sink's logit (8 keeps the fused kernels' alignment)


def sink_attention(q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor,
                   sinks_N: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """softmax([q.k * scale (causal, within `window`) | sinks]) without the sink column, times
    v: transformers' eager_attention_forward with s_aux. q/k/v already have one head each."""
    batch, heads, seq, dim = q_BNSD.shape
    sink_BN11 = (grads.through(sinks_N).to(q_BNSD.dtype) / scale).view(1, heads, 1, 1) \
        .expand(batch, heads, 1, 1)
    one = q_BNSD.new_ones(batch, heads, seq, 1)
    q = torch.cat((q_BNSD, F.pad(one, (0, PAD - 1))), dim=-1)
    k_sink = F.pad(torch.cat((k_BNSD.new_zeros(batch, heads, 1, dim), sink_BN11), dim=-1),
                   (0, PAD - 1))
    k = torch.cat((k_sink, F.pad(k_BNSD, (0, PAD))), dim=2)
    v = F.pad(v_BNSD, (0, PAD, 1, 0))  # a zero value for the sink key, zero-padded dims
    if window is not None and seq > window:
        i = torch.arange(seq, device=q.device)
        offset = i[:, None] - i[None, :]
        mask = F.pad((offset >= 0) & (offset < window), (1, 0), value=True)
    else:
        mask = causal_lower_right(seq, seq + 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[..., :dim]
