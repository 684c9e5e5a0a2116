"""The whole training step on one GPU: moegraph eager, attn+moe graphs and the whole-step
graph, split by part, against transformers' own step with and without torch.compile.

    python3 benchmarks/whole_step.py [--only tiny-qwen3-moe,qwen3-30b-a3b-4layer]
        [--steps 20] [--warmup 3] [--transformers eager,compile] [--hf-experts grouped_mm]
        [--ops 30] [--graph-modes "attn,moe;step"] [--kernels N] [--no-verify]
        [--set SECTION.FIELD=VALUE ...] [--out PATH]

A step is forward, backward and the AdamW update on the profile's synthetic batches. Per
profile, in one process and on one model (moegraph_cli.train.harness, what `moegraph capture`
runs):
- `eager`, `attn,moe` (per-layer graphs, one shared pool) and `step` (`--scopes step`, the
  whole step as one graph): median step ms over `--steps` CUDA-event-timed steps after
  `--warmup`, peak reserved / allocated bytes, and the GPU time of one more step split by part
  (profiler kernel names bucketed: optimizer, experts, loss, attention, GEMMs, gradient adds,
  copies and fills, other); the graph modes' pools and counters;
- `ops`: the top `--ops` aten ops of one eager step by self CUDA time, with their shapes;
- `step_predicted`: `moegraph plan --scopes step` (the planner's step pool and peak) beside
  the measured;
- `verify_lr0`: `moegraph verify --lr0` of both graph modes (losses bitwise equal to eager),
  each in a fresh process;
- `transformers`: the family's transformers class on the same shapes (config from the
  profile, random weights, bf16, SDPA or the class's eager attention where it has none,
  experts through `--hf-experts` where the class takes `experts_implementation`, torch's
  fused AdamW), in a fresh process per variant, run before moegraph's phases (so this
  process holds no model on the GPU meanwhile): `eager`, and `compile` (the model under
  torch.compile; `first_step_s` is the first step's wall time, compilation included). Median
  step ms (CUDA events, after two warm-up steps) and peak reserved bytes; `speedup` is its
  step time over that of moegraph's fastest mode.

Writes whole_step.json (--out; default $OUT/whole_step.json, else
benchmarks/results/whole_step.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

from common import (cli_json, default_out, environment, error_text, kernel_ms, time_ms,
                    write_json)

PROFILES = ["tiny-qwen3-moe", "qwen3-30b-a3b-4layer"]
PARTS = [  # (part, substrings of the kernel name), first match wins
    ("optimizer", ("adamw", "multi_tensor_apply", "fused_adam")),
    ("experts", ("_fc1_swiglu", "_slot_gemm", "_dact_swiglu", "_expert_wgrad", "_wgrad_ws",
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


def breakdown(step, per_part: int = 0) -> dict:
    """GPU ms of one step by part, its 15 largest kernels and, with `per_part`, the largest
    `per_part` kernels of each part."""
    kernels = kernel_ms(step, 240 if per_part else 90)
    parts: dict[str, float] = {}
    by_part: dict[str, dict[str, float]] = {}
    for name, ms in kernels.items():
        parts[part_of(name)] = parts.get(part_of(name), 0.0) + ms
        by_part.setdefault(part_of(name), {})[name] = ms
    out = {"parts_ms": parts, "gpu_ms": sum(parts.values()),
           "top_kernels_ms": dict(list(kernels.items())[:15])}
    if per_part:
        out["part_kernels_ms"] = {p: dict(list(k.items())[:per_part])
                                  for p, k in by_part.items()}
    return out


def op_table(step, top: int) -> list[dict]:
    """aten ops of one step by self CUDA time, with input shapes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        dev = getattr(e, "self_device_time_total", None)
        dev = e.self_cuda_time_total if dev is None else dev
        if dev > 0:
            rows.append({"op": e.key, "shapes": str(e.input_shapes)[:160], "count": e.count,
                         "self_cuda_ms": dev / 1e3})
    return sorted(rows, key=lambda r: -r["self_cuda_ms"])[:top]


def phase(trainer, it, steps, warmup, ops=0, per_part=0) -> dict:
    from moegraph_cli.train.harness import peaks, reset_peaks, timed_steps
    reset_peaks()
    t = timed_steps(trainer, it, steps, warmup)
    t.update(peaks())
    del t["all_ms"]
    t["breakdown"] = breakdown(lambda: trainer.step(next(it)), per_part)
    if ops:
        t["ops"] = op_table(lambda: trainer.step(next(it)), ops)
    return t


def run_moegraph(name: str, args) -> dict:
    import torch
    from moegraph_cli.train.harness import GraphTrainer, build_session, capture_into
    from moegraph_cli.train.runspec import build_model, resolve
    from moegraph_cli.train.trainer import batches

    spec = resolve(name, None, args.set)
    prof, run = spec.profile, spec.profile.run
    dev = torch.device("cuda")
    rec = {"batch": run.batch, "seq_len": run.seq_len}
    torch.manual_seed(run.seed)
    model = build_model(spec, dev)
    trainer = GraphTrainer(model, run.lr, run.weight_decay)
    it = batches(prof.model.vocab_size, run.batch, run.seq_len, run.seed, dev)
    rec["eager"] = phase(trainer, it, args.steps, args.warmup, args.ops, args.kernels)
    for label, scopes in (("attn,moe", ["attn", "moe"]), ("step", ["step"])):
        if label not in args.modes:
            continue
        torch.cuda.empty_cache()
        session = build_session(model, scopes, "shared", trainer=trainer)
        ok = capture_into(model, session, next(it))
        trainer.session = session if ok else None
        r = {"captured": ok, "failure": session.failure}
        if ok:
            torch.cuda.empty_cache()
            r.update(phase(trainer, it, args.steps, args.warmup, 0, args.kernels))
            r["pools"] = session.pools()
            r["counters"] = session.stats()["totals"]
            r["speedup_vs_eager"] = rec["eager"]["step_ms"] / r["step_ms"]
        session.uninstall()
        trainer.session = None
        rec[label] = r
        del session  # its step closures hold the trainer, and so the model and its flat buffers
        gc.collect()
    del model, trainer
    gc.collect()
    torch.cuda.empty_cache()
    # what this process still holds once the model is gone (a leak shows here)
    rec["left_on_gpu"] = {"allocated": torch.cuda.memory_allocated(),
                          "reserved": torch.cuda.memory_reserved()}
    return rec


def hf_worker(args) -> None:
    """In a fresh process: transformers' step on the profile's shapes; one JSON line."""
    import torch
    import transformers
    from moegraph_cli.train.runspec import resolve
    from moegraph_cli.train.trainer import synthetic_batch

    prof = resolve(args.profile, None, args.set).profile
    rec = {"compile": args.hf_compile}
    try:
        d = prof.model.to_hf_dict()
        arch = d["architectures"][0]
        cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
            **{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
        cls = getattr(transformers, arch)

        def build(attn, experts):
            kwargs = {"dtype": torch.bfloat16, "attn_implementation": attn}
            if experts is not None:
                kwargs["experts_implementation"] = experts
            with torch.device("cuda"):
                return cls._from_config(cfg, **kwargs)
        rec["attn_implementation"], rec["experts_implementation"] = "sdpa", args.hf_experts
        for _ in range(3):
            try:
                model = build(rec["attn_implementation"], rec["experts_implementation"])
                break
            except (TypeError, ValueError) as e:
                if "attention implementation" in str(e) and rec["attn_implementation"] == "sdpa":
                    rec["attn_implementation"] = "eager"  # no SDPA (GPT-OSS: its sinks)
                elif rec["experts_implementation"] is not None:
                    rec["experts_implementation"] = None  # the class takes no such argument
                else:
                    raise
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        forward = torch.compile(model) if args.hf_compile else model
        ids = synthetic_batch(prof.model.vocab_size, prof.run.batch, prof.run.seq_len, 0, 0,
                              "cuda")

        def step():
            opt.zero_grad(set_to_none=False)
            out = forward(input_ids=ids, labels=ids, output_router_logits=True)
            out.loss.backward()
            opt.step()
            return out.loss.detach()

        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        rec["first_step_s"] = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        rec["step_ms"] = time_ms(step, warmup=2, iters=args.steps)
        rec["peak_reserved"] = torch.cuda.max_memory_reserved()
        rec["loss"] = float(step())
    except Exception as e:  # noqa: BLE001 - the record says what failed
        rec["error"] = error_text(e)
    print(json.dumps(rec))


def run_transformers(name: str, variant: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", "--profile", name,
           "--steps", str(min(args.steps, 10)), "--hf-experts", args.hf_experts,
           *[x for s in args.set for x in ("--set", s)]]
    if variant == "compile":
        cmd.append("--hf-compile")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.hf_timeout)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.hf_timeout} s"}
    except (json.JSONDecodeError, IndexError):
        return {"error": (p.stderr.strip() or p.stdout.strip())[-400:]}


def run_profile(name: str, args) -> dict:
    rec: dict = {"profile": name}
    extra = [x for s in args.set for x in ("--set", s)]
    # transformers first, each variant in its own process while this one holds no model: when
    # the moegraph phases still kept their graph session (and through it the model, about
    # 26 GB of the loaded 4-layer Qwen3-30B), transformers + torch.compile (about 53 GB) ran
    # out of memory on an 80 GB card in two runs of three.
    hf_runs = {v: run_transformers(name, v, args)
               for v in filter(None, args.transformers.split(","))}
    try:
        rec.update(run_moegraph(name, args))
    except Exception as e:  # noqa: BLE001 - record it and go on
        rec["error"] = error_text(e)
    plan, err = cli_json(["plan", "--profile", name, "--scopes", "step", "--budget",
                          "4096GiB", *extra])
    rec["step_predicted"] = {"error": err} if plan is None else {
        "pool_bytes": plan["pool_bytes"], "peak": plan["predicted_peak"]}
    if not args.no_verify:
        rec["verify_lr0"] = []
        for scopes in ("attn,moe", "step"):
            doc, err = cli_json(["verify", "--profile", name, "--scopes", scopes, "--lr0",
                                 "--steps", "4", *extra], timeout=400)
            rec["verify_lr0"].append({"scopes": scopes, "error": err} if doc is None else {
                "scopes": scopes, "bitwise": doc.get("bitwise_equal"),
                "fallback": (doc.get("counters") or {}).get("fallback"),
                "grad_max_abs": doc.get("grad_max_abs")})
    rec["transformers"] = {}
    for variant, hf in hf_runs.items():
        best = min((rec.get(m, {}).get("step_ms") or float("inf") for m in
                    ("eager", "attn,moe", "step")))
        if hf.get("step_ms") and best < float("inf"):
            hf["speedup"] = hf["step_ms"] / best
        rec["transformers"][variant] = hf
    return rec


def print_table(records) -> None:
    print(f"\n{'profile':22} {'mode':16} {'step ms':>8} {'gpu ms':>7} {'peak res GiB':>12}  "
          f"parts (ms)")
    for r in records:
        if "error" in r:
            print(f"{r['profile']:22} ERROR {r['error']}")
        for mode in ("eager", "attn,moe", "step"):
            m = r.get(mode, {})
            if "step_ms" not in m:
                if m:
                    print(f"{r['profile']:22} {mode:16} not captured: {m.get('failure')}")
                continue
            parts = " ".join(f"{k}={v:.2f}" for k, v in sorted(
                m["breakdown"]["parts_ms"].items(), key=lambda kv: -kv[1]))
            print(f"{r['profile']:22} {mode:16} {m['step_ms']:8.2f} "
                  f"{m['breakdown']['gpu_ms']:7.2f} {m['peak_reserved'] / 2**30:12.2f}  {parts}")
        for variant, hf in r.get("transformers", {}).items():
            ms = f"{hf['step_ms']:8.2f}" if hf.get("step_ms") else "       -"
            print(f"{r['profile']:22} {'hf ' + variant:16} {ms} {'':7} "
                  f"{(hf.get('peak_reserved') or 0) / 2**30:12.2f}  {hf.get('error', '')}")
        for v in r.get("verify_lr0", []):
            print(f"    verify --lr0 {v['scopes']}: bitwise={v.get('bitwise')} "
                  f"fallback={v.get('fallback')} {v.get('error', '')[-200:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PROFILES), help="comma list of profiles")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--transformers", default="eager,compile",
                    help="transformers variants to run: eager, compile (empty: none)")
    ap.add_argument("--hf-experts", default="grouped_mm",
                    help="transformers' experts_implementation (grouped_mm, eager, ...)")
    ap.add_argument("--hf-timeout", type=int, default=900, help="seconds per variant")
    ap.add_argument("--ops", type=int, default=30, help="aten ops of the eager step (0: off)")
    ap.add_argument("--graph-modes", default="attn,moe;step", dest="modes",
                    help="graph modes to run after eager, ';'-separated: attn,moe and step "
                         "(empty: eager only)")
    ap.add_argument("--kernels", type=int, default=0,
                    help="record the largest N kernels of each part (0: off)")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--out", default=str(default_out("whole_step.json")))
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.modes = [m for m in args.modes.split(";") if m]
    bad = set(args.modes) - {"attn,moe", "step"}
    if bad:
        ap.error(f"--graph-modes: unknown mode {sorted(bad)[0]!r} (attn,moe; step)")
    if args.hf_worker:
        return hf_worker(args)
    import torch
    if not torch.cuda.is_available():
        sys.exit("benchmarks/whole_step.py: needs a CUDA GPU")
    doc = {"benchmark": "whole_step", **environment(), "records": []}
    for name in args.only.split(","):
        doc["records"].append(run_profile(name, args))
        write_json(args.out, doc)
    print_table(doc["records"])


if __name__ == "__main__":
    main()
