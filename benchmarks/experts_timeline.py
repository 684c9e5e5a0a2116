"""Where the graphed expert fwd+bwd spends the time its kernels do not: the GPU timeline of
back-to-back replays, and the clocks the GPU ran them at.

    python3 benchmarks/experts_timeline.py [--tokens 8192] [--routing uniform,skewed]
        [--replays 10] [--out PATH]

Per (T, routing), Qwen3 shape (benchmarks/experts.py's case): the permute-free fwd+bwd
captured in one CUDA graph (as experts.py times it), then
- `replay_ms`: back-to-back replays timed with CUDA events (median of 5 rounds of `--replays`);
- from the profiler (CUPTI) over `--replays` replays: each kernel's start and end, so per
  replay the summed kernel time, the span from its first kernel's start to its last one's end,
  the idle time between kernels and the largest gaps with the kernels on both sides, and
  each kernel's time per replay (`kernels`, largest first);
- from NVML, sampled every 20 ms while 2 s of replays run: the SM clock (MHz), power (W) and
  the throttle reasons seen (a power-capped GPU runs its GEMMs slower than a short profile).

Writes experts_timeline.json (--out; default $OUT/experts_timeline.json).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from common import (capture_graph, default_out, environment, nvml_device, throughput_ms,
                    write_json)
from experts import SHAPES, fwd_flops, leaves_of, make_case


def kernel_events(prof) -> list[tuple[float, float, str]]:
    from torch.autograd import DeviceType
    out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def timeline(events, replays: int) -> dict:
    """Kernel time, span and gaps per replay (µs in, ms out)."""
    busy = sum(end - start for start, end, _ in events)
    span = events[-1][1] - events[0][0]
    gaps = []
    for (s0, e0, n0), (s1, e1, n1) in zip(events, events[1:]):
        if s1 > e0:
            gaps.append((s1 - e0, n0[:60], n1[:60]))
    gaps.sort(reverse=True)
    per_kernel: dict[str, list[float]] = {}
    for start, end, name in events:
        per_kernel.setdefault(name[:80], []).append(end - start)
    kernels = sorted(({"name": n, "launches_per_replay": len(d) / replays,
                       "us_per_replay": sum(d) / replays} for n, d in per_kernel.items()),
                     key=lambda k: -k["us_per_replay"])
    return {"kernels_per_replay": len(events) / replays,
            "kernels": kernels,
            "kernel_ms_per_replay": busy / replays / 1e3,
            "span_ms_per_replay": span / replays / 1e3,
            "idle_ms_per_replay": sum(g for g, _, _ in gaps) / replays / 1e3,
            "largest_gaps_us": [{"us": g, "after": a, "before": b} for g, a, b in gaps[:12]]}


def clocks(replay, seconds: float = 2.0) -> dict:
    import torch
    pynvml, h = nvml_device()
    reasons_of = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
        or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                            reasons_of(h)))
            time.sleep(0.02)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            replay()
        torch.cuda.synchronize()
    stop.set()
    t.join()
    steady = samples[len(samples) // 4:] or samples
    reasons = 0
    for _, _, r in steady:
        reasons |= r
    return {"sm_mhz_median": statistics.median(s for s, _, _ in steady),
            "sm_mhz_min": min(s for s, _, _ in steady),
            "max_sm_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
            "power_w_median": statistics.median(p for _, p, _ in steady),
            "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3,
            "throttle_reasons_mask": reasons, "samples": len(steady)}


def run(T: int, routing: str, skew: float, replays: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from moegraph_cli.moe.experts import permute_free_moe
    case, dout = make_case(SHAPES["qwen3"], T, routing, skew)
    leaves = leaves_of(case)
    graph = capture_graph(lambda: torch.autograd.grad(permute_free_moe(*case), leaves, dout))
    rec = {"T": T, "routing": routing,
           "replay_ms": throughput_ms(graph.replay, replays, 5)}
    rec["replay_tflops"] = 3 * fwd_flops("qwen3", T) / rec["replay_ms"] / 1e9
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rec.update(timeline(kernel_events(prof), replays))
    try:
        rec["clocks"] = clocks(graph.replay)
    except Exception as e:  # noqa: BLE001 - NVML missing or refused: the rest still counts
        rec["clocks"] = {"error": f"{type(e).__name__}: {e}"}
    del graph, case, dout
    torch.cuda.empty_cache()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--skew", type=float, default=0.25)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--out", default=str(default_out("experts_timeline.json")))
    args = ap.parse_args()
    doc = {**environment(True), "records": []}
    for T in map(int, args.tokens.split(",")):
        for routing in args.routing.split(","):
            r = run(T, routing, args.skew, args.replays)
            doc["records"].append(r)
            print(f"T={T} {routing}: replay {r['replay_ms']:.3f} ms "
                  f"({r['replay_tflops']:.0f} TF/s), kernels {r['kernel_ms_per_replay']:.3f}, "
                  f"span {r['span_ms_per_replay']:.3f}, idle {r['idle_ms_per_replay']:.3f} ms, "
                  f"{r['kernels_per_replay']:.0f} kernels; clocks {r['clocks']}", flush=True)
            write_json(args.out, doc)


if __name__ == "__main__":
    main()
