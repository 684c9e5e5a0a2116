"""Several GPUs of one host: FSDP2 + expert parallelism through the CLI, against one process.

    python3 benchmarks/distributed.py [--nproc 2] [--ep 2] [--stages NAME[:SECONDS],...]
        [--budget auto] [--out PATH]

Each stage is one `moegraph ... --nproc N --ep E --json` command in a fresh process
(torch.distributed.run underneath, NCCL, MOEGRAPH_COLLECTIVE_TIMEOUT_S=240), under its own
time limit; its JSON document is reduced to the figures it printed (nothing is computed here
but ratios of printed figures). Stages, in order (default: all):
- verify_tiny, verify_4l: `verify --lr0` on tiny-qwen3-moe and qwen3-30b-a3b-4layer: graph
  against eager on every rank, losses bitwise equal, gradient max-abs, fallbacks;
- ref_4l: `verify --no-lr0 --reference single --tolerance 2e-2` on the 4-layer model: the
  per-step losses against one process training the same global batches;
- capture_tiny, capture_4l: `capture` eager against graph per rank (step ms, tokens/s per GPU,
  peak reserved per rank, counters); single_tiny, single_4l: the same on the first GPU alone;
- full_plan, full_per_entry, full_planned: the full 48-layer Qwen3-30B-A3B at batch 1 x 1024 per
  rank: `plan --budget BUDGET` (one rank's peak), attn+moe with per-entry pools on every layer
  (expected out of memory, rolled back on every rank), `capture --plan` (predicted against
  measured peak per rank).
Needs `--nproc` GPUs (full_plan alone runs on a CPU).

Writes distributed.json (--out; default $OUT/distributed.json, else
benchmarks/results/distributed.json).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from common import cli_json, default_out, environment, write_json

GIB = 2**30
L4 = ["--profile", "qwen3-30b-a3b-4layer"]
FULL = ["--profile", "qwen3-30b-a3b", "--set", "run.batch=1", "--set", "run.seq_len=1024"]
STAGES = ["verify_tiny", "capture_tiny", "verify_4l", "ref_4l", "capture_4l", "single_tiny",
          "single_4l", "full_plan", "full_per_entry", "full_planned"]


def stage_command(stage: str, dist: list[str], budget: str, plan_file: str) -> tuple[list, dict]:
    """(CLI arguments, extra environment) of a stage."""
    one_gpu = {"CUDA_VISIBLE_DEVICES": "0"}
    return {
        "verify_tiny": (["verify", *dist, "--steps", "4"], {}),
        "capture_tiny": (["capture", *dist], {}),
        "verify_4l": (["verify", *L4, *dist, "--steps", "3"], {}),
        "ref_4l": (["verify", *L4, *dist, "--steps", "3", "--no-lr0", "--reference", "single",
                    "--tolerance", "2e-2"], {}),
        "capture_4l": (["capture", *L4, *dist], {}),
        "single_tiny": (["capture"], one_gpu),
        "single_4l": (["capture", *L4], one_gpu),
        "full_plan": (["plan", *FULL, *dist, "--budget", budget, "--out", plan_file], {}),
        "full_per_entry": (["capture", *FULL, *dist, "--pool", "per_entry", "--steps", "3",
                            "--warmup", "1"], {}),
        "full_planned": (["capture", *FULL, *dist, "--plan", plan_file, "--steps", "5",
                          "--warmup", "2"], {}),
    }[stage]


def _gib(x):
    return None if x is None else round(x / GIB, 3)


def _run_info(d: dict) -> dict:
    return {k: d.get(k) for k in ("gpu", "torch", "triton", "date")}


def capture_record(d: dict) -> dict:
    e, g = d["eager"], d["graph"]
    ranks = d.get("ranks") or [{"rank": 0, "eager": e, "graph": g, "counters": d["counters"]}]
    rec = {
        "command": "capture", "profile": d["profile"], "world_size": d.get("world_size", 1),
        "ep": d.get("ep", 1), "batch_per_rank": d["batch"], "seq_len": d["seq_len"],
        "pool": d["pool"], "moe_mode": d["moe_mode"], "steps": d["steps"],
        "eager_step_ms": e["step_ms"], "graph_step_ms": g.get("step_ms"),
        "throughput_change": (d["speedup"] - 1) if d.get("speedup") else None,
        "tokens_per_s_per_gpu_eager": e.get("tokens_per_s"),
        "tokens_per_s_per_gpu_graph": g.get("tokens_per_s"),
        "captured_ok": d["captured_ok"], "failure": d.get("failure"),
        "pool_total_gib": _gib(d.get("pool_total_bytes")),
        "dropped_routes": d.get("dropped_routes"),
        "per_rank": [{
            "rank": r["rank"], "eager_step_ms": r["eager"]["step_ms"],
            "graph_step_ms": r["graph"].get("step_ms"),
            "eager_peak_reserved_gib": _gib(r["eager"]["peak_reserved"]),
            "graph_peak_reserved_gib": _gib(r["graph"].get("peak_reserved")),
            "peak_reserved_change": (r["graph"]["peak_reserved"] / r["eager"]["peak_reserved"]
                                     - 1) if r["graph"].get("peak_reserved") else None,
            "captured": r["counters"]["captured"], "replayed": r["counters"]["replayed"],
            "fallback": r["counters"]["fallback"]} for r in ranks],
        **_run_info(d),
    }
    if d.get("plan"):
        p = d["plan"]
        measured = [r["graph"].get("peak_reserved") for r in ranks]
        rec["plan"] = {"predicted_peak_gib": _gib(p["predicted_peak"]),
                       "measured_peak_reserved_gib": [_gib(m) for m in measured],
                       "error": [m / p["predicted_peak"] - 1 if m else None for m in measured]}
    return rec


def verify_record(d: dict) -> dict:
    ranks = d.get("ranks") or [{"rank": 0, **d}]
    rec = {"command": "verify", "profile": d["profile"], "world_size": d.get("world_size", 1),
           "ep": d.get("ep", 1), "lr": d["lr"], "steps": d["steps"], "moe_mode": d["moe_mode"],
           "passed": d["passed"], "verdict": d["verdict"],
           "per_rank": [{"rank": r["rank"], "bitwise_equal": r.get("bitwise_equal"),
                         "grad_max_abs": r.get("grad_max_abs"),
                         "fallback": (r.get("counters") or {}).get("fallback")} for r in ranks],
           **_run_info(d)}
    ref = d.get("reference")
    if ref and ref.get("kind") == "single":
        rec["single_process"] = {k: ref[k] for k in ("single_losses", "distributed_losses",
                                                     "max_rel", "tolerance", "passed")}
    return rec


def plan_record(d: dict) -> dict:
    return {"command": "plan", "profile": d["profile"], "world_size": d.get("world", 1),
            "ep": d.get("ep", 1), "budget_gib": _gib(d["budget"]), "pool": d["pool"],
            "predicted_peak_gib": _gib(d["predicted_peak"]),
            "static_gib": _gib(d["static_bytes"]),
            "layers_with_scopes": sum(1 for layer in d["layers"] if layer["scopes"]),
            "left_out": d.get("left_out")}


def record_of(d: dict) -> dict:
    if "eager" in d and "graph" in d:
        return capture_record(d)
    if "eager_losses" in d:
        return verify_record(d)
    return plan_record(d)


def summary(rec: dict) -> str:
    if "error" in rec:
        return f"ERROR {rec['error']}"
    if rec["command"] == "verify":
        return rec["verdict"]
    if rec["command"] == "plan":
        return f"predicted peak {rec['predicted_peak_gib']} GiB a rank"
    return (f"eager {rec['eager_step_ms']:.2f} ms, graph {rec['graph_step_ms'] or 0:.2f} ms, "
            f"captured_ok {rec['captured_ok']}" + (f", {rec['failure']}" if rec['failure'] else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="comma list of NAME[:SECONDS] (default limit 300 s each)")
    ap.add_argument("--budget", default="auto", help="the full model's plan budget")
    ap.add_argument("--out", default=str(default_out("distributed.json")))
    args = ap.parse_args()
    stages = [(s.partition(":")[0], int(s.partition(":")[2] or 300))
              for s in args.stages.split(",") if s]
    unknown = [name for name, _ in stages if name not in STAGES]
    if unknown:
        ap.error(f"unknown stage {unknown[0]!r}; known: {', '.join(STAGES)}")
    os.environ.setdefault("MOEGRAPH_COLLECTIVE_TIMEOUT_S", "240")
    dist = ["--nproc", str(args.nproc), "--ep", str(args.ep)]
    doc = {"benchmark": "distributed", **environment(), "nproc": args.nproc, "ep": args.ep,
           "records": []}
    with tempfile.TemporaryDirectory(prefix="moegraph_dist_") as work:
        plan_file = str(Path(work) / "full_plan.yaml")
        for name, limit in stages:
            cli, env = stage_command(name, dist, args.budget, plan_file)
            d, err = cli_json(cli, timeout=limit, env=env)
            rec = {"stage": name, "command_line": "moegraph " + " ".join(cli)}
            if env:
                rec["env"] = env
            if d is None:
                rec["error"] = err
            else:
                try:
                    rec.update(record_of(d))
                except KeyError as exc:  # a document of another shape: keep its error line
                    rec["error"] = f"unexpected document (no {exc}); stderr: {err}"
            doc["records"].append(rec)
            write_json(args.out, doc)
            print(f"{name}: {summary(rec)}", flush=True)


if __name__ == "__main__":
    main()
