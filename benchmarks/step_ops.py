"""Which torch ops spend a training step's GPU time: one eager step of a profile under the
profiler, aten ops sorted by their own CUDA time (the kernels a graph replays are the same).

    python3 benchmarks/step_ops.py [--profile qwen3-30b-a3b-4layer] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegraph_cli.train.harness import GraphTrainer, device_info  # noqa: E402
from moegraph_cli.train.runspec import build_model, resolve  # noqa: E402
from moegraph_cli.train.trainer import batches  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="qwen3-30b-a3b-4layer")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default="/tmp/step_ops.json")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    spec = resolve(args.profile, None, [])
    prof, run = spec.profile, spec.profile.run
    model = build_model(spec, torch.device("cuda"))
    tr = GraphTrainer(model, run.lr, run.weight_decay)
    it = batches(prof.model.vocab_size, run.batch, run.seq_len, run.seed, "cuda")
    for _ in range(3):
        tr.step(next(it))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as p:
        tr.step(next(it))
        torch.cuda.synchronize()
    rows = []
    for e in p.key_averages(group_by_input_shape=True):
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = e.self_cuda_time_total
        if dev > 0:
            rows.append({"op": e.key, "shapes": str(e.input_shapes)[:160], "count": e.count,
                         "self_cuda_ms": dev / 1e3})
    rows.sort(key=lambda r: -r["self_cuda_ms"])
    Path(args.out).write_text(json.dumps({"profile": args.profile, **device_info(),
                                          "ops": rows[:200]}, indent=2) + "\n")
    for r in rows[:args.top]:
        print(f"{r['self_cuda_ms']:8.3f} ms  x{r['count']:<3d} {r['op'][:40]:40} {r['shapes'][:110]}")


if __name__ == "__main__":
    main()
