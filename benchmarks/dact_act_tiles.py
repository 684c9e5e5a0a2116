"""dA's activation-backward kernel alone (kernels/dact_act.py) under candidate tiles.

    python3 benchmarks/dact_act_tiles.py [--tokens 8192,32768] [--tiles 32x4x1,64x8x4]
        [--rounds 7] [--out PATH]

Per T, Qwen3 expert shape (E = 128, k = 8, F = 768, uniform routing as benchmarks/experts.py
draws it, the product's slot block): dA [S, F], Y1 [S, 2F] bf16 and the top-k weights random;
dp_part in 64-column tiles (the paired dA tile's quarters). Each tile (rows a program x warps x dp_part columns a program;
the first is the product's default) is one CUDA graph of one launch, timed side by side
(common.graphed_ab: bursts led by the default's, a twin of it as the resolution, outputs
compared with the default's bitwise): the median ms, the SM clock (NVML) and the effective
bandwidth over the bytes the live rows move (dA, gate and up read, dY1 and A written).

Writes dact_act_tiles.json (--out; default $OUT/dact_act_tiles.json, else
benchmarks/results/).
"""

from __future__ import annotations

import argparse

from common import default_out, environment, graphed_ab, write_json
from experts import make_routing

E, F, K = 128, 768, 8
WIDTH = 64


def run_case(T, tiles, rounds) -> list[dict]:
    import torch

    import moegraph_kernels.dact_act as act_mod
    from moegraph_cli.moe.experts import build_routes
    from moegraph_kernels.gemm_config import route_block_m
    dev, bf = torch.device("cuda"), torch.bfloat16
    ids, w = make_routing(T, E, K, "uniform", 0.0)
    block = route_block_m(T * K, E, dev)
    routes = build_routes(ids.to(dev), w.to(dev), E, block, None)
    S = routes.num_slots
    gen = torch.Generator(device=dev).manual_seed(0)
    da = torch.randn(S, F, device=dev, generator=gen).to(bf)
    y1 = torch.randn(S, 2 * F, device=dev, generator=gen).to(bf)
    w_N = w.reshape(-1).to(dev, bf)
    live_rows = int((routes.block_expert >= 0).sum()) * block
    # bf16 dA and Y1 (gate, up) read, dY1 and A written, fp32 dp_part written
    moved = live_rows * (2 * F + 4 * F + 4 * F + 2 * F + 4 * (F // WIDTH))
    fns, records = {}, {}
    for name in ["default", "twin", *tiles]:
        tile = None if name in ("default", "twin") else tuple(map(int, name.split("x")))

        def fn(tile=tile):
            outs = (torch.empty(S, 2 * F, dtype=bf, device=dev),
                    torch.empty(S, F, dtype=bf, device=dev),
                    torch.empty(S, F // WIDTH, dtype=torch.float32, device=dev))
            before, act_mod.TILE_OVERRIDE = act_mod.TILE_OVERRIDE, tile
            try:
                act_mod.dact_act(da, y1, w_N, routes.slot_route, routes.block_expert, block,
                                 *outs, WIDTH)
            finally:
                act_mod.TILE_OVERRIDE = before
            return list(outs)
        fns[name] = fn
        records[name] = {"T": T, "entry": name, "slots": S, "live_rows": live_rows,
                         "bytes": moved}
    recs = graphed_ab(fns, records, rounds, 40)
    for rec in recs:
        if "ms" in rec:
            rec["gb_per_s"] = rec["bytes"] / rec["ms"] / 1e6
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--tiles", default="32x4x1,16x4x6,32x4x12,64x8x12,16x8x12")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(default_out("dact_act_tiles.json")))
    args = ap.parse_args()
    doc = {"benchmark": "dact_act_tiles", **environment(), "records": []}
    for T in map(int, args.tokens.split(",")):
        doc["records"] += run_case(T, args.tiles.split(","), args.rounds)
        write_json(args.out, doc)
    for r in doc["records"]:
        print(f"T={r['T']:6d} {r['entry']:8s} {r.get('ms', float('nan')):.4f} ms "
              f"{r.get('gb_per_s', float('nan')):7.0f} GB/s x{r.get('ratio_to_default', float('nan')):.3f} "
              f"eq={r.get('equal_default')} {r.get('error', '')}")


if __name__ == "__main__":
    main()
