"""LM head + loss on one GPU: linear_cross_entropy (Triton CE kernels) vs F.linear + fp32 CE.

    python benchmarks/loss.py --out PATH [--tokens 1024] [--vocab 151936] [--hidden 2048]
        [--iters 20] [--sweep]

Paths, all bf16 x [T, H] and w [V, H] (w ~ N(0, 0.02)), labels with 10% ignored:
- `fp32_ce`: logits = F.linear(x, w), then F.cross_entropy(logits.float(), labels), the
  model's `causal_lm_loss` (its label shift is an O(T) pad and left out);
- `fused`: moegraph_cli.train.loss.linear_cross_entropy; `fused_inplace`: the same with
  inplace_backward=True (dlogits overwrite the logits).
Each is timed forward alone and forward + backward (dx and dW via torch.autograd.grad;
CUDA events, median of --iters after warm-up), and its peak memory over one forward +
backward is measured above what the inputs hold (torch.cuda.max_memory_allocated). dW is
[V, H] bf16 in every path (622 MB at Qwen3's shape) and counts in each peak.
--sweep times the two CE kernels alone over a few block sizes and warp counts first.
Prints the JSON record and writes it to --out, with the GPU, torch and triton versions and
the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from common import time_ms  # noqa: E402
from moegraph_cli.train.loss import linear_cross_entropy  # noqa: E402
from moegraph_kernels.cross_entropy import (_ce_bwd_kernel, _ce_fwd_kernel,  # noqa: E402
                                            cross_entropy_forward)


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


def sweep(x, w, labels, warmup, iters):
    """Each CE kernel alone on the bf16 logits, over block sizes and warp counts."""
    logits = F.linear(x, w)
    num_rows, vocab = logits.shape
    lse, _ = cross_entropy_forward(logits, labels)
    loss = torch.empty_like(lse)
    grad_loss = torch.ones((), device=x.device)
    n_valid = (labels != -100).sum()
    out = torch.empty_like(logits)
    gbytes = logits.numel() * logits.element_size() / 1e9
    rows = []
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16, 32):
            if warps * 32 * 2 > block:
                continue
            fwd = time_ms(lambda: _ce_fwd_kernel[(num_rows,)](
                logits, labels, lse, loss, vocab, logits.stride(0), -100,
                BLOCK_V=block, num_warps=warps), warmup, iters)
            bwd = time_ms(lambda: _ce_bwd_kernel[(num_rows, triton.cdiv(vocab, block))](
                logits, out, labels, lse, grad_loss, n_valid, vocab, logits.stride(0),
                out.stride(0), -100, BLOCK_V=block, num_warps=warps), warmup, iters)
            rows.append({"block_v": block, "num_warps": warps, "fwd_ms": fwd, "bwd_ms": bwd,
                         "fwd_GBps": gbytes / fwd * 1e3, "bwd_GBps": 2 * gbytes / bwd * 1e3})
            print(json.dumps(rows[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
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
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "tokens": T, "vocab": V, "hidden": H, "iters": args.iters,
        "logits_bytes_bf16": T * V * 2, "logits_bytes_fp32": T * V * 4, "paths": [],
    }
    if args.sweep:
        record["sweep"] = sweep(x, w, labels, args.warmup, args.iters)
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'path':<14} {'fwd ms':>8} {'fwd+bwd ms':>11} {'peak MB':>9}")
    for rec in record["paths"]:
        print(f"{rec['path']:<14} {rec['fwd_ms']:>8.3f} {rec['fwd_bwd_ms']:>11.3f} "
              f"{rec['peak_bytes'] / 1e6:>9.1f}")


if __name__ == "__main__":
    main()
