"""The `attn` scope of a profile's first layer at load, forward + backward, per rope layout and
rope-backward tiling: where the attention part of the loaded step goes besides SDPA.

    python3 benchmarks/attention_scope.py [--profile qwen3-30b-a3b-4layer] [--batch 4]
        [--seq 4096] [--gqa expand,native] [--layouts bnsd,bsnd] [--bwd ROWSxPROGRAMS_PER_SM,...]
        [--repeats 4] [--torch-deterministic] [--rounds 7] [--out PATH]

The scope (input norm, q/k/v projections, per-head q/k norm + rope, K/V expansion, SDPA,
o projection, residual) in bf16 on one GPU, its input x [B, S, H] and a fixed output
gradient. Per (gqa, layout, rope backward tiling): forward + backward ms (CUDA events around
`reps` back-to-back calls, the median of `--rounds`), the GPU ms of one call per kernel
(profiler, largest first), whether the output and every gradient are bitwise those of the
first variant, and whether `--repeats` runs are bitwise equal (`deterministic`, with the
tensors that differed). `gqa` is attention.GQA (K/V heads expanded, or SDPA's enable_gqa),
`layout` kernels/rope.py's output layout (fused.ROPE_LAYOUT), `bwd` its backward's rows per
block x programs per SM. `--torch-deterministic` runs under
torch.use_deterministic_algorithms(True, warn_only=True).

Writes attention_scope.json (--out; default $OUT/attention_scope.json).
"""

from __future__ import annotations

import argparse

from common import default_out, environment, error_text, kernel_ms, throughput_ms, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="qwen3-30b-a3b-4layer")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--gqa", default="expand")
    ap.add_argument("--layouts", default="bnsd,bsnd")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--torch-deterministic", action="store_true")
    ap.add_argument("--bwd", default="16x2,32x8", help="rope backward ROWSxPROGRAMS_PER_SM list")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(default_out("attention_scope.json")))
    args = ap.parse_args()
    import torch

    from moegraph_cli.models import from_profile
    from moegraph_cli.models.common import attention, fused
    from moegraph_kernels import rope

    model = from_profile(args.profile, dtype=torch.bfloat16, device="cuda",
                         overrides=["model.num_hidden_layers=1"])
    model.rope_tables(args.seq, torch.bfloat16, torch.device("cuda"))
    attn = model.layers[0].attn
    H = model.config.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, args.seq, H, device="cuda", generator=gen).bfloat16()
    x.requires_grad_()
    dy = torch.randn(args.batch, args.seq, H, device="cuda", generator=gen).bfloat16()
    params = [p for p in attn.parameters() if p.requires_grad]
    names = ["out", "x", *(n for n, p in attn.named_parameters() if p.requires_grad)]
    if args.torch_deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)

    def fwd_bwd():
        out = attn(x)
        return (out.detach(), *torch.autograd.grad(out, (x, *params), dy))

    doc = {**environment(), "profile": args.profile, "batch": args.batch, "seq": args.seq,
           "torch_deterministic": args.torch_deterministic, "records": []}
    first = None
    variants = [(g, lay, t) for g in args.gqa.split(",") for lay in args.layouts.split(",")
                for t in args.bwd.split(",")]
    for gqa, layout, tiling in variants:
        rows, per_sm = (int(v) for v in tiling.split("x"))
        rec = {"gqa": gqa, "layout": layout, "bwd_rows": rows, "bwd_programs_per_sm": per_sm}
        try:
            attention.GQA = gqa
            fused.ROPE_LAYOUT, rope.BWD_ROWS, rope.BWD_PROGRAMS_PER_SM = layout, rows, per_sm
            a = fwd_bwd()
            differ = set()
            for _ in range(args.repeats - 1):
                b = fwd_bwd()
                differ |= {n for n, u, v in zip(names, a, b) if not torch.equal(u, v)}
                del b
            torch.cuda.synchronize()
            rec["deterministic"] = not differ
            rec["differed"] = sorted(differ)
            first = first or a
            rec["equal_first"] = all(torch.equal(u, v) for u, v in zip(a, first))
            rec["max_abs_vs_first"] = max((u.float() - v.float()).abs().max().item()
                                          for u, v in zip(a, first))
            rec["fwd_bwd_ms"] = throughput_ms(fwd_bwd, reps=5, rounds=args.rounds)
            rec["kernels_ms"] = dict(list(kernel_ms(fwd_bwd, 120).items())[:16])
        except Exception as exc:  # a variant that fails is recorded
            rec["error"] = error_text(exc)
        doc["records"].append(rec)
        write_json(args.out, doc)
        print(f"{gqa} {layout} bwd {tiling:6s} {rec.get('fwd_bwd_ms', float('nan')):7.3f} ms "
              f"det={rec.get('deterministic')} equal={rec.get('equal_first')} "
              f"{rec.get('error', '')}", flush=True)
        for name, ms in list(rec.get("kernels_ms", {}).items())[:8]:
            print(f"    {ms:7.3f}  {name[:100]}")


if __name__ == "__main__":
    main()
