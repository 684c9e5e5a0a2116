"""The uncalibrated planner against the allocator on every family's slice, at two loads, both
pool strategies, with and without recompute.

    python3 benchmarks/planner_slices.py [--profiles P,...] [--loads 1x1024,4x4096]
        [--recompute none,full] [--pools shared,per_entry] [--extra 4x4096:attn+fc1:shared]
        [--gpu-gib 139] [--jobs 4] [--steps 2] [--out PATH]

Each case is `moegraph plan ... --json` (CPU arithmetic, no calibration) beside `moegraph capture
--scopes attn,moe ... --json` in a fresh process: the predicted graph-phase and eager-phase peaks
and pool bytes against the measured peak reserved bytes of the same phases. error = predicted /
measured - 1; the goal is |error| <= 5% on the graph-phase peak and on the whole run's (the
larger phase's). Capture's eager phase runs on expandable segments (train/allocator.py) unless
PYTORCH_CUDA_ALLOC_CONF names them (`alloc_conf` records it).

Cases run several at a time on one GPU (each process has its own allocator, so one case's
figures do not depend on its neighbours): a case starts only while the predicted peaks of the
running cases, plus 1.5 GiB of CUDA context each, stay under --gpu-gib. A case whose prediction
alone exceeds it is recorded as not run, with the reason.

`--repredict FILE,...` (CPU is enough): no capture. The measured records of earlier runs of this
script (a later file's record of a case replaces an earlier one's) get new predictions from the
planner as it is now; each record keeps the run it was measured in (`measured_run`: GPU,
versions, commit, date) and the document records the commit that predicted. Capture does not
consult the planner (`--scopes` and `--pool` given), so a measurement stays valid while only the
memory model changes.

Writes planner_slices.json (--out; default $OUT/planner_slices.json, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import cli_json, default_out, environment, write_json

GIB = 2**30
CONTEXT = 1.5 * GIB  # a process's CUDA context and Triton state, outside the allocator
SLICES = ("qwen3-30b-a3b-4layer", "mixtral-8x7b-4layer", "moonlight-16b-a3b-4layer",
          "qwen1.5-moe-a2.7b-4layer", "qwen2-57b-a14b-4layer", "gpt-oss-20b-4layer",
          "olmoe-1b-7b")


def settings(load: str, recompute: str) -> list[str]:
    batch, seq = load.split("x")
    return ["--set", f"run.batch={batch}", "--set", f"run.seq_len={seq}",
            "--set", f"run.recompute={recompute}"]


def cases(args) -> list[dict]:
    grid = [(p, load, rc, pool) for p in args.profiles.split(",")
            for load in args.loads.split(",") for rc in args.recompute.split(",")
            for pool in args.pools.split(",")]
    for extra in filter(None, args.extra.split(",")):
        load, rc, pool = extra.split(":")
        grid += [(p, load, rc, pool) for p in args.profiles.split(",")]
    return [{"profile": p, "load": load, "recompute": rc, "pool": pool}
            for p, load, rc, pool in dict.fromkeys(grid)]


def predict(case: dict) -> dict:
    doc, err = cli_json(["plan", "--profile", case["profile"], "--budget", "4096GiB",
                         "--pool", case["pool"], "--scopes", "attn,moe",
                         *settings(case["load"], case["recompute"])], timeout=300)
    if doc is None:
        raise RuntimeError(f"plan failed: {err}")
    return {"graph_peak": doc["graph_phase_peak"], "eager_peak": doc["eager_phase_peak"],
            "pool_bytes": doc["pool_bytes"], "static_bytes": doc["static_bytes"],
            "worst_moment": doc["worst_moment"], "memory_model": doc["memory_model"],
            "pools": doc["pools"],
            "recomputed_scopes": sum(1 for la in doc["layers"]
                                     for v in (la.get("recompute") or {}).values()
                                     if v != "none")}


def measure(case: dict, args) -> dict:
    run, err = cli_json(["capture", "--profile", case["profile"], "--scopes", "attn,moe",
                         "--pool", case["pool"], "--steps", str(args.steps), "--warmup", "1",
                         *settings(case["load"], case["recompute"])],
                        timeout=args.case_timeout)
    if run is None or not run.get("captured_ok"):
        return {"error": (run or {}).get("failure") or err}
    return {"graph_peak": run["graph"]["peak_reserved"],
            "eager_peak": run["eager"]["peak_reserved"], "pool_bytes": run["pool_total_bytes"],
            "fallbacks": run["counters"].get("fallback"),
            "step_ms_graph": run["graph"].get("step_ms"),
            "step_ms_eager": run["eager"].get("step_ms"),
            "eager_peak_allocated": run["eager"]["peak_allocated"],
            "eager_expandable_segments": run["eager"].get("expandable_segments"),
            "graph_peak_allocated": run["graph"]["peak_allocated"],
            "pools": {p["name"]: {"reserved": p["bytes"], "allocated": p.get("allocated")}
                      for p in run["pools"]}}


class MemoryGate:
    """Admit a case while the predicted peaks of the running ones fit the GPU."""

    def __init__(self, capacity: float):
        self.capacity, self.used, self.cond = capacity, 0.0, threading.Condition()

    def run(self, need: float, fn):
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + need <= self.capacity)
            self.used += need
        try:
            return fn()
        finally:
            with self.cond:
                self.used -= need
                self.cond.notify_all()


def run_case(case: dict, args, gate: MemoryGate, doc: dict, lock: threading.Lock) -> None:
    try:
        case["predicted"] = predict(case)
    except RuntimeError as exc:
        case["error"] = str(exc)
        return
    need = case["predicted"]["graph_peak"] + CONTEXT
    if need > args.gpu_gib * GIB:
        case["not_run"] = f"predicted {need / GIB:.1f} GiB > the GPU's {args.gpu_gib} GiB"
    else:
        case["measured"] = gate.run(need, lambda: measure(case, args))
        m, p = case["measured"], case["predicted"]
        if "error" not in m:
            case["errors"] = {k: p[k] / m[k] - 1 for k in ("graph_peak", "eager_peak",
                                                            "pool_bytes") if m.get(k)}
    with lock:
        write_json(args.out, doc)


def repredict(files: list[str]) -> list[dict]:
    cases: dict[tuple, dict] = {}
    for f in files:
        doc = json.loads(Path(f).read_text())
        run = {k: doc.get(k) for k in ("gpu", "torch", "triton", "commit", "date")}
        for r in doc["records"]:
            if "errors" in r:
                key = (r["profile"], r["load"], r["recompute"], r["pool"])
                cases[key] = {**{k: r[k] for k in ("profile", "load", "recompute", "pool",
                                                   "measured")}, "measured_run": run}
    records = list(cases.values())
    with ThreadPoolExecutor(2) as pool:
        predicted = list(pool.map(predict, records))
    for r, p in zip(records, predicted):
        m = r["measured"]
        r["predicted"] = p
        r["errors"] = {k: p[k] / m[k] - 1 for k in ("graph_peak", "eager_peak", "pool_bytes")}
    return records


def summary(records: list[dict]) -> dict:
    """Graph-phase errors (`within_5pct`, `worst`), eager-phase ones, and those of the whole
    run's peak: the larger phase, predicted against measured."""
    done = [r for r in records if "errors" in r]
    errs = [r["errors"]["graph_peak"] for r in done]
    eager = [r["errors"]["eager_peak"] for r in done if "eager_peak" in r["errors"]]
    whole = [max(r["predicted"]["graph_peak"], r["predicted"]["eager_peak"])
             / max(r["measured"]["graph_peak"], r["measured"]["eager_peak"]) - 1
             for r in done if r["measured"].get("eager_peak")]
    worst = lambda v: max(v, key=abs) if v else None  # noqa: E731
    return {"cases": len(records), "measured": len(errs),
            "within_5pct": sum(abs(e) <= 0.05 for e in errs), "worst": worst(errs),
            "eager_within_5pct": sum(abs(e) <= 0.05 for e in eager), "eager_worst": worst(eager),
            "whole_run_within_5pct": sum(abs(e) <= 0.05 for e in whole),
            "whole_run_worst": worst(whole)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default=",".join(SLICES))
    ap.add_argument("--loads", default="1x1024,4x4096", help="BATCHxSEQ, comma list")
    ap.add_argument("--recompute", default="none,full")
    ap.add_argument("--pools", default="shared,per_entry")
    ap.add_argument("--extra", default="4x4096:attn+fc1:shared",
                    help="more LOAD:RECOMPUTE:POOL cases for every profile, comma list")
    ap.add_argument("--gpu-gib", type=float, default=134.0)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--case-timeout", type=int, default=300)
    ap.add_argument("--repredict", help="measured planner_slices files, comma list (no GPU)")
    ap.add_argument("--out", default=str(default_out("planner_slices.json")))
    args = ap.parse_args()
    if args.repredict:
        records = repredict(args.repredict.split(","))
        doc = {"benchmark": "planner_slices", "mode": "repredict", **environment(device=False),
               "measured_files": args.repredict.split(","), "records": records}
    else:
        import torch
        if not torch.cuda.is_available():
            sys.exit("benchmarks/planner_slices.py needs a CUDA GPU")
        records = cases(args)
        records.sort(key=lambda r: r["load"] != "4x4096")  # the large ones first: packing
        doc = {"benchmark": "planner_slices", **environment(), "records": records,
               "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
        gate, lock = MemoryGate(args.gpu_gib * GIB), threading.Lock()
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda c: run_case(c, args, gate, doc, lock), records))
    doc["summary"] = summary(records)
    write_json(args.out, doc)
    for r in records:
        e = r.get("errors", {})
        print(f"{r['profile']:26} {r['load']:7} {r['recompute']:9} {r['pool']:9} " + (
            "  ".join(f"{k} {100 * v:+.1f}%" for k, v in e.items()) if e else
            r.get("not_run") or str(r.get("error") or r.get("measured", {}).get("error"))))
    print(doc["summary"])


if __name__ == "__main__":
    main()
