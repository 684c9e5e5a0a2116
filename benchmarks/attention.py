"""SDPA's backends on the attention of the 4-layer Qwen3-30B slice at load, forward + backward.

    python3 benchmarks/attention.py [--batch 4] [--seq 4096] [--heads 32] [--kv-heads 4]
        [--head-dim 128] [--repeats 6] [--torch-deterministic] [--rounds 7] [--out PATH]

Causal attention, bf16, q [B, N, S, D] with grouped K/V heads, as the `attn` scope calls it:
K/V expanded to N heads (`expand`, the product's layout), and with `enable_gqa=True` (K/V at
their own head count). Per (backend, layout): forward and forward + backward ms (CUDA events
around `reps` back-to-back calls, the median of `--rounds`), TFLOP/s of the causal FLOPs
(forward 2 x 2 B N S^2 D / 2, backward 2.5 times that), whether `--repeats` backward runs are
bitwise equal (`deterministic`, and `differed`: which of dq, dk, dv did not), and the max |diff|
of out and dq against the first backend that ran. `--torch-deterministic` runs it all under
torch.use_deterministic_algorithms(True, warn_only=True).
The backends: flash, cuDNN, memory-efficient, each forced through `sdpa_kernel`; a backend that
refuses the case is recorded with its error.

Writes attention.json (--out; default $OUT/attention.json).
"""

from __future__ import annotations

import argparse

from common import default_out, environment, error_text, throughput_ms, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--torch-deterministic", action="store_true")
    ap.add_argument("--out", default=str(default_out("attention.json")))
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if args.torch_deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    B, N, KV, S, D = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, N, S, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    k = torch.randn(B, KV, S, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    v = torch.randn(B, KV, S, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    do = torch.randn(B, N, S, D, device="cuda", generator=gen).bfloat16()
    fwd_flops = 2 * 2 * B * N * S * S * D / 2
    rep = N // KV

    def call(layout):
        if layout == "expand":
            kk = k[:, :, None].expand(B, KV, rep, S, D).reshape(B, N, S, D)
            vv = v[:, :, None].expand(B, KV, rep, S, D).reshape(B, N, S, D)
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    doc = {**environment(), "shape": dict(B=B, N=N, KV=KV, S=S, D=D),
           "torch_deterministic": args.torch_deterministic, "records": []}
    ref = None
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, backend in backends.items():
        for layout in ("expand", "gqa"):
            rec = dict(backend=name, layout=layout)
            try:
                with sdpa_kernel([backend]):
                    def fwd():
                        with torch.no_grad():
                            call(layout)

                    def fwd_bwd():
                        return torch.autograd.grad(call(layout), (q, k, v), do)

                    out = call(layout).detach()
                    g1 = fwd_bwd()
                    differ = set()
                    for _ in range(args.repeats - 1):
                        g2 = fwd_bwd()
                        differ |= {n for n, a, b in zip(("dq", "dk", "dv"), g1, g2)
                                   if not torch.equal(a, b)}
                    torch.cuda.synchronize()
                    rec["deterministic"] = not differ
                    rec["differed"] = sorted(differ)
                    if ref is None:
                        ref = (out, g1[0])
                    rec["max_abs_out"] = (out.float() - ref[0].float()).abs().max().item()
                    rec["max_abs_dq"] = (g1[0].float() - ref[1].float()).abs().max().item()
                    rec["fwd_ms"] = throughput_ms(fwd, reps=5, rounds=args.rounds)
                    rec["fwd_bwd_ms"] = throughput_ms(fwd_bwd, reps=5, rounds=args.rounds)
                    rec["fwd_tflops"] = fwd_flops / rec["fwd_ms"] / 1e9
                    rec["fwd_bwd_tflops"] = 3.5 * fwd_flops / rec["fwd_bwd_ms"] / 1e9
            except Exception as exc:  # a backend that refuses the case: recorded
                rec["error"] = error_text(exc)
            doc["records"].append(rec)
            write_json(args.out, doc)
            print(f"{name:10s} {layout:7s} fwd {rec.get('fwd_ms', float('nan')):7.3f} ms "
                  f"fwd+bwd {rec.get('fwd_bwd_ms', float('nan')):7.3f} ms "
                  f"({rec.get('fwd_bwd_tflops', float('nan')):5.1f} TF/s) "
                  f"det={rec.get('deterministic')} {rec.get('error', '')}", flush=True)


if __name__ == "__main__":
    main()
