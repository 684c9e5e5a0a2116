"""What a rolled-back capture costs the eager steps after it.

    python3 benchmarks/rollback.py [--case olmoe-1b-7b:4x4096:100GiB,...] [--steps 10]
        [--out PATH]

Per case, in one process under the memory cap: eager phase A, eager phase B (the control: how
much two eager phases differ with nothing between them), then a capture of attn+moe on every
layer with per-entry pools, which is expected to run out of memory and roll back, then eager
phase C. Reported: B/A - 1 (noise), C/B - 1 (the rollback's cost), the allocated and reserved
bytes before the capture and after the rollback, and the allocator's cudaMalloc retries and
frees of cached blocks in each phase (`num_alloc_retries`, `num_device_free`).

Writes rollback.json (--out; default $OUT/rollback.json, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from common import REPO, default_out, environment, write_json

GIB = 2**30
CASES = "olmoe-1b-7b:4x4096:100GiB,qwen3-30b-a3b-12layer:2x4096:93GiB"


def phase(trainer, it, steps: int) -> dict:
    import torch

    from moegraph_cli.train.harness import timed_steps
    s0 = torch.cuda.memory_stats()
    r = timed_steps(trainer, it, steps, 1)
    s1 = torch.cuda.memory_stats()
    return {"step_ms": r["step_ms"], "all_ms": r["all_ms"],
            **{k: s1.get(k, 0) - s0.get(k, 0) for k in ("num_alloc_retries", "num_device_free",
                                                        "num_device_alloc")}}


def worker(case: str, steps: int) -> dict:
    import torch

    from moegraph_cli.train.harness import (build_session, capture_into, make_trainer,
                                            set_memory_limit)
    from moegraph_cli.train.runspec import build_model, resolve
    from moegraph_cli.train.trainer import batches
    from moegraph_cli.units import parse_bytes
    profile, load, limit = case.split(":")
    batch, seq = load.split("x")
    spec = resolve(profile, None, [f"run.batch={batch}", f"run.seq_len={seq}"])
    run, device = spec.profile.run, torch.device("cuda")
    set_memory_limit(parse_bytes(limit, "limit"), device)
    torch.manual_seed(run.seed)
    model = build_model(spec, device)
    trainer = make_trainer(model, run.lr, run.weight_decay)
    it = batches(spec.profile.model.vocab_size, run.batch, run.seq_len, run.seed, device,
                 run.data)
    rec = {"case": case, "A": phase(trainer, it, steps), "B": phase(trainer, it, steps)}
    torch.cuda.synchronize()
    rec["before_capture"] = {"allocated": torch.cuda.memory_allocated(),
                             "reserved": torch.cuda.memory_reserved()}
    session = build_session(model, ["attn", "moe"], "per_entry", trainer=trainer)
    rec["captured"] = capture_into(model, session, next(it))
    rec["failure"] = session.failure
    if rec["captured"]:
        session.rollback("the benchmark rolls a successful capture back")
    torch.cuda.synchronize()
    rec["after_rollback"] = {"allocated": torch.cuda.memory_allocated(),
                             "reserved": torch.cuda.memory_reserved()}
    rec["C"] = phase(trainer, it, steps)
    rec["noise"] = rec["B"]["step_ms"] / rec["A"]["step_ms"] - 1
    rec["rollback_cost"] = rec["C"]["step_ms"] / rec["B"]["step_ms"] - 1
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default=CASES, help="PROFILE:BATCHxSEQ:LIMIT, comma list")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(default_out("rollback.json")))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import json
        print(json.dumps(worker(args.worker, args.steps)))
        return
    import json
    doc = {"benchmark": "rollback", **environment(), "records": []}
    for case in args.case.split(","):  # one process a case: no allocator state shared
        p = subprocess.run([sys.executable, __file__, "--worker", case, "--steps",
                            str(args.steps)], cwd=REPO, capture_output=True, text=True,
                           timeout=600)
        try:
            rec = json.loads(p.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            rec = {"case": case, "error": p.stderr.strip()[-600:]}
        doc["records"].append(rec)
        write_json(args.out, doc)
        if "error" not in rec:
            print(f"{case:40} A {rec['A']['step_ms']:.1f} B {rec['B']['step_ms']:.1f} "
                  f"C {rec['C']['step_ms']:.1f} ms  noise {100 * rec['noise']:+.1f}%  "
                  f"rollback {100 * rec['rollback_cost']:+.1f}%  captured {rec['captured']}")
        else:
            print(f"{case:40} ERROR {rec['error'][-300:]}")


if __name__ == "__main__":
    main()
