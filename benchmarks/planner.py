"""The planner's memory predictions against the allocator, and the out-of-memory a plan avoids.

    python3 benchmarks/planner.py [--modes oom,accuracy,families] [--profile qwen3-30b-a3b-12layer]
        [--limit 93GiB] [--no-calibrate] [--steps 3] [--warmup 1]
        [--measured benchmarks/results/architectures.json] [--out PATH]

Every prediction is `moegraph plan ... --json` and every measurement `moegraph capture ...
--json`, each in a fresh process, so no case sees another's allocator state. A measured peak
is the peak reserved bytes of the graph steps (capture's own leftovers released first), which
is what the planner models; error = predicted / measured - 1.

Modes (default: all three with a GPU, `families` alone without one):
- `oom` (GPU; --profile, default the 12-layer Qwen3-30B at batch 2 x 2048). First a one-layer
  calibration on the GPU (`moegraph_cli.commands.profile.calibrate_run`; --no-calibrate:
  formulas only). Then a memory cap L between the predicted needs of attn+moe on every layer
  with one shared pool and with per-entry pools (--limit overrides), and three runs under it:
  (a) `capture --pool per_entry --memory-limit L`: expected out of memory and rolled back
  (the published failure); (b) `plan --budget L --pool auto`, then `capture --plan` under L:
  predicted against measured peak, fallbacks 0; (c) a tighter budget halfway between
  capturing nothing and everything, where the plan captures a subset: no out of memory.
- `accuracy` (GPU): the uncalibrated (analytical) model on the shipped Qwen3 profiles, attn+moe
  on every layer, shared and per-entry pools: pool bytes and the eager and graph phases' peak
  reserved, predicted against measured.
- `families` (CPU is enough): for each record of an earlier measurement file (--measured: a
  capture.py / families.json document or the older architectures.json list; attn+moe on every
  layer), the uncalibrated predictions of the same configuration beside the measured figures.
  The measured figures stay those of the file's own run (its GPU, versions and date are
  copied into each record); only the predictions are made now.

Writes planner.json (--out; default $OUT/planner.json, else benchmarks/results/planner.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, cli_json, default_out, environment, write_json

GIB = 2**30
HUGE = "4096GiB"  # a budget under which the planner captures every requested scope
ACCURACY_CASES = [(p, pool) for p in ("tiny-qwen3-moe", "qwen3-30b-a3b-4layer",
                                      "qwen3-30b-a3b-12layer") for pool in ("shared", "per_entry")]


def plan_json(profile: str, budget, pool: str, calibration: str | None = None,
              out: str | None = None) -> dict:
    args = ["plan", "--profile", profile, "--budget", str(budget), "--pool", pool,
            "--scopes", "attn,moe"]
    args += ["--calibration", calibration] if calibration else []
    args += ["--out", out] if out else []
    doc, err = cli_json(args, timeout=300)
    if doc is None:
        raise RuntimeError(f"moegraph plan failed: {err}")
    return doc


def error(predicted, measured):
    return None if not (predicted and measured) else predicted / measured - 1


def capture_record(case: str, budget: int | None, plan: dict | None, run: dict | None,
                   err: str) -> dict:
    run = run or {}
    graph, eager = run.get("graph") or {}, run.get("eager") or {}
    failure = run.get("failure") or (err if not run else None)
    predicted = plan["predicted_peak"] if plan else None
    measured = graph.get("peak_reserved") if run.get("captured_ok") else None
    return {
        "mode": "oom", "case": case, "profile": run.get("profile"), "budget": budget,
        "pool": plan["pool"] if plan else run.get("pool"),
        "scopes_captured": sum(len(layer["scopes"]) for layer in plan["layers"]) if plan
        else len(run.get("per_scope") or []),
        "layers": [{"layer": la["layer"], "scopes": la["scopes"]} for la in plan["layers"]]
        if plan else None,
        "predicted_peak": predicted, "measured_peak": measured,
        "measured_peak_any": graph.get("peak_reserved"), "error": error(predicted, measured),
        "oom": bool(failure and "OutOfMemory" in str(failure)),
        "captured_ok": run.get("captured_ok"), "failure": failure,
        "fallback": (run.get("counters") or {}).get("fallback"),
        "eager_step_ms": eager.get("step_ms"), "graph_step_ms": graph.get("step_ms"),
        "eager_peak_reserved": eager.get("peak_reserved"),
        "pools_measured": run.get("pools"), "pools_predicted": plan["pools"] if plan else None,
        "memory_model": plan["memory_model"] if plan else None,
    }


def capture(profile, limit, args, plan_file=None, pool=None):
    cmd = ["capture", "--profile", profile, "--memory-limit", str(limit), "--steps",
           str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--plan", plan_file] if plan_file else ["--scopes", "attn,moe", "--pool", pool]
    return cli_json(cmd, timeout=args.case_timeout)


def oom_mode(args, work: Path) -> list[dict]:
    profile, calibration = args.profile, None
    if args.calibrate:
        cal = work / f"calibration_{profile}.yaml"
        p = subprocess.run([sys.executable, __file__, "--calibrate-worker", "--profile", profile,
                            "--file", str(cal)], cwd=REPO, capture_output=True, text=True,
                           timeout=args.case_timeout)
        if cal.is_file():
            calibration = str(cal)
        else:
            print(f"calibration failed ({p.stderr.strip()[-300:]}); formulas only",
                  file=sys.stderr)
    shared = plan_json(profile, HUGE, "shared", calibration)
    entry = plan_json(profile, HUGE, "per_entry", calibration)
    shared_all, entry_all = shared["required_budget"], entry["required_budget"]
    none = shared["eager_phase_peak"] + shared["headroom_bytes"]  # nothing captured
    if args.limit:
        from moegraph_cli.units import parse_bytes
        limit = parse_bytes(args.limit, "--limit")
    else:
        limit = int(max((shared_all + entry_all) / 2, shared_all * 1.04))
        limit = -(-limit // GIB) * GIB  # whole GiB, as a person would type it
    print(f"needs ({shared['memory_model']}): nothing {none / GIB:.2f} GiB, all shared "
          f"{shared_all / GIB:.2f}, all per_entry {entry_all / GIB:.2f}; cap {limit / GIB:.2f}",
          file=sys.stderr)
    run, err = capture(profile, limit, args, pool="per_entry")
    rec_a = capture_record("a: per_entry attn+moe, all layers", limit, None, run, err)
    rec_a["predicted_peak"] = entry["predicted_peak"]
    records = [rec_a]
    budget_c = int(none + 0.5 * (shared_all - none))
    for case, budget in (("b: plan --budget L --pool auto", limit),
                         ("c: plan under a tighter budget", budget_c)):
        plan_file = str(work / f"plan_{case[0]}.yaml")
        plan = plan_json(profile, budget, "auto", calibration, out=plan_file)
        run, err = capture(profile, budget, args, plan_file=plan_file)
        records.append(capture_record(case, budget, plan, run, err))
    for r in records:
        r.update(profile=profile, calibration="one-layer capture" if calibration else None)
    return records


def accuracy_mode(args) -> list[dict]:
    records = []
    for profile, pool in ACCURACY_CASES:
        rec = {"mode": "accuracy", "profile": profile, "pool": pool,
               "memory_model": "analytical (no calibration)"}
        run, err = cli_json(["capture", "--profile", profile, "--scopes", "attn,moe", "--pool",
                             pool, "--steps", str(args.steps), "--warmup", "1"],
                            timeout=args.case_timeout)
        if run is None:
            records.append({**rec, "error": err})
            continue
        plan = plan_json(profile, HUGE, pool)
        rec["measured"] = {"pool_bytes": run["pool_total_bytes"],
                           "eager_peak_reserved": run["eager"]["peak_reserved"],
                           "graph_peak_reserved": run["graph"]["peak_reserved"]}
        rec["predicted"] = {"pool_bytes": plan["pool_bytes"],
                            "eager_peak_reserved": plan["eager_phase_peak"],
                            "graph_peak_reserved": plan["graph_phase_peak"]}
        rec["errors"] = {k: error(rec["predicted"][k], v) for k, v in rec["measured"].items()}
        rec["captured_ok"] = run["captured_ok"]
        records.append(rec)
    return records


def _shown(path: str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def families_mode(args) -> list[dict]:
    doc = json.loads(Path(args.measured).read_text())
    measured = doc["records"] if isinstance(doc, dict) else doc
    records = []
    for m in measured:
        pool_bytes = m.get("pool_total_bytes", m.get("pool_bytes"))
        if m.get("graph_peak_reserved") is None or pool_bytes is None:
            continue  # a record without a graph phase (a reference-only run, a failure)
        pool = m.get("pool") or "shared"
        rec = {"mode": "families", "profile": m["profile"], "pool": pool,
               "measured_file": _shown(args.measured),
               "measured_run": {k: m.get(k, doc.get(k) if isinstance(doc, dict) else None)
                                for k in ("run", "gpu", "torch", "triton", "commit", "date")}}
        try:
            plan = plan_json(m["profile"], HUGE, pool)
        except RuntimeError as exc:
            records.append({**rec, "error": str(exc)})
            continue
        rec["memory_model"] = plan["memory_model"]
        for key, pred, meas in (("eager_peak", "eager_phase_peak", m.get("eager_peak_reserved")),
                                ("graph_peak", "graph_phase_peak", m["graph_peak_reserved"]),
                                ("pool_bytes", "pool_bytes", pool_bytes)):
            rec[key] = {"predicted": plan[pred], "measured": meas,
                        "error": error(plan[pred], meas)}
        records.append(rec)
    return records


def print_table(records) -> None:
    def gib(x):
        return "-" if x is None else f"{x / GIB:.2f}G"

    def pct(x):
        return "-" if x is None else f"{100 * x:+.1f}%"
    for r in records:
        if r["mode"] == "oom":
            print(f"{r['case'][:34]:34} budget {gib(r['budget']):>8} pool {str(r['pool']):9} "
                  f"scopes {r['scopes_captured']:3d} predicted {gib(r['predicted_peak']):>8} "
                  f"measured {gib(r['measured_peak']):>8} {pct(r['error']):>7} "
                  f"fallback {r['fallback']} OOM {'yes' if r['oom'] else 'no'}")
        elif "error" in r:
            print(f"{r['mode']:9} {r['profile']:28} {r.get('pool', ''):9} ERROR {r['error']}")
        elif r["mode"] == "accuracy":
            print(f"accuracy  {r['profile']:28} {r['pool']:9} " + "  ".join(
                f"{k} {pct(v)}" for k, v in r["errors"].items()))
        else:
            print(f"families  {r['profile']:28} {r['pool']:9} " + "  ".join(
                f"{k} {pct(r[k]['error'])}" for k in ("graph_peak", "eager_peak", "pool_bytes")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=None, help="comma list of oom, accuracy, families")
    ap.add_argument("--profile", default="qwen3-30b-a3b-12layer", help="the oom mode's profile")
    ap.add_argument("--limit", help="the oom mode's memory cap L (default: computed)")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                    help="calibrate the oom mode's plans on the GPU first")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--case-timeout", type=int, default=420, help="seconds per command")
    ap.add_argument("--measured", default=str(REPO / "benchmarks/results/architectures.json"),
                    help="the families mode's measurement file")
    ap.add_argument("--out", default=str(default_out("planner.json")))
    ap.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch
    if args.calibrate_worker:  # in a fresh process: one calibration file
        from moegraph_cli.commands.profile import calibrate_run
        from moegraph_cli.plan.calibration import write_entry
        from moegraph_cli.train.runspec import resolve
        write_entry(args.file, calibrate_run(resolve(args.profile), torch.device("cuda")))
        return
    modes = (args.modes or ("oom,accuracy,families" if torch.cuda.is_available()
                            else "families")).split(",")
    unknown = set(modes) - {"oom", "accuracy", "families"}
    if unknown:
        ap.error(f"unknown mode {sorted(unknown)[0]!r}")
    if {"oom", "accuracy"} & set(modes) and not torch.cuda.is_available():
        sys.exit("benchmarks/planner.py: the oom and accuracy modes need a CUDA GPU")
    doc = {"benchmark": "planner", **environment(), "modes": modes, "records": []}
    with tempfile.TemporaryDirectory(prefix="moegraph_planner_") as work:
        for mode in modes:
            if mode == "oom":
                doc["records"] += oom_mode(args, Path(work))
            elif mode == "accuracy":
                doc["records"] += accuracy_mode(args)
            else:
                doc["records"] += families_mode(args)
            write_json(args.out, doc)
    print_table(doc["records"])


if __name__ == "__main__":
    main()
