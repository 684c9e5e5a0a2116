"""Where the expert path's time goes: per-kernel GPU time of one forward+backward, by profiler.

    python benchmarks/expert_breakdown.py [--tokens 1024,8192] [--out PATH]

For the Qwen3 shape (E=128, H=2048, F=768, k=8) and each T: the permute-free path at its
default tiles and at a few alternative slot block sizes, and the permute + torch._grouped_mm
baseline. Each case: CUDA-event time of fwd and fwd+bwd (median of 20, after warm-up), the
same captured in a CUDA graph (fwd+bwd, and the forward alone with its TFLOP/s: the whole
expert forward, route build and combine included) and the profiler's kernel table (name ->
total us over one fwd+bwd). JSON to --out with GPU, versions, date.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_experts import (SHAPES, grouped_mm_moe, make_case, time_fwd_bwd,  # noqa: E402
                         time_graph)

from moegraph_cli.train.harness import device_info  # noqa: E402
from moegraph_cli.moe.experts import permute_free_moe_with_drops, tile_configs  # noqa: E402
from moegraph_kernels.gather_gemm import GemmConfig  # noqa: E402


def kernel_table(fn) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = defaultdict(float)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            table[e.name[:80]] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    return dict(sorted(table.items(), key=lambda kv: -kv[1]))


def graph_ms(fn, args, dout, reps: int = 50, backward: bool = True) -> float:
    """fwd+bwd (or the forward alone, as training runs it: grad enabled, saving for backward)
    captured in one CUDA graph (autograd.grad into fresh buffers, as a captured backward does):
    the launch-free cost of the path, route build and combine included: the median of replays,
    each between its own pair of events. (main also times the forward graph back to back with
    moe_experts.time_graph, the way time_fwd_bwd times eager: on the H200 the graphed forward
    at T = 8192 read 25-80 us slower than eager per replay, and that tells the timing method's
    share from the graph's.)"""
    leaves = [args[0], args[2], args[3], args[4]]

    def body():
        y = fn(*args)
        return torch.autograd.grad(y, leaves, dout) if backward else y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    out = sorted(a.elapsed_time(b) for a, b in times)[len(times) // 2]
    del g
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--out", default="/tmp/expert_breakdown.json")
    ap.add_argument("--only", default=None, help="comma list of impls (default, block32, "
                    "..., grouped_mm_baseline)")
    args = ap.parse_args()
    E, H, F_, k = SHAPES["qwen3"]
    records = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, w, wgu, wd, dout = make_case(E, H, F_, k, T)
        fwd_flops = 2 * T * k * H * 3 * F_  # FC1 [H -> 2F] and FC2 [F -> H] per route
        base = tile_configs(T * k, E, H, F_, x.device)
        variants = {"default": base}
        for bm in (32, 64, 128):
            if bm == base.route_block:
                continue
            variants[f"block{bm}"] = base._replace(
                route_block=bm, fc1=base.fc1._replace(block_m=bm),
                fc2=base.fc2._replace(block_m=bm), dact=base.dact._replace(block_m=bm),
                dx=base.dx._replace(block_m=bm))
        # The split tail (kernels/slot_schedule.py, off by default): in FC1 / FC2, and in all
        # four slot GEMMs.
        tail = {kind: getattr(base, kind)._replace(split_tail=True)
                for kind in ("fc1", "fc2", "dact", "dx")}
        variants["split_tail"] = base._replace(fc1=tail["fc1"], fc2=tail["fc2"])
        variants["split_tail_all"] = base._replace(**tail)
        for tag, wcfg in (("wgrad_k64_s2", GemmConfig(128, 128, 64, 8, 8, 2)),
                          ("wgrad_k32_s3", GemmConfig(128, 128, 32, 8, 8, 3)),
                          ("wgrad_64x128_k64_s3", GemmConfig(64, 128, 64, 8, 4, 3))):
            variants[tag] = base._replace(wgrad_down=wcfg, wgrad_gate_up=wcfg)
        # FC1 alternatives: paired without the persistent loop, and a 96 KB paired tile
        # (two programs per SM).
        variants["fc1_not_persistent"] = base._replace(fc1=base.fc1._replace(persistent=False))
        variants["fc1_p96"] = base._replace(fc1=GemmConfig(base.fc1.block_m, 64, 64, 8, 8, 3)
                                            .with_variant("tma+pair"))
        impls = {name: (lambda *a, c=c: permute_free_moe_with_drops(*a, None, c)[0])
                 for name, c in variants.items()}
        impls["grouped_mm_baseline"] = grouped_mm_moe
        if args.only:
            impls = {n: f for n, f in impls.items() if n in args.only.split(",")}
        for name, fn in impls.items():
            args_ = (x, ids, w, wgu, wd)
            try:
                fwd, bwd = time_fwd_bwd(fn, args_, dout, reps=20)

                def once():
                    for t in (x, w, wgu, wd):
                        t.grad = None
                    fn(*args_).backward(dout)
                table = kernel_table(once)
            except Exception as e:  # noqa: BLE001
                records.append(dict(T=T, impl=name, error=str(e)[:300]))
                print(T, name, "error", str(e)[:200])
                continue
            try:
                gms = graph_ms(fn, args_, dout)
                gfwd = graph_ms(fn, args_, dout, backward=False)
                gfwd_b2b = time_graph(lambda: fn(*args_), 50)
            except Exception as e:  # noqa: BLE001 - e.g. an op that cannot be captured
                gms = gfwd = gfwd_b2b = None
                print(T, name, "graph capture failed:", str(e)[:200])
            cfg = variants.get(name)
            rec = dict(T=T, impl=name, fwd_ms=fwd, bwd_ms=bwd, total_ms=fwd + bwd,
                       graph_fwd_bwd_ms=gms, graph_fwd_ms=gfwd,
                       graph_fwd_tflops=None if gfwd is None else fwd_flops / gfwd / 1e9,
                       graph_fwd_back_to_back_ms=gfwd_b2b,
                       fwd_tflops=fwd_flops / fwd / 1e9,
                       config=None if cfg is None else repr(cfg), kernels_us=table,
                       **device_info())
            records.append(rec)
            print(f"T={T} {name}: fwd {fwd:.3f} bwd {bwd:.3f} total {fwd + bwd:.3f} ms; "
                  f"graphed fwd+bwd {gms if gms is None else round(gms, 3)} ms, graphed fwd "
                  f"{gfwd if gfwd is None else round(gfwd, 3)} ms (back to back "
                  f"{gfwd_b2b if gfwd_b2b is None else round(gfwd_b2b, 3)} ms)")
            for kname, us in list(table.items())[:12]:
                print(f"    {us:9.1f} us  {kname}")
    Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
    print(f"\n{'T':>6} {'impl':22} {'eager fwd+bwd':>14} {'graphed fwd+bwd':>16}")
    for r in records:
        if "error" not in r:
            g = "-" if r["graph_fwd_bwd_ms"] is None else f"{r['graph_fwd_bwd_ms']:.3f}"
            print(f"{r['T']:6d} {r['impl']:22} {r['total_ms']:14.3f} {g:>16}")


if __name__ == "__main__":
    main()
