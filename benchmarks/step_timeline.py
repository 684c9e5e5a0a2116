"""Where a training step spends the GPU time its kernels do not: the kernel timeline of whole
steps, eager and as one graph.

    python3 benchmarks/step_timeline.py [--profile qwen3-30b-a3b-4layer] [--steps 2]
        [--modes eager,step] [--set SECTION.FIELD=VALUE ...] [--out PATH]

Per mode, on one model (what benchmarks/whole_step.py times):
- `step_ms`: the median of 5 CUDA-event-timed steps after 3 warm-up steps;
- from the profiler (CUPTI) over `--steps` steps: each kernel's start and end, so per step the
  summed kernel time, the busy time (the union of the kernels' intervals: kernels on two
  streams at once count once), the span from the first kernel's start to the last one's end,
  the idle time, the idle time in gaps of each size class, and the largest gaps with the
  kernels on both sides; and the idle time summed by the pair of parts (whole_step.py's
  buckets) around each gap;
- from NVML while 2 s of steps run: the SM clock, the power and the throttle reasons.

Writes step_timeline.json (--out; default $OUT/step_timeline.json).
"""

from __future__ import annotations

import argparse
import gc

from common import default_out, environment, write_json
from experts_timeline import clocks, kernel_events
from whole_step import part_of

SIZES_US = (2, 5, 20, 100, 1000)  # gap size classes: below 2 us, 2-5, ..., 1000 and over


def union_ms(events) -> float:
    busy, end = 0.0, None
    for s, e, _ in events:  # sorted by start
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / 1e3


def timeline(events, steps: int) -> dict:
    """Kernel time, busy time, span and idle per step (us in, ms out)."""
    summed = sum(e - s for s, e, _ in events)
    span = events[-1][1] - events[0][0]
    gaps, end, last = [], events[0][1], events[0][2]
    for s, e, n in events[1:]:
        if s > end:
            gaps.append((s - end, last, n))
        if e >= end:
            end, last = e, n
    classes = {f"<{SIZES_US[0]}us": 0.0}
    for lo, hi in zip(SIZES_US, SIZES_US[1:] + (None,)):
        classes[f"{lo}-{hi}us" if hi else f">={lo}us"] = 0.0
    pairs: dict[str, float] = {}
    for g, a, b in gaps:
        key = next((f"{lo}-{hi}us" if hi else f">={lo}us"
                    for lo, hi in zip(SIZES_US, SIZES_US[1:] + (None,))
                    if g >= lo and (hi is None or g < hi)), f"<{SIZES_US[0]}us")
        classes[key] += g / steps / 1e3
        pair = f"{part_of(a)} -> {part_of(b)}"
        pairs[pair] = pairs.get(pair, 0.0) + g / steps / 1e3
    gaps.sort(reverse=True)
    return {"kernels_per_step": len(events) / steps,
            "kernel_ms_per_step": summed / steps / 1e3,
            "busy_ms_per_step": union_ms(events) / steps,
            "span_ms_per_step": span / steps / 1e3,
            "idle_ms_per_step": sum(g for g, _, _ in gaps) / steps / 1e3,
            "gaps_per_step": len(gaps) / steps,
            "idle_ms_by_gap_size": classes,
            "idle_ms_by_parts": dict(sorted(pairs.items(), key=lambda kv: -kv[1])[:15]),
            "largest_gaps_us": [{"us": g, "after": a[:80], "before": b[:80]}
                                for g, a, b in gaps[:15]]}


def measure(trainer, it, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from moegraph_cli.train.harness import timed_steps
    rec = {"step_ms": timed_steps(trainer, it, 5, 3)["step_ms"]}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.step(next(it))
        torch.cuda.synchronize()
    rec.update(timeline(kernel_events(prof), steps))
    try:
        rec["clocks"] = clocks(lambda: trainer.step(next(it)))
    except Exception as e:  # noqa: BLE001 - NVML missing or refused: the rest still counts
        rec["clocks"] = {"error": f"{type(e).__name__}: {e}"}
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="qwen3-30b-a3b-4layer")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--modes", default="eager,step")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--out", default=str(default_out("step_timeline.json")))
    args = ap.parse_args()

    import torch
    from moegraph_cli.train.harness import GraphTrainer, build_session, capture_into
    from moegraph_cli.train.runspec import build_model, resolve
    from moegraph_cli.train.trainer import batches

    spec = resolve(args.profile, None, args.set)
    prof, run = spec.profile, spec.profile.run
    dev = torch.device("cuda")
    torch.manual_seed(run.seed)
    model = build_model(spec, dev)
    trainer = GraphTrainer(model, run.lr, run.weight_decay)
    it = batches(prof.model.vocab_size, run.batch, run.seq_len, run.seed, dev)
    doc = {**environment(True), "profile": args.profile, "batch": run.batch,
           "seq_len": run.seq_len, "records": []}
    for mode in args.modes.split(","):
        session = None
        if mode != "eager":
            torch.cuda.empty_cache()
            session = build_session(model, mode.split("+"), "shared", trainer=trainer)
            if not capture_into(model, session, next(it)):
                doc["records"].append({"mode": mode, "failure": session.failure})
                continue
            trainer.session = session
        rec = {"mode": mode, **measure(trainer, it, args.steps)}
        doc["records"].append(rec)
        print(f"{mode}: step {rec['step_ms']:.2f} ms, kernels {rec['kernel_ms_per_step']:.2f}, "
              f"busy {rec['busy_ms_per_step']:.2f}, span {rec['span_ms_per_step']:.2f}, idle "
              f"{rec['idle_ms_per_step']:.2f} ms in {rec['gaps_per_step']:.0f} gaps "
              f"({rec['kernels_per_step']:.0f} kernels); by size {rec['idle_ms_by_gap_size']}; "
              f"by parts {rec['idle_ms_by_parts']}; clocks {rec['clocks']}", flush=True)
        write_json(args.out, doc)
        if session is not None:
            session.uninstall()
            trainer.session = None
            gc.collect()


if __name__ == "__main__":
    main()
