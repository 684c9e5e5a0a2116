"""The lm head's two gradient GEMMs in the product's operand order against the transposed
problem (cuBLAS then picks another kernel), side by side; with the forward GEMM as a yardstick.

    python3 benchmarks/lm_head_gemm_ab.py [--tokens 16384] [--vocab 151936] [--hidden 2048]
        [--rounds 9] [--out PATH]

x [T, H], w [V, H], dlogits [T, V], all bf16 (N(0, 1) scaled). Groups, each with `default`
(the product's call), `twin` (the same in its own graph: the run's resolution) and the
alternatives, every entry a CUDA graph timed by common.graphed_ab (led bursts, shuffled
rounds); `equal_default` says whether the alternative's bits are the default's:
- `fwd`: logits = F.linear(x, w) (no alternative: the loss kernels need its row layout);
- `dx`: dlogits @ w  against  (w^T @ dlogits^T)^T made contiguous (`t_copy`) and left a
  transposed view (`t_view`, what a consumer taking either layout would pay);
- `dw`: dlogits^T @ x into a [V, H] buffer (mm_out, as the sink's grad)  against
  (x^T @ dlogits)^T made contiguous (`t_copy`) and as a view (`t_view`).
TFLOP/s count 2 T V H a GEMM.

Writes lm_head_gemm_ab.json (--out; default $OUT/..., else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import sys

from common import default_out, environment, graphed_ab, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(default_out("lm_head_gemm_ab.json")))
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        sys.exit("benchmarks/lm_head_gemm_ab.py: needs a CUDA GPU")
    T, V, H = args.tokens, args.vocab, args.hidden
    torch.manual_seed(0)
    x = torch.randn(T, H, device="cuda").bfloat16()
    w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()
    dl = (torch.randn(T, V, device="cuda") * 1e-5).bfloat16()
    dw_out = torch.empty_like(w)
    groups = {
        "fwd": {"default": lambda: [F.linear(x, w)[::64].clone()],
                "twin": lambda: [F.linear(x, w)[::64].clone()]},
        "dx": {"default": lambda: [dl @ w], "twin": lambda: [dl @ w],
               "t_copy": lambda: [(w.t() @ dl.t()).t().contiguous()],
               "t_view": lambda: [(w.t() @ dl.t()).t()]},
        "dw": {"default": lambda: [torch.mm(dl.t(), x, out=dw_out)],
               "twin": lambda: [torch.mm(dl.t(), x, out=dw_out)],
               "t_copy": lambda: [(x.t() @ dl).t().contiguous()],
               "t_view": lambda: [(x.t() @ dl).t()]},
    }
    doc = {"benchmark": "lm_head_gemm_ab", **environment(), "T": T, "V": V, "H": H,
           "records": []}
    flops = 2 * T * V * H
    for group, fns in groups.items():
        records = {name: {"group": group, "entry": name} for name in fns}
        recs = graphed_ab(fns, records, args.rounds, 40, diff=True)
        for rec in recs:
            if "ms" in rec:
                rec["tflops"] = flops / rec["ms"] / 1e9
            doc["records"].append(rec)
            print(f"{group:4s} {rec['entry']:8s} {rec.get('ms', float('nan')):8.3f} ms "
                  f"{rec.get('tflops', float('nan')):6.0f} TF/s "
                  f"x{rec.get('ratio_to_default', float('nan')):.3f} @{rec.get('sm_mhz')} MHz "
                  f"eq={rec.get('equal_default')} d={rec.get('max_abs_diff')} "
                  f"{rec.get('error', '')}", flush=True)
        write_json(args.out, doc)


if __name__ == "__main__":
    main()
