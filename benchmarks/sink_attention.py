"""GPT-OSS attention with sinks: the formulation moegraph uses against the alternatives, on
the GPU at gpt-oss-20b's shapes (64 query heads, 8 KV heads expanded, head dim 64), for a
full layer and a sliding one (window 128): forward + backward ms (CUDA events, median) and
peak allocated bytes, each checked against the fp32 eager formula.

- `sdpa_sink_key` (moegraph_cli/models/common/sinks.py): stock SDPA with one extra key
  carrying the sink, lower-right causal or a boolean window mask;
- `eager` (transformers' eager_attention_forward with s_aux): scores, additive mask, the
  sink column, fp32 softmax, drop the column, times v;
- `sdpa_no_sink`: SDPA without sinks, the floor (not the model's semantics).

Run: python3 benchmarks/sink_attention.py --out $OUT/sink_attention.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_records  # noqa: E402

from moegraph_cli.train.harness import device_info  # noqa: E402
from moegraph_cli.models.common.sinks import sink_attention  # noqa: E402


def eager_sink_attention(q, k, v, sinks, scale, window):
    seq = q.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    i = torch.arange(seq, device=q.device)
    offset = i[:, None] - i[None, :]
    keep = offset >= 0
    if window is not None:
        keep = keep & (offset < window)
    scores = scores.masked_fill(~keep, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, seq, 1).to(scores.dtype)
    probs = torch.cat([scores, sink], dim=-1)
    probs = probs - probs.max(dim=-1, keepdim=True).values
    probs = F.softmax(probs, dim=-1, dtype=probs.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def no_sink(q, k, v, sinks, scale, window):
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    i = torch.arange(q.shape[2], device=q.device)
    offset = i[:, None] - i[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(offset >= 0) & (offset < window),
                                          scale=scale)


IMPLS = {"sdpa_sink_key": sink_attention, "eager": eager_sink_attention,
         "sdpa_no_sink": no_sink}


def fwd_bwd_ms(fn, tensors, iters=10):
    times = []
    for it in range(iters + 3):
        for t in tensors:
            t.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn().float().square().mean().backward()
        e.record()
        torch.cuda.synchronize()
        if it >= 3:
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default="benchmarks/results/sink_attention.json")
    args = ap.parse_args()
    dev, B, N, D, S = "cuda", 1, 64, 64, args.seq
    scale = D ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    base = [torch.randn(B, N, S, D, device=dev, generator=g) for _ in range(3)]
    sinks32 = torch.randn(N, device=dev, generator=g)
    records = []
    for window in (None, 128):
        ref = eager_sink_attention(*base, sinks32, scale, window)  # fp32 truth
        for name, impl in IMPLS.items():
            q, k, v = (t.bfloat16().requires_grad_() for t in base)
            sinks = sinks32.bfloat16().requires_grad_()
            rec = {"impl": name, "window": window, "seq": S, "heads": N, "head_dim": D,
                   **device_info()}
            try:
                out = impl(q, k, v, sinks, scale, window)
                rec["max_abs_vs_fp32_eager"] = (out.float() - ref).abs().max().item()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                rec["fwd_bwd_ms"] = fwd_bwd_ms(lambda: impl(q, k, v, sinks, scale, window),
                                               (q, k, v, sinks))
                rec["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
            except Exception as e:  # noqa: BLE001 - the record says what failed
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            records.append(rec)
            print(rec, flush=True)
    write_records(records, args.out)


if __name__ == "__main__":
    main()
