"""Collect the JSON documents of distributed (and matching 1-GPU) runs into one results file.

    python3 benchmarks/distributed.py OUTDIR > benchmarks/results/distributed.json

OUTDIR holds `<stage>.json` files, each the `--json` output of one `moegraph capture`,
`verify` or `plan` run (benchmarks/run_dist.sh writes them). Every record keeps the figures
the run printed, with the GPU, torch and Triton versions, the world size and the date the run
itself recorded; nothing is computed here but ratios of printed figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30


def _gib(x):
    return None if x is None else round(x / GIB, 3)


def capture_record(name: str, d: dict) -> dict:
    e, g = d["eager"], d["graph"]
    ranks = d.get("ranks") or [{"rank": 0, "eager": e, "graph": g, "counters": d["counters"]}]
    rec = {
        "stage": name, "command": "capture", "profile": d["profile"],
        "world_size": d.get("world_size", 1), "ep": d.get("ep", 1),
        "batch_per_rank": d["batch"], "seq_len": d["seq_len"], "pool": d["pool"],
        "moe_mode": d["moe_mode"], "steps": d["steps"],
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
        "gpu": d.get("gpu"), "torch": d.get("torch"), "triton": d.get("triton"),
        "date": d.get("date"),
    }
    if d.get("memory_limit"):
        rec["memory_limit_gib"] = _gib(d["memory_limit"]["limit_bytes"])
    if d.get("plan"):
        p = d["plan"]
        measured = [r["graph"].get("peak_reserved") for r in ranks]
        rec["plan"] = {"predicted_peak_gib": _gib(p["predicted_peak"]),
                       "measured_peak_reserved_gib": [_gib(m) for m in measured],
                       "error": [m / p["predicted_peak"] - 1 if m else None for m in measured]}
    return rec


def verify_record(name: str, d: dict) -> dict:
    ranks = d.get("ranks") or [{"rank": 0, **d}]
    rec = {"stage": name, "command": "verify", "profile": d["profile"],
           "world_size": d.get("world_size", 1), "ep": d.get("ep", 1), "lr": d["lr"],
           "steps": d["steps"], "moe_mode": d["moe_mode"], "passed": d["passed"],
           "verdict": d["verdict"],
           "per_rank": [{"rank": r["rank"], "bitwise_equal": r.get("bitwise_equal"),
                         "grad_max_abs": r.get("grad_max_abs"),
                         "fallback": (r.get("counters") or {}).get("fallback")} for r in ranks],
           "gpu": d.get("gpu"), "torch": d.get("torch"), "triton": d.get("triton"),
           "date": d.get("date")}
    ref = d.get("reference")
    if ref and ref.get("kind") == "single":
        rec["single_process"] = {k: ref[k] for k in ("single_losses", "distributed_losses",
                                                     "max_rel", "tolerance", "passed")}
    return rec


def plan_record(name: str, d: dict) -> dict:
    return {"stage": name, "command": "plan", "profile": d["profile"],
            "world_size": d.get("world", 1), "ep": d.get("ep", 1),
            "budget_gib": _gib(d["budget"]), "pool": d["pool"],
            "predicted_peak_gib": _gib(d["predicted_peak"]),
            "static_gib": _gib(d["static_bytes"]),
            "layers_with_scopes": sum(1 for layer in d["layers"] if layer["scopes"]),
            "left_out": d.get("left_out")}


def main(outdir: str) -> None:
    records = []
    for path in sorted(Path(outdir).glob("*.json")):
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # a run that failed printed no document; its .err says why
        name = path.stem
        if "eager" in d and "graph" in d:
            records.append(capture_record(name, d))
        elif "eager_losses" in d:
            records.append(verify_record(name, d))
        elif "predicted_peak" in d and "layers" in d:
            records.append(plan_record(name, d))
    json.dump({"records": records}, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
