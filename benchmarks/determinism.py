"""Run-to-run determinism of the loaded step's kernels: each part run again and again on the
same inputs, every output compared bitwise with the first run's.

    python3 benchmarks/determinism.py [--tokens 16384] [--routing uniform,skewed]
        [--repeats 20] [--attention] [--out PATH]

Parts: the permute-free experts (Qwen3 shape, E = 128, k = 8, H = 2048, F = 768; forward
and backward through moe.experts.permute_free_moe, eager), outputs y, dx, d(route weights),
dW_gate_up, dW_down; with --attention, SDPA's causal attention at the 4-layer Qwen3-30B's
shape (4 x 4096 tokens, 32 query heads, 4 KV heads, head dim 128, enable_gqa), dq, dk, dv.
Per part and output: how many of the repeats differed from the first, and the largest
absolute difference seen.

Writes determinism.json (--out; default $OUT/determinism.json, else
benchmarks/results/determinism.json).
"""

from __future__ import annotations

import argparse

from common import default_out, environment, error_text, write_json
from experts import SHAPES, make_case


def repeat(fn, repeats: int) -> dict:
    """fn() -> {name: tensor}, run `repeats` times; per name: runs differing from the first."""
    import torch
    first = {k: v.clone() for k, v in fn().items()}
    differ = {k: 0 for k in first}
    worst = {k: 0.0 for k in first}
    for _ in range(repeats - 1):
        out = fn()
        for k, v in out.items():
            if not torch.equal(v, first[k]):
                differ[k] += 1
                worst[k] = max(worst[k], float((v.float() - first[k].float()).abs().max()))
    return {k: {"runs_differing": differ[k], "max_abs_diff": worst[k]} for k in first}


def experts_part(T: int, routing: str, repeats: int) -> dict:
    import torch
    from moegraph_cli.moe.experts import permute_free_moe
    args, dout = make_case(SHAPES["qwen3"], T, routing, 0.25)
    x, ids, w, wgu, wd = args

    def run():
        for t in (x, w, wgu, wd):
            t.grad = None
        y = permute_free_moe(x, ids, w, wgu, wd)
        y.backward(dout)
        return {"y": y.detach(), "dx": x.grad, "d_route_weights": w.grad,
                "dw_gate_up": wgu.grad, "dw_down": wd.grad}
    return repeat(run, repeats)


# The 4-layer Qwen3-30B's attention at 4 x 4096 tokens: batch, sequence, query heads, K/V
# heads, head dim (energy.py times the same case).
ATTENTION_SHAPE = (4, 4096, 32, 4, 128)


def attention_case():
    """Seeded bf16 (q, k, v, do) on the GPU at ATTENTION_SHAPE, q, k and v leaves that
    require grad."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, S, NQ, NKV, D = ATTENTION_SHAPE
    q = torch.randn(B, NQ, S, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(B, NKV, S, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(B, NKV, S, D, device="cuda", generator=gen).to(torch.bfloat16)
    do = torch.randn(B, NQ, S, D, device="cuda", generator=gen).to(torch.bfloat16)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def attention_part(repeats: int) -> dict:
    import torch.nn.functional as F
    q, k, v, do = attention_case()

    def run():
        for t in (q, k, v):
            t.grad = None
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(do)
        return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return repeat(run, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or default_out("determinism.json")
    doc = {"benchmark": "determinism", **environment(), "repeats": args.repeats,
           "records": []}
    for T in (int(t) for t in args.tokens.split(",")):
        for routing in args.routing.split(","):
            rec = {"part": "experts", "tokens": T, "routing": routing}
            try:
                rec["outputs"] = experts_part(T, routing, args.repeats)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                rec["error"] = error_text(e)
            doc["records"].append(rec)
            write_json(out, doc)
    if args.attention:
        rec = {"part": "sdpa_causal_gqa", "shape": "4 x 4096, 32 / 4 heads, 128"}
        try:
            rec["outputs"] = attention_part(args.repeats)
        except Exception as e:  # noqa: BLE001
            rec["error"] = error_text(e)
        doc["records"].append(rec)
    write_json(out, doc)
    print(out)


if __name__ == "__main__":
    main()
