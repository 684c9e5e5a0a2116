"""The gather-combine tile, swept on the GPU at the Qwen3 shape (k = 8, H = 2048): per
(block_t, block_h, warps), ms of one combine (back-to-back launches between one pair of CUDA
events), the bytes floor at the measured copy bandwidth, and bitwise equality with the
default tile (the tile must change no value). Prints the fastest as `MOEGRAPH_COMBINE_TILE=`,
the spelling kernels/combine.py reads.

Run: python3 benchmarks/combine_sweep.py --tokens 8192 --out $OUT/combine_sweep.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_records  # noqa: E402
from moe_experts import copy_bandwidth_gbs, random_routes, time_throughput  # noqa: E402

from moegraph_cli.train.harness import device_info  # noqa: E402
from moegraph_kernels import combine  # noqa: E402
from moegraph_kernels.combine import gather_combine  # noqa: E402

TILES = [(4, 1024, 4), (1, 2048, 8), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (8, 512, 8),
         (8, 1024, 8), (16, 256, 4), (1, 1024, 4), (4, 2048, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default="benchmarks/results/combine_sweep.json")
    args = ap.parse_args()
    T, E, K, H, F = args.tokens, 128, 8, 2048, 768
    dev = torch.device("cuda")
    routes = random_routes(T, E, K, H, F)
    src = torch.randn(routes.num_slots, H, device=dev, dtype=torch.bfloat16)
    out = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    copy_gbs = copy_bandwidth_gbs()
    floor_ms = (T * K * H + T * H) * 2 / copy_gbs / 1e6  # every route row read, out written
    records, ref = [], None
    for tile in TILES:
        combine.TILE_OVERRIDE = tile
        rec = {"tile": list(tile), "tokens": T, **device_info()}
        try:
            rec["ms"] = time_throughput(lambda: gather_combine(src, routes.token_slots, out),
                                        50, 3)
            if ref is None:
                ref = out.clone()
            rec["bitwise_vs_first"] = bool(torch.equal(out, ref))
        except Exception as e:  # noqa: BLE001 - a tile the GPU refuses
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rec.update(copy_gbs=copy_gbs, floor_ms=floor_ms)
        records.append(rec)
        print(rec, flush=True)
    combine.TILE_OVERRIDE = None
    ok = [r for r in records if "ms" in r and r["bitwise_vs_first"]]
    best = min(ok, key=lambda r: r["ms"])
    write_records(records, args.out)
    print(f"best {best['ms']:.4f} ms (first {records[0].get('ms')}, floor {floor_ms:.4f})")
    print("MOEGRAPH_COMBINE_TILE=" + ",".join(str(v) for v in best["tile"]))


if __name__ == "__main__":
    main()
