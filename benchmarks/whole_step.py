"""The whole training step, side by side in one process per profile: eager, attn+moe graphs
(shared pool) and the whole-step graph (`--scopes step`), with the GPU time of one step split
by part (profiler kernel names bucketed: optimizer, gradient adds, experts, loss, GEMMs,
attention, other), peak memory from the allocator, the step pool's bytes against the planner's
prediction, and lr-0 bitwise checks of both graph modes against eager.

    python3 benchmarks/whole_step.py --out $OUT/whole_step.json [--only tiny-qwen3-moe,...]

Every record carries the GPU, torch and Triton versions and the date.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moegraph_cli.train.harness import (GraphTrainer, build_session, capture_into, device_info,
                                        peaks, reset_peaks, timed_steps)
from moegraph_cli.train.runspec import build_model, resolve  # noqa: E402
from moegraph_cli.train.trainer import batches  # noqa: E402

PROFILES = ["tiny-qwen3-moe", "qwen3-30b-a3b-4layer"]
PARTS = [  # (part, substrings of the kernel name), first match wins
    ("optimizer", ("adamw", "multi_tensor_apply", "fused_adam")),
    ("experts", ("_fc1_swiglu", "_slot_gemm", "_dact_swiglu", "_expert_wgrad",
                 "_gather_combine", "radix_sort", "searchsorted")),
    ("loss", ("cross_entropy", "_ce_")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("grad_add", ("AddFunctor", "CUDAFunctor_add", "add_kernel")),
    ("copy_fill", ("copy", "Fill", "Memset", "Memcpy")),
]


def part_of(name: str) -> str:
    low = name.lower()
    for part, keys in PARTS:
        if any(k.lower() in low for k in keys):
            return part
    return "other"


def breakdown(step) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    parts, kernels = defaultdict(float), defaultdict(float)
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        parts[part_of(e.name)] += us / 1e3
        kernels[e.name[:90]] += us / 1e3
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:15])
    return {"parts_ms": dict(parts), "gpu_ms": sum(parts.values()), "top_kernels_ms": top}


def phase(trainer, it, steps, warmup) -> dict:
    reset_peaks()
    t = timed_steps(trainer, it, steps, warmup)
    t.update(peaks())
    del t["all_ms"]
    t["breakdown"] = breakdown(lambda: trainer.step(next(it)))
    return t


def run_profile(name: str, steps: int, warmup: int, extra: list[str]) -> dict:
    spec = resolve(name, None, extra)
    prof, run = spec.profile, spec.profile.run
    dev = torch.device("cuda")
    rec = {"profile": name, "batch": run.batch, "seq_len": run.seq_len, **device_info()}
    torch.manual_seed(run.seed)
    model = build_model(spec, dev)
    trainer = GraphTrainer(model, run.lr, run.weight_decay)
    it = batches(prof.model.vocab_size, run.batch, run.seq_len, run.seed, dev)
    rec["eager"] = phase(trainer, it, steps, warmup)
    for label, scopes in (("attn,moe", ["attn", "moe"]), ("step", ["step"])):
        torch.cuda.empty_cache()
        session = build_session(model, scopes, "shared", trainer=trainer)
        ok = capture_into(model, session, next(it))
        trainer.session = session if ok else None
        r = {"captured": ok, "failure": session.failure}
        if ok:
            torch.cuda.empty_cache()
            r.update(phase(trainer, it, steps, warmup))
            r["pools"] = session.pools()
            r["counters"] = session.stats()["totals"]
            r["speedup_vs_eager"] = rec["eager"]["step_ms"] / r["step_ms"]
        session.uninstall()
        trainer.session = None
        rec[label] = r
        gc.collect()
    from moegraph_cli.plan.memory import step_model
    pred = step_model(prof).predict_step()
    rec["step_predicted"] = {"pool_bytes": pred.pool_bytes, "peak": pred.peak}
    del model, trainer
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def verify(name: str, scopes: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "moegraph_cli.app", "verify", "--profile", name, "--scopes",
           scopes, "--lr0", "--steps", "4", "--json", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    try:
        doc = json.loads(p.stdout)
    except json.JSONDecodeError:
        return {"scopes": scopes, "error": (p.stderr or p.stdout).strip()[-400:]}
    return {"scopes": scopes, "bitwise": doc.get("bitwise_equal"),
            "fallback": doc.get("counters", {}).get("fallback"),
            "grad_max_abs": doc.get("grad_max_abs")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(PROFILES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", default="/tmp/whole_step.json")
    args = ap.parse_args()
    records = []
    for name in args.only.split(","):
        try:
            rec = run_profile(name, args.steps, args.warmup, args.set)
        except Exception as e:  # noqa: BLE001 - record it and go on
            rec = {"profile": name, "error": f"{type(e).__name__}: {str(e)[:300]}",
                   **device_info()}
        if not args.no_verify:
            extra = [x for s in args.set for x in ("--set", s)]
            rec["verify_lr0"] = [verify(name, s, extra) for s in ("attn,moe", "step")]
        records.append(rec)
        Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
    print(f"\n{'profile':22} {'mode':9} {'step ms':>8} {'gpu ms':>7} {'peak res GiB':>12}  parts (ms)")
    for r in records:
        if "error" in r:
            print(f"{r['profile']:22} ERROR {r['error']}")
            continue
        for mode in ("eager", "attn,moe", "step"):
            m = r.get(mode, {})
            if "step_ms" not in m:
                print(f"{r['profile']:22} {mode:9} not captured: {m.get('failure')}")
                continue
            parts = " ".join(f"{k}={v:.2f}" for k, v in sorted(
                m["breakdown"]["parts_ms"].items(), key=lambda kv: -kv[1]))
            print(f"{r['profile']:22} {mode:9} {m['step_ms']:8.2f} "
                  f"{m['breakdown']['gpu_ms']:7.2f} {m['peak_reserved'] / 2**30:12.2f}  {parts}")
        for v in r.get("verify_lr0", []):
            print(f"    verify --lr0 {v['scopes']}: bitwise={v.get('bitwise')} "
                  f"fallback={v.get('fallback')} {v.get('error', '')[-200:]}")


if __name__ == "__main__":
    main()
