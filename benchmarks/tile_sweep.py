"""The FC1 + SwiGLU or the FC2 tile at 128-row slot blocks, swept on the GPU at the Qwen3 shape
(E = 128, H = 2048, F = 768, k = 8; T = 8192 by default): per tile (block_m, block_n, block_k,
group_m, warps, stages), each under the variant the product runs (FC1: TMA weight tiles; FC2:
TMA + persistent), ms of one launch (median of CUDA events), TFLOP/s, and bitwise equality of
the outputs with the default tile's (a tile must change no value). Prints the fastest
bitwise-equal tile as `MOEGRAPH_FC1_TILE=` / `MOEGRAPH_FC2_TILE=`, the spelling
kernels/gather_gemm.py reads.

Run: python3 benchmarks/tile_sweep.py --kernel fc1 --tokens 8192 --out $OUT/fc1_sweep.json
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

from moegraph_cli.train.harness import device_info  # noqa: E402
from moegraph_cli.moe.experts import tile_configs  # noqa: E402
from moegraph_kernels import gather_gemm  # noqa: E402
from moegraph_kernels.gather_gemm import GemmConfig, fc1_swiglu, slot_gemm  # noqa: E402

TILES = {
    "fc1": [GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 128, 64, 8, 8, 3),
            GemmConfig(128, 128, 32, 8, 8, 6), GemmConfig(128, 128, 32, 8, 8, 4),
            GemmConfig(128, 128, 32, 16, 8, 5), GemmConfig(128, 128, 64, 4, 8, 4),
            GemmConfig(128, 64, 64, 8, 8, 5), GemmConfig(128, 64, 64, 8, 4, 4),
            GemmConfig(128, 64, 128, 8, 8, 3), GemmConfig(128, 128, 32, 8, 8, 5),
            # 96 KB of shared memory: two programs per SM, one's epilogue under the other's loop
            GemmConfig(128, 64, 64, 8, 8, 3), GemmConfig(128, 64, 64, 8, 4, 3)],
    "fc2": [GemmConfig(128, 256, 64, 8, 8, 4), GemmConfig(128, 256, 64, 4, 8, 3),
            GemmConfig(128, 256, 64, 16, 8, 3), GemmConfig(128, 256, 32, 8, 8, 5),
            GemmConfig(128, 256, 32, 8, 8, 6), GemmConfig(128, 128, 64, 8, 8, 4),
            GemmConfig(128, 128, 64, 8, 8, 5), GemmConfig(128, 128, 64, 8, 4, 4),
            GemmConfig(128, 256, 128, 8, 8, 2), GemmConfig(128, 128, 128, 8, 8, 3)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=sorted(TILES), default="fc1")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default=None, help="default results/<kernel>_sweep.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tile_sweep: needs a CUDA GPU")
    out_path = args.out or str(Path(__file__).parent / "results" / f"{args.kernel}_sweep.json")
    T, E, K, H, F = args.tokens, 128, 8, 2048, 768
    dev = torch.device("cuda")
    routes = random_routes(T, E, K, H, F)
    default = getattr(tile_configs(T * K, E, H, F, dev), args.kernel)
    if default.block_m != 128:
        sys.exit(f"tile_sweep: T={T} runs {default.block_m}-row blocks; sweep a larger T")
    gen = torch.Generator(device="cuda").manual_seed(0)
    S = routes.num_slots
    live = (routes.block_expert >= 0).repeat_interleave(routes.block_m)
    bf = torch.bfloat16
    if args.kernel == "fc1":
        x = torch.randn(T, H, device=dev, generator=gen).to(bf)
        w = (torch.randn(E, 2 * F, H, device=dev, generator=gen) * 0.02).to(bf)
        p = torch.rand(T * K, device=dev, generator=gen).to(bf)
        outs = [torch.empty(S, 2 * F, device=dev, dtype=bf), torch.empty(S, F, device=dev,
                                                                          dtype=bf)]
        flops = 2 * T * K * H * 2 * F

        def launch(tile):
            fc1_swiglu(x, w, p, routes, outs[0], outs[1], tile)
    else:
        act = torch.randn(S, F, device=dev, generator=gen).to(bf)
        w = (torch.randn(E, H, F, device=dev, generator=gen) * 0.02).to(bf)
        outs = [torch.empty(S, H, device=dev, dtype=bf)]
        flops = 2 * T * K * F * H

        def launch(tile):
            slot_gemm(act, w, routes, outs[0], w_nk=True, cfg=tile)

    gather_gemm.FALLBACK_ON_ERROR = False  # a tile that fails is an error here, not a fallback
    records, ref = [], None
    tiles = [default] + [t.with_variant(default.variant) for t in TILES[args.kernel]
                         if t.with_variant(default.variant) != default]
    for tile in tiles:
        rec = {"kernel": args.kernel, "tile": list(tile)[:6], "variant": tile.variant,
               "tokens": T, **device_info()}
        try:
            for o in outs:
                o.fill_(math.nan)
            launch(tile)
            torch.cuda.synchronize()
            got = [o[live].clone() for o in outs]
            if ref is None:
                ref = got
            rec["bitwise_vs_default"] = all(torch.equal(a, b) for a, b in zip(got, ref))
            ms = time_events(lambda: launch(tile), 20)
            rec.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as e:  # noqa: BLE001 - a tile the GPU refuses
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        records.append(rec)
        print(rec, flush=True)
    write_records(records, out_path)
    ok = [r for r in records if "ms" in r and r["bitwise_vs_default"]]
    best = min(ok, key=lambda r: r["ms"])
    print(f"best {best['ms']:.4f} ms, {best['tflops']:.0f} TFLOP/s "
          f"(default {records[0].get('ms')})")
    print(f"MOEGRAPH_{args.kernel.upper()}_TILE=" + ",".join(str(v) for v in best["tile"]))


if __name__ == "__main__":
    main()
