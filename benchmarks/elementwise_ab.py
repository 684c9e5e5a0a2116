"""The loaded step's memory-bound kernels under their defaults against alternatives, each
entry a CUDA graph, their rounds interleaved: the rope (with Qwen3's per-head norm) forward and
backward, the loss forward and backward, and the per-expert route counts of the load-balancing statistics.

    python3 benchmarks/elementwise_ab.py [--only rope_fwd,rope_bwd,ce_fwd,ce_bwd,counts]
        [--tokens 16384] [--rounds 9] [--out PATH]

Shapes are those of qwen3-30b-a3b-4layer at 4 x 4096 tokens (`--tokens`): q [B, S, 32, 128]
and k [B, S, 4, 128] bf16 as views of one [T, 5120] projection output, the gradient in the
layout SDPA hands back (bsnd); logits [T, 151936] bf16; top-8 expert ids of 128 experts.
Per group: `default` (the product's call), `twin` (the default again in its own graph: its
distance from the default is the run's resolution) and the alternatives. Every output is
compared with the default's (`equal_default`, bitwise; `max_abs_diff` where an alternative
sums in another order). Then `--rounds` rounds in which each graph replays back to back for
about 20 ms, each burst led by as long an untimed burst of the default's, the order shuffled a
round (common.interleaved_ms): the median ms, the SM clock, the ratio to the default, and
GB/s of the bytes the kernel must move (`bytes`, read and written) beside `copy`, a clone
that reads and writes as many bytes in all.

Writes elementwise_ab.json (--out; default $OUT/elementwise_ab.json, else
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import sys

from common import default_out, environment, graphed_ab, write_json

GROUPS = ("rope_fwd", "rope_bwd", "ce_fwd", "ce_bwd", "counts")
HEADS, KV_HEADS, HEAD_DIM, VOCAB, EXPERTS, TOP_K = 32, 4, 128, 151936, 128, 8


def rope_inputs(T: int):
    import torch
    from moegraph_cli.models.common.rope import rope_cos_sin
    B, S = T // 4096 or 1, min(T, 4096)
    qkv = torch.randn(B * S, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda",
                      dtype=torch.bfloat16)
    q = qkv[:, :HEADS * HEAD_DIM].view(B, S, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(B, S, KV_HEADS, HEAD_DIM)
    cos, sin = rope_cos_sin(S, HEAD_DIM, 1e6, torch.bfloat16, "cuda")
    wq = 1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    wk = 1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return (q, wq), (k, wk), cos, sin


def rope_fwd_entries(T: int) -> tuple[dict, int]:
    from moegraph_kernels.rope import rope_forward
    q, k, cos, sin = rope_inputs(T)
    pairs = (q, k)
    nbytes = sum(2 * x.numel() * 2 + x.numel() // HEAD_DIM * 4 for x, _ in pairs)

    def entry(**kw):
        return lambda: [t for x, w in pairs
                        for t in rope_forward(x, cos, sin, w, 1e-6, "bsnd", **kw)]
    out = {"default": entry(), "twin": entry()}
    for rows, warps in ((16, 4), (8, 2), (32, 4)):
        out[f"r{rows}w{warps}"] = entry(rows=rows, num_warps=warps)
    return out, nbytes


def rope_bwd_entries(T: int) -> tuple[dict, int]:
    import torch
    from moegraph_kernels.rope import rope_backward, rope_forward
    (q, wq), (k, wk), cos, sin = rope_inputs(T)
    cases = []
    for x, w in ((q, wq), (k, wk)):
        _, rstd = rope_forward(x, cos, sin, w, 1e-6, "bsnd")
        dy = torch.randn_like(x).transpose(1, 2)  # [B, N, S, D] over [B, S, N, D] memory
        cases.append((dy, x, w, rstd))
    nbytes = sum(3 * x.numel() * 2 + rstd.numel() * 4 for _, x, _, rstd in cases)

    def entry(**kw):
        return lambda: [t for dy, x, w, rstd in cases
                        for t in rope_backward(dy, x, cos, sin, w, rstd, **kw)]
    out = {"default": entry(), "twin": entry()}
    out["r32p8w4"] = entry(rows=32, programs_per_sm=8, dw_lanes=False)  # before lanes
    for rows, per_sm, warps in ((32, 8, 4), (64, 4, 8), (32, 2, 4)):
        out[f"r{rows}p{per_sm}w{warps}+lanes"] = entry(rows=rows, programs_per_sm=per_sm,
                                                       num_warps=warps, dw_lanes=True)
    return out, nbytes


def ce_fwd_entries(T: int) -> tuple[dict, int]:
    import torch
    from moegraph_kernels.cross_entropy import cross_entropy_forward
    logits = torch.randn(T, VOCAB, device="cuda", dtype=torch.bfloat16) * 4
    labels = torch.randint(0, VOCAB, (T,), device="cuda")

    def entry(**kw):
        return lambda: list(cross_entropy_forward(logits, labels, **kw))
    out = {"default": entry(), "twin": entry()}
    out["one_program"] = entry(chunk=VOCAB, block_v=8192, num_warps=8)  # one program a row
    for chunk, block, warps in ((49152, 2048, 2), (77824, 2048, 2), (65536, 4096, 4),
                                (65536, 2048, 4)):
        out[f"c{chunk}b{block}w{warps}"] = entry(block_v=block, chunk=chunk, num_warps=warps)
    return out, logits.numel() * 2


def ce_bwd_entries(T: int) -> tuple[dict, int]:
    import torch
    from moegraph_kernels.cross_entropy import cross_entropy_backward, cross_entropy_forward
    logits = torch.randn(T, VOCAB, device="cuda", dtype=torch.bfloat16) * 4
    labels = torch.randint(0, VOCAB, (T,), device="cuda")
    lse = cross_entropy_forward(logits, labels)[0]
    grad, n_valid = torch.ones((), device="cuda"), torch.tensor(T, device="cuda")
    out = torch.empty_like(logits)  # out of place: the logits stay, the bytes are the same

    def entry(**kw):
        return lambda: [cross_entropy_backward(logits, labels, lse, grad, n_valid, out_TV=out,
                                               **kw)[::1024].clone()]  # a sample to compare
    fns = {"default": entry(), "twin": entry()}
    for block, warps in ((2048, 4), (8192, 8), (8192, 16), (16384, 16), (4096, 4)):
        fns[f"b{block}w{warps}"] = entry(block_v=block, num_warps=warps)
    return fns, 2 * logits.numel() * 2


def counts_entries(T: int) -> tuple[dict, int]:
    import torch
    from moegraph_cli.moe.routing import expert_counts_E
    ids = torch.randint(0, EXPERTS, (T, TOP_K), device="cuda")

    def scatter():
        flat = ids.reshape(-1)
        return [torch.zeros(EXPERTS, dtype=torch.float32, device="cuda").scatter_add_(
            0, flat, torch.ones(flat.numel(), dtype=torch.float32, device="cuda"))]

    return {"default": lambda: [expert_counts_E(ids, EXPERTS)],
            "twin": lambda: [expert_counts_E(ids, EXPERTS)],
            "scatter_add": scatter}, ids.numel() * 8


MAKERS = {"rope_fwd": rope_fwd_entries, "rope_bwd": rope_bwd_entries,
          "ce_fwd": ce_fwd_entries, "ce_bwd": ce_bwd_entries, "counts": counts_entries}


def run_group(group: str, T: int, rounds: int) -> list[dict]:
    import torch
    fns, nbytes = MAKERS[group](T)
    src = torch.empty(max(nbytes // 4, 1), dtype=torch.bfloat16, device="cuda")  # r + w
    fns["copy"] = lambda: [src.clone()]
    records = {name: {"group": group, "T": T, "entry": name, "bytes": nbytes} for name in fns}
    recs = graphed_ab(fns, records, rounds, 20, compare=lambda name: name != "copy", diff=True)
    for rec in recs:
        if "ms" in rec:
            rec["gb_per_s"] = nbytes / rec["ms"] / 1e6
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {GROUPS}")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(default_out("elementwise_ab.json")))
    args = ap.parse_args()
    groups = args.only.split(",")
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        ap.error(f"unknown group {bad[0]!r}; known: {', '.join(GROUPS)}")
    import torch
    if not torch.cuda.is_available():
        sys.exit("benchmarks/elementwise_ab.py: needs a CUDA GPU")
    torch.manual_seed(0)
    doc = {"benchmark": "elementwise_ab", **environment(), "records": []}
    for group in groups:
        for rec in run_group(group, args.tokens, args.rounds):
            doc["records"].append(rec)
            print(f"{group:8s} {rec['entry']:22s} {rec.get('ms', float('nan')):8.4f} ms "
                  f"{rec.get('gb_per_s', float('nan')):7.0f} GB/s "
                  f"x{rec.get('ratio_to_default', float('nan')):.3f} @{rec.get('sm_mhz')} MHz "
                  f"eq={rec.get('equal_default')} d={rec.get('max_abs_diff')} "
                  f"{rec.get('error', '')}", flush=True)
        write_json(args.out, doc)


if __name__ == "__main__":
    main()
