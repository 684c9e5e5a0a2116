"""The loss's softmax work of the loaded step, the two-kernel head against the one-kernel
head with dlogits in the forward (kernels/cross_entropy_fused.py), side by side.

    python3 benchmarks/ce_fused_ab.py [--tokens 16384] [--vocab 151936] [--rounds 9]
        [--only NAME,...] [--out PATH]

logits [T, V] bf16 (N(0, 16)), labels uniform with every 10th row ignored. Entries:
- `default`: what the two-kernel head runs, cross_entropy_forward then cross_entropy_backward
  in place (grad 1); `twin`: the same in its own graph (the run's resolution);
- `fwd_only`, `bwd_only`: its two kernels alone;
- `f_b{block}_w{warps}_p{per_sm}_s{stages}[_fwd][_el]`: cross_entropy_fused_ at that tile
  (`s`: both loops' loads pipelined that deep, 1 not; `_fwd`: the re-read walked forward, else
  backward; `_el`: the first pass's loads evict_last);
- `copy`: a clone moving as many bytes as the default must (read twice, written once).
Before timing, each fused entry runs once on a fresh copy of the logits: `equal_bwd_kernel`
(its dlogits bitwise the backward kernel's given its lse), `lse_max_diff` and
`loss_max_diff` (against the forward kernel's). The timed graphs then all work in place on
one shared buffer (each call's dlogits are the next call's logits: the same work), each burst
about 20 ms, led by as long a burst of the default's, the order shuffled a round
(common.time_led_graphs).

Writes ce_fused_ab.json (--out; default $OUT/ce_fused_ab.json, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import sys

from common import capture_graph, default_out, environment, time_led_graphs, write_json

TILES = [  # (block, warps, per_sm, reverse, evict_last, stages)
    (8192, 16, 1, True, False, 1), (16384, 16, 1, True, False, 3),
    (16384, 16, 1, True, False, 4), (16384, 16, 1, True, False, 2),
    (16384, 16, 2, True, False, 2), (16384, 16, 2, True, False, 3),
    (16384, 32, 1, True, False, 3), (16384, 8, 1, True, False, 3),
    (32768, 16, 1, True, False, 2), (32768, 32, 1, True, False, 3),
    (8192, 16, 2, True, False, 3), (8192, 16, 2, True, False, 4),
    (16384, 16, 1, True, True, 3), (16384, 16, 1, False, False, 3),
]


def tile_name(block, warps, per_sm, reverse, evict_last, stages) -> str:
    return (f"f_b{block}_w{warps}_p{per_sm}_s{stages}" + ("" if reverse else "_fwd")
            + ("_el" if evict_last else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--only", default="", help="comma list of fused entry names (default all)")
    ap.add_argument("--out", default=str(default_out("ce_fused_ab.json")))
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ce_fused_ab.py: needs a CUDA GPU")
    from moegraph_kernels.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from moegraph_kernels.cross_entropy_fused import cross_entropy_fused_

    T, V = args.tokens, args.vocab
    tiles = {tile_name(*t): t for t in TILES}
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in tiles]
        if unknown:
            ap.error(f"unknown entry {unknown[0]!r}; known: {', '.join(tiles)}")
        tiles = {n: tiles[n] for n in args.only.split(",")}
    torch.manual_seed(0)
    logits0 = torch.randn(T, V, device="cuda").mul_(4).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda")
    labels[::10] = -100
    n_valid = (labels != -100).sum()
    one = torch.ones((), device="cuda")
    lse_k, loss_k = cross_entropy_forward(logits0, labels)
    nbytes = 3 * logits0.numel() * 2
    doc = {"benchmark": "ce_fused_ab", **environment(), "T": T, "V": V, "bytes_default": nbytes,
           "records": []}

    def fused_fn(buf, tile):
        block, warps, per_sm, reverse, el, stages = tile
        return lambda: list(cross_entropy_fused_(buf, labels, n_valid, block_v=block,
                                                 num_warps=warps, per_sm=per_sm,
                                                 reverse=reverse, evict_last=el,
                                                 stages=stages))

    records = {}
    for name in ("default", "twin", "fwd_only", "bwd_only", "copy"):
        records[name] = {"entry": name}
    work = torch.empty_like(logits0)
    for name, tile in tiles.items():
        rec = records[name] = {"entry": name, "tile": list(tile)}
        try:
            work.copy_(logits0)
            lse, loss = fused_fn(work, tile)()
            want = cross_entropy_backward(logits0, labels, lse, one, n_valid)
            rec["equal_bwd_kernel"] = bool(torch.equal(work, want))
            rec["lse_max_diff"] = float((lse - lse_k).abs().max())
            rec["loss_max_diff"] = float((loss - loss_k).abs().max())
            del want
        except Exception as exc:  # noqa: BLE001 - a failing tile: recorded, the run goes on
            rec["error"] = repr(exc)[:300]
        print(name, rec, flush=True)
    del work
    torch.cuda.empty_cache()

    buf = logits0  # the shared, overwritten buffer of every timed graph
    lse_buf = lse_k.clone()

    def two_kernel():
        lse, loss = cross_entropy_forward(buf, labels)
        cross_entropy_backward(buf, labels, lse, one, n_valid, out_TV=buf)
        return [lse, loss]

    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
    fns = {"default": two_kernel, "twin": two_kernel,
           "fwd_only": lambda: list(cross_entropy_forward(buf, labels)),
           "bwd_only": lambda: [cross_entropy_backward(buf, labels, lse_buf, one, n_valid,
                                                       out_TV=buf)],
           "copy": lambda: [src.clone()]}
    fns.update({name: fused_fn(buf, tile) for name, tile in tiles.items()
                if "error" not in records[name]})
    graphs = {}
    for name, fn in fns.items():
        try:
            graphs[name] = capture_graph(fn)
        except Exception as exc:  # noqa: BLE001
            records[name]["error"] = repr(exc)[:300]
    recs = [records[n] for n in records]
    time_led_graphs(recs, graphs, args.rounds, 20)
    for rec in recs:
        if "ms" in rec:
            rec["ratio_to_default"] = rec["ms"] / records["default"]["ms"]
        doc["records"].append(rec)
        print(f"{rec['entry']:24s} {rec.get('ms', float('nan')):8.4f} ms "
              f"x{rec.get('ratio_to_default', float('nan')):.3f} @{rec.get('sm_mhz')} MHz "
              f"eq={rec.get('equal_bwd_kernel')} lse_d={rec.get('lse_max_diff')} "
              f"{rec.get('error', '')}", flush=True)
    best = min((r for r in recs if r["entry"] in tiles and "ms" in r and r.get("equal_bwd_kernel")),
               key=lambda r: r["ms"], default=None)
    if best is not None:
        block, warps, per_sm, _, _, stages = best["tile"]
        doc["best"] = {"entry": best["entry"], "tile_env": f"{block},{warps},{per_sm},{stages}"}
        print("best", doc["best"], flush=True)
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
