"""The loss's kernels alone on bf16 [T, V] logits: the two-kernel pair (cross_entropy_forward,
then cross_entropy_backward in place) against cross_entropy_fused (one pass: lse, loss and
dlogits over the logits), over the fused kernel's persistent grid and tile.

    python3 benchmarks/loss_kernels.py [--tokens 16384] [--vocab 151936] [--iters 10]
        [--programs-per-sm 1,2,4,8,0] [--blocks 8192] [--warps 8] [--out PATH]

`--programs-per-sm 0` is one program a row (no persistent loop). Each candidate is timed
on the same logits buffer (CUDA events, median of --iters after warm-up; the fused kernel
overwrites its input, which changes no memory traffic), and checked once against the pair on
a fresh copy: lse, loss and dlogits bitwise equal. bytes_per_ms is the pair's HBM floor
(three [T, V] streams for the pair, two for the fused kernel) over the time.

Prints the JSON and writes it to loss_kernels.json (--out; default $OUT/loss_kernels.json,
else benchmarks/results/loss_kernels.json), with the GPU, torch and Triton versions, commit
and date.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from common import default_out, environment, time_ms, write_json
import moegraph_kernels.cross_entropy as ce
from moegraph_kernels.cross_entropy import (cross_entropy_backward, cross_entropy_forward,
                                            cross_entropy_fused)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(default_out("loss_kernels.json")))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--programs-per-sm", type=ints, default=[1, 2, 4, 8, 0])
    ap.add_argument("--blocks", type=ints, default=[8192])
    ap.add_argument("--warps", type=ints, default=[8])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/loss_kernels.py: needs a CUDA GPU")
    T, V = args.tokens, args.vocab
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(T, V, device="cuda", generator=gen) * 4).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=gen)
    labels[4095::4096] = -100  # the causal shift's one ignored label a 4096-token sequence
    n_valid = (labels != -100).sum()
    grad = torch.tensor(1.0, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = T * V * logits.element_size()

    source = logits.clone()
    want = logits.clone()
    want_lse, want_loss = cross_entropy_forward(want, labels)
    cross_entropy_backward(want, labels, want_lse, grad, n_valid, out_TV=want)

    def pair():
        lse, _ = cross_entropy_forward(logits, labels)
        cross_entropy_backward(logits, labels, lse, grad, n_valid, out_TV=logits)

    pair_ms = time_ms(pair, args.warmup, args.iters)
    record = {"benchmark": "loss_kernels", **environment(), "tokens": T, "vocab": V,
              "sms": sms, "iters": args.iters,
              "pair": {"ms": pair_ms, "hbm_floor_gb_per_s": 3 * stream / pair_ms / 1e6},
              "fused": []}
    for block in args.blocks:
        for warps in args.warps:
            for per_sm in args.programs_per_sm:
                programs = T if per_sm == 0 else min(T, per_sm * sms)
                ce.FUSED_WARPS = warps

                def fused():
                    cross_entropy_fused(logits, labels, n_valid, 1.0, block_v=block,
                                        programs=programs)

                got = logits.copy_(source)
                lse, loss = cross_entropy_fused(got, labels, n_valid, 1.0, block_v=block,
                                                programs=programs)
                exact = bool(torch.equal(lse, want_lse) and torch.equal(loss, want_loss)
                             and torch.equal(got, want))
                ms = time_ms(fused, args.warmup, args.iters)
                record["fused"].append({
                    "block_v": block, "warps": warps, "programs_per_sm": per_sm,
                    "programs": programs, "ms": ms, "vs_pair": pair_ms / ms,
                    "hbm_floor_gb_per_s": 2 * stream / ms / 1e6, "bitwise_equal": exact})
    print(json.dumps(record, indent=2))
    write_json(args.out, record)
    print(f"pair {pair_ms:.3f} ms")
    for r in record["fused"]:
        print(f"fused block {r['block_v']:>6} warps {r['warps']:>2} programs {r['programs']:>6}"
              f" {r['ms']:.3f} ms  x{r['vs_pair']:.3f}  exact {r['bitwise_equal']}")


if __name__ == "__main__":
    main()
