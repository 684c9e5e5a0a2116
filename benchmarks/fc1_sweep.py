"""The FC1 + SwiGLU tile at 128-row slot blocks, swept on the GPU at the Qwen3 shape (E = 128,
H = 2048, F = 768, k = 8; T = 8192 by default): per tile (block_m, block_n, block_k, group_m,
warps, stages), all through TMA weight tiles as the default path runs, ms of one launch
(median of CUDA events), TFLOP/s, and bitwise equality of Y1 and the activation with the
default tile's (a tile must change no value). Prints the fastest bitwise-equal tile as
`MOEGRAPH_FC1_TILE=`, the spelling kernels/gather_gemm.py reads.

Run: python3 benchmarks/fc1_sweep.py --tokens 8192 --out $OUT/fc1_sweep.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_records  # noqa: E402
from moe_experts import random_routes, time_events  # noqa: E402

from moegraph_cli.harness import device_info  # noqa: E402
from moegraph_cli.moe.experts import tile_configs  # noqa: E402
from moegraph_kernels import gather_gemm  # noqa: E402
from moegraph_kernels.gather_gemm import GemmConfig, fc1_swiglu  # noqa: E402

TILES = [GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 128, 64, 8, 8, 3),
         GemmConfig(128, 128, 32, 8, 8, 6), GemmConfig(128, 128, 32, 8, 8, 4),
         GemmConfig(128, 128, 32, 16, 8, 5), GemmConfig(128, 128, 64, 4, 8, 4),
         GemmConfig(128, 64, 64, 8, 8, 5), GemmConfig(128, 64, 64, 8, 4, 4),
         GemmConfig(128, 64, 128, 8, 8, 3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default="benchmarks/results/fc1_sweep.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fc1_sweep: needs a CUDA GPU")
    T, E, K, H, F = args.tokens, 128, 8, 2048, 768
    dev = torch.device("cuda")
    routes = random_routes(T, E, K, H, F)
    default = tile_configs(T * K, E, H, F, dev).fc1
    if default.block_m != 128:
        sys.exit(f"fc1_sweep: T={T} runs {default.block_m}-row blocks; sweep a larger T")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=gen).bfloat16()
    w = (torch.randn(E, 2 * F, H, device=dev, generator=gen) * 0.02).bfloat16()
    p = torch.rand(T * K, device=dev, generator=gen).bfloat16()
    S = routes.num_slots
    live = (routes.block_expert >= 0).repeat_interleave(routes.block_m)
    y1 = torch.empty(S, 2 * F, device=dev, dtype=torch.bfloat16)
    act = torch.empty(S, F, device=dev, dtype=torch.bfloat16)
    flops = 2 * T * K * H * 2 * F
    gather_gemm.FALLBACK_ON_ERROR = False  # a tile that fails is an error here, not a fallback
    records, ref = [], None
    for tile in [default] + [t.with_variant(default.variant) for t in TILES]:
        rec = {"tile": list(tile)[:6], "variant": tile.variant, "tokens": T, **device_info()}
        try:
            y1.fill_(math.nan)
            act.fill_(math.nan)
            fc1_swiglu(x, w, p, routes, y1, act, tile)
            torch.cuda.synchronize()
            got = (y1[live].clone(), act[live].clone())
            if ref is None:
                ref = got
            rec["bitwise_vs_default"] = all(torch.equal(a, b) for a, b in zip(got, ref))
            ms = time_events(lambda: fc1_swiglu(x, w, p, routes, y1, act, tile), 20)
            rec.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as e:  # noqa: BLE001 - a tile the GPU refuses
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        records.append(rec)
        print(rec, flush=True)
    write_records(records, args.out)
    ok = [r for r in records if "ms" in r and r["bitwise_vs_default"]]
    best = min(ok, key=lambda r: r["ms"])
    print(f"best {best['ms']:.4f} ms, {best['tflops']:.0f} TFLOP/s "
          f"(default {records[0].get('ms')})")
    print("MOEGRAPH_FC1_TILE=" + ",".join(str(v) for v in best["tile"]))


if __name__ == "__main__":
    main()
