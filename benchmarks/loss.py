"""LM head + loss on one GPU: linear_cross_entropy (Triton CE kernels) vs F.linear + fp32 CE.

    python3 benchmarks/loss.py [--tokens 1024] [--vocab 151936] [--hidden 2048] [--iters 20]
        [--out PATH]

Paths, all bf16 x [T, H] and w [V, H] (w ~ N(0, 0.02)), labels with 10% ignored:
- `fp32_ce`: logits = F.linear(x, w), then F.cross_entropy(logits.float(), labels), the
  model's `causal_lm_loss` (its label shift is an O(T) pad and left out);
- `fused`: moegraph_cli.models.common.loss.linear_cross_entropy; `fused_inplace`: the same with
  inplace_backward=True (dlogits overwrite the logits).
Each is timed forward alone and forward + backward (dx and dW via torch.autograd.grad;
CUDA events, median of --iters after warm-up), and its peak memory over one forward +
backward is measured above what the inputs hold (torch.cuda.max_memory_allocated). dW is
[V, H] bf16 in every path (622 MB at Qwen3's shape) and counts in each peak. The fused
paths' loss, dx and dW are compared with fp32_ce's. This is the README's "no fp32 logits"
claim in numbers; the loss's share of a whole step is in benchmarks/whole_step.py's breakdown.

Prints the JSON and writes it to loss.json (--out; default $OUT/loss.json, else
benchmarks/results/loss.json), with the GPU, torch and Triton versions, commit and date.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from common import default_out, environment, time_ms, write_json
from moegraph_cli.models.common.loss import linear_cross_entropy


def fp32_ce(x, w, labels):
    logits = F.linear(x, w)
    return F.cross_entropy(logits.float(), labels, ignore_index=-100)


def fused(x, w, labels):
    return linear_cross_entropy(x, w, labels)[0]


def fused_inplace(x, w, labels):
    return linear_cross_entropy(x, w, labels, inplace_backward=True)[0]


PATHS = {"fp32_ce": fp32_ce, "fused": fused, "fused_inplace": fused_inplace}


def measure(name, fn, x, w, labels, warmup, iters):
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()

    def forward():
        with torch.no_grad():
            fn(xl, wl, labels)

    def step():
        torch.autograd.grad(fn(xl, wl, labels), [xl, wl])

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fn(xl, wl, labels)
    dx, dw = torch.autograd.grad(loss, [xl, wl])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    record = {"path": name, "loss": loss.item(), "peak_bytes": peak,
              "fwd_ms": time_ms(forward, warmup, iters),
              "fwd_bwd_ms": time_ms(step, warmup, iters)}
    return record, (loss.detach(), dx, dw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(default_out("loss.json")))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/loss.py: needs a CUDA GPU")
    T, V, H = args.tokens, args.vocab, args.hidden
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=gen)
    labels[::10] = -100

    record = {
        "benchmark": "loss", **environment(),
        "tokens": T, "vocab": V, "hidden": H, "iters": args.iters,
        "logits_bytes_bf16": T * V * 2, "logits_bytes_fp32": T * V * 4, "paths": [],
    }
    results = {}
    for name, fn in PATHS.items():
        rec, results[name] = measure(name, fn, x, w, labels, args.warmup, args.iters)
        record["paths"].append(rec)
    ref_loss, ref_dx, ref_dw = results["fp32_ce"]
    for rec in record["paths"]:
        loss, dx, dw = results[rec["path"]]
        rec["loss_rel_diff_vs_fp32_ce"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        rec["dx_max_diff_vs_fp32_ce"] = (dx.float() - ref_dx.float()).abs().max().item()
        rec["dw_max_diff_vs_fp32_ce"] = (dw.float() - ref_dw.float()).abs().max().item()
    print(json.dumps(record, indent=2))
    write_json(args.out, record)
    print(f"{'path':<14} {'fwd ms':>8} {'fwd+bwd ms':>11} {'peak MB':>9}")
    for rec in record["paths"]:
        print(f"{rec['path']:<14} {rec['fwd_ms']:>8.3f} {rec['fwd_bwd_ms']:>11.3f} "
              f"{rec['peak_bytes'] / 1e6:>9.1f}")


if __name__ == "__main__":
    main()
