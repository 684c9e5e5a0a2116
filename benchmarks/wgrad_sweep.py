"""The expert weight-gradient tile at short K loops (Qwen3-30B shape, T = 1024: 64 routes an
expert), swept on the GPU: both dW kernels of one layer (dW_down [E, H, F] and dW_gate_up
[E, 2F, H]) per tile config, back-to-back launches between one pair of CUDA events, against
the bytes floor (the dW writes at the measured copy bandwidth). Prints the fastest config as
`MOEGRAPH_WGRAD_SHORT=...`, the spelling kernels/wgrad.py reads.

Run: python3 benchmarks/wgrad_sweep.py --out $OUT/wgrad_sweep.json
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
from moegraph_kernels.gather_gemm import GemmConfig  # noqa: E402
from moegraph_kernels.wgrad import expert_wgrad  # noqa: E402

CONFIGS = [GemmConfig(128, 128, 32, 8, 8, 5), GemmConfig(128, 128, 32, 8, 8, 2),
           GemmConfig(128, 128, 32, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 2),
           GemmConfig(128, 256, 32, 8, 8, 2), GemmConfig(128, 256, 64, 8, 8, 2),
           GemmConfig(64, 128, 32, 8, 4, 2), GemmConfig(64, 256, 32, 8, 8, 2),
           GemmConfig(128, 128, 32, 8, 4, 2), GemmConfig(256, 128, 32, 8, 8, 2),
           GemmConfig(128, 64, 32, 8, 4, 2), GemmConfig(64, 64, 32, 8, 4, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/wgrad_sweep.json")
    args = ap.parse_args()
    T, E, K, H, F = args.tokens, 128, 8, 2048, 768
    dev = torch.device("cuda")
    routes = random_routes(T, E, K, H, F)
    S = routes.num_slots
    bf = torch.bfloat16
    d_out, x = torch.randn(T, H, device=dev, dtype=bf), torch.randn(T, H, device=dev, dtype=bf)
    act, dy1 = torch.randn(S, F, device=dev, dtype=bf), torch.randn(S, 2 * F, device=dev, dtype=bf)
    dw_down = torch.empty(E, H, F, device=dev, dtype=bf)
    dw_gu = torch.empty(E, 2 * F, H, device=dev, dtype=bf)
    copy_gbs = copy_bandwidth_gbs()
    floor_ms = (dw_down.numel() + dw_gu.numel()) * 2 / copy_gbs / 1e6  # the dW writes alone
    records, ref = [], None
    for cfg in CONFIGS:
        rec = {"config": list(cfg[:6]), "tokens": T, **device_info()}
        try:
            def both():
                expert_wgrad(d_out, act, routes, dw_down, True, False, cfg)
                expert_wgrad(dy1, x, routes, dw_gu, False, True, cfg)
            rec["ms"] = time_throughput(both, 20, 3)
            out = (dw_down.clone(), dw_gu.clone())
            both()
            rec["deterministic"] = bool(torch.equal(out[0], dw_down) and torch.equal(out[1], dw_gu))
            if ref is None:
                ref = out
            rec["max_abs_vs_first"] = max((out[0].float() - ref[0].float()).abs().max().item(),
                                          (out[1].float() - ref[1].float()).abs().max().item())
        except Exception as e:  # noqa: BLE001 - a config the GPU refuses (shared memory)
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rec.update(copy_gbs=copy_gbs, floor_ms=floor_ms)
        records.append(rec)
        print(rec, flush=True)
    ok = [r for r in records if "ms" in r and r["deterministic"]]
    best = min(ok, key=lambda r: r["ms"])
    write_records(records, args.out)
    print(f"best {best['ms']:.3f} ms (first {records[0].get('ms')}, floor {floor_ms:.3f})")
    print("MOEGRAPH_WGRAD_SHORT=" + ",".join(str(v) for v in best["config"]))


if __name__ == "__main__":
    main()
