"""Planner benchmark on one GPU: the planner's predicted peak against the measured one, and the
out-of-memory it avoids.

    python benchmarks/planner.py [--profile qwen3-30b-a3b-12layer] [--out PATH]
        [--limit 90GiB] [--no-calibrate] [--no-steady] [--steps 3] [--warmup 1]
    python benchmarks/planner.py --mode profile-tiny [--out PATH]

Mode `planner` (default; qwen3-30b-a3b-12layer is batch 2 x seq 2048):
0. calibrate: measure a one-layer copy on the GPU (profile.calibrate_run) so the plans below
   use measured scope sizes and allocator offsets (--no-calibrate: formulas only);
1. pick a memory limit L between the predicted peaks of capturing attn+moe on every layer
   with one shared pool and with per-entry pools (--limit overrides), then run
   `moegraph capture --pool per_entry --memory-limit L`: expected to run out of memory and
   roll back (the published failure);
2. `moegraph plan --budget L --pool auto` (expected: attn+moe on every layer, shared pool),
   then `moegraph capture --plan` under the same limit: predicted vs measured peak reserved,
   fallbacks 0;
3. a tighter budget, halfway between capturing nothing and capturing everything, where the
   plan captures a subset; run it under that limit: no OOM.
Every capture runs in a fresh subprocess (`python -m moegraph_cli.app capture ... --json`), so
no case sees another's allocator state. capture reports the peak reserved over capture and
graph steps (capture-time caches included); with --steady (default) each plan also runs
profile.steady_peaks, the peak of graph steps after `empty_cache()`, which is what the
planner models. Records go to --out as JSON; a table is printed last.

Mode `profile-tiny`: `moegraph profile --profile tiny-qwen3-moe --plot` writes
profile_tiny.png (and its savings and calibration files) next to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moegraph_cli.plan.calibration import lookup  # noqa: E402
from moegraph_cli.plan.memory import step_model  # noqa: E402
from moegraph_cli.plan.runkey import run_key  # noqa: E402
from moegraph_cli.plan.planner import plan_command  # noqa: E402
from moegraph_cli.train.runspec import resolve  # noqa: E402
from moegraph_cli.units import fmt_bytes, parse_bytes  # noqa: E402

GIB = 2**30
CASE_TIMEOUT_S = 420


def run_json(cmd: list[str], timeout: int = CASE_TIMEOUT_S) -> dict:
    """Run a command that prints JSON on stdout; never raises (the error is the record)."""
    t0 = time.perf_counter()
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "wall_s": timeout}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:500],
                "returncode": proc.returncode, "wall_s": wall}
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


def capture_cli(profile: str, limit: int, steps: int, warmup: int, plan: str | None = None,
                pool: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "moegraph_cli.app", "capture", "--profile", profile,
           "--memory-limit", str(limit), "--steps", str(steps), "--warmup", str(warmup),
           "--json"]
    if plan:
        cmd += ["--plan", plan]
    else:
        cmd += ["--scopes", "attn,moe", "--pool", pool]
    return run_json(cmd)


def worker(args) -> None:
    """Runs inside a subprocess: one GPU job, JSON on the last stdout line."""
    import torch

    from moegraph_cli.plan.calibration import write_entry
    from moegraph_cli.commands.profile import calibrate_run, steady_peaks

    spec = resolve(args.profile)
    if args.worker == "calibrate":
        write_entry(args.file, calibrate_run(spec, torch.device("cuda")))
        print(json.dumps({"ok": True, "file": args.file}))
    else:
        print(json.dumps(steady_peaks(spec, args.file, args.limit, args.steps, args.warmup)))


def record(case: str, profile: str, budget: int, plan: dict | None, run: dict,
           steady: dict | None, info: dict) -> dict:
    failure = run.get("failure") or run.get("error")
    counters = run.get("counters") or {}
    # scopes the run tried to capture; `captured_ok` says whether they were installed (a
    # rolled-back capture leaves every scope eager)
    if plan is not None:
        captured = sum(len(layer["scopes"]) for layer in plan["layers"])
    else:
        captured = len(run.get("per_scope") or [])
    predicted = plan["predicted_peak"] if plan else None
    # a measured peak compares with the prediction only if the graphs really ran
    measured = (run.get("graph") or {}).get("peak_reserved") if run.get("captured_ok") else None
    steady_peak = ((steady or {}).get("graph") or {}).get("peak_reserved") \
        if (steady or {}).get("captured_ok") else None
    rec = {
        "case": case, "profile": profile, "budget": budget,
        "pool": plan["pool"] if plan else run.get("pool"),
        "scopes_captured": captured,
        "layers": [{"layer": layer["layer"], "scopes": layer["scopes"]}
                   for layer in plan["layers"]] if plan else None,
        "predicted_peak": predicted, "measured_peak": measured,
        "measured_peak_any": (run.get("graph") or {}).get("peak_reserved"),
        "error_pct": None if not (predicted and measured) else
        100.0 * (measured - predicted) / predicted,
        "measured_steady_peak": steady_peak,
        "steady_error_pct": None if not (predicted and steady_peak) else
        100.0 * (steady_peak - predicted) / predicted,
        "oom": bool(failure and "OutOfMemory" in str(failure)),
        "captured_ok": run.get("captured_ok"), "failure": failure,
        "fallback": counters.get("fallback"), "replayed": counters.get("replayed"),
        "eager_step_ms": (run.get("eager") or {}).get("step_ms"),
        "graph_step_ms": (run.get("graph") or {}).get("step_ms"),
        "eager_peak_reserved": (run.get("eager") or {}).get("peak_reserved"),
        "pools_measured": run.get("pools"), "pools_predicted": plan["pools"] if plan else None,
        "memory_model": plan["memory_model"] if plan else None,
        "wall_s": run.get("wall_s"),
        "gpu": run.get("gpu") or info.get("gpu"), "torch": run.get("torch") or info.get("torch"),
        "triton": run.get("triton") or info.get("triton"),
        "date": datetime.date.today().isoformat(),
    }
    return rec


def planner_mode(args) -> list[dict]:
    profile = args.profile
    spec = resolve(profile)
    results_dir = Path(args.out).parent
    results_dir.mkdir(parents=True, exist_ok=True)
    cal = results_dir / f"calibration_{profile}.yaml"
    info: dict = {}
    if args.calibrate:
        c = run_json([sys.executable, __file__, "--worker", "calibrate", "--profile", profile,
                      "--file", str(cal)])
        if c.get("error"):
            print(f"calibration failed ({c['error']}); formulas only", file=sys.stderr)
    calibration = str(cal) if args.calibrate and cal.is_file() else None
    entry, source = lookup(calibration, run_key(spec.profile))
    model = step_model(spec.profile, "cuda", entry)
    n = len(model.scopes)
    # Budgets are set from what a plan requires (predicted peak + allocation headroom).
    shared_all = model.predict((True,) * n, "shared").required
    entry_all = model.predict((True,) * n, "per_entry").required
    none = model.predict((False,) * n, "shared").required
    print(f"predicted ({source}): nothing {fmt_bytes(none)}, all shared {fmt_bytes(shared_all)}, "
          f"all per_entry {fmt_bytes(entry_all)}", file=sys.stderr)
    if args.limit:
        limit = parse_bytes(args.limit, "--limit")
    else:
        limit = int(max((shared_all + entry_all) / 2, shared_all * 1.04))
        limit = -(-limit // GIB) * GIB  # whole GiB, as a person would type it
    if limit >= entry_all:
        print(f"warning: limit {fmt_bytes(limit)} is above the per_entry prediction "
              f"{fmt_bytes(entry_all)}; per_entry may not run out of memory", file=sys.stderr)
    steps, warmup = args.steps, args.warmup
    records = []

    # (a) per_entry, attn+moe everywhere, under L: out of memory, rolled back
    run = capture_cli(profile, limit, steps, warmup, pool="per_entry")
    info = {k: run.get(k) for k in ("gpu", "torch", "triton")}
    rec = record("a: per_entry attn+moe, all layers", profile, limit, None, run, None, info)
    rec["predicted_peak"] = model.predict((True,) * n, "per_entry").peak
    records.append(rec)

    # (b) plan under L with --pool auto, capture --plan under L
    plan_b = results_dir / f"plan_{profile}_b.yaml"
    plan = plan_command(spec, budget=limit, pool="auto", out=str(plan_b), calibration=calibration)
    run = capture_cli(profile, limit, steps, warmup, plan=str(plan_b))
    steady = None
    if args.steady:
        steady = run_json([sys.executable, __file__, "--worker", "steady", "--profile", profile,
                           "--file", str(plan_b), "--limit", str(limit), "--steps", str(steps),
                           "--warmup", str(warmup)])
    records.append(record("b: plan --budget L --pool auto", profile, limit, plan, run, steady,
                          info))

    # (c) a tighter budget: halfway between capturing nothing and everything (shared)
    budget_c = int(none + 0.5 * (shared_all - none))
    plan_c_path = results_dir / f"plan_{profile}_c.yaml"
    plan_c = plan_command(spec, budget=budget_c, pool="auto", out=str(plan_c_path),
                          calibration=calibration)
    run = capture_cli(profile, budget_c, steps, warmup, plan=str(plan_c_path))
    steady = None
    if args.steady:
        steady = run_json([sys.executable, __file__, "--worker", "steady", "--profile", profile,
                           "--file", str(plan_c_path), "--limit", str(budget_c),
                           "--steps", str(steps), "--warmup", str(warmup)])
    records.append(record("c: plan under a tighter budget", profile, budget_c, plan_c, run,
                          steady, info))
    return records


def profile_tiny_mode(args) -> list[dict]:
    results_dir = Path(args.out).parent
    results_dir.mkdir(parents=True, exist_ok=True)
    png = results_dir / "profile_tiny.png"
    run = run_json([sys.executable, "-m", "moegraph_cli.app", "profile", "--profile",
                    "tiny-qwen3-moe", "--steps", str(max(args.steps, 5)), "--plot", str(png),
                    "--out", str(results_dir / "profile_tiny_savings.json"),
                    "--calibrate", str(results_dir / "calibration_tiny-qwen3-moe.yaml"),
                    "--json"])
    return [{"case": "profile tiny", "profile": "tiny-qwen3-moe", "plot": str(png),
             "error": run.get("error"), "eager_step_ms": run.get("eager_step_ms"),
             "graph_step_ms": run.get("graph_step_ms"), "kernels_eager": run.get("kernels_eager"),
             "kernels_graph": run.get("kernels_graph"), "scopes": run.get("scopes"),
             "pools": run.get("pools"), "nvml": run.get("nvml"),
             "gpu": run.get("gpu"), "torch": run.get("torch"), "triton": run.get("triton"),
             "date": datetime.date.today().isoformat(), "wall_s": run.get("wall_s")}]


def print_table(records: list[dict]) -> None:
    if records and records[0]["case"] == "profile tiny":
        r = records[0]
        print(f"profile tiny: eager {r['eager_step_ms']} ms, graph {r['graph_step_ms']} ms, "
              f"launches {r['kernels_eager']} -> {r['kernels_graph']}, plot {r['plot']}"
              + (f", error: {r['error']}" if r.get("error") else ""))
        return
    head = f"{'case':34} {'budget':>10} {'pool':>9} {'scopes':>6} {'predicted':>10} " \
           f"{'measured':>10} {'err%':>6} {'steady':>10} {'err%':>6} {'fallback':>8} {'OOM':>4}"
    print(head)
    print("-" * len(head))

    def gib(x):
        return "-" if x is None else f"{x / GIB:.2f}G"

    def pct(x):
        return "-" if x is None else f"{x:+.1f}"

    for r in records:
        print(f"{r['case'][:34]:34} {gib(r['budget']):>10} {str(r['pool']):>9} "
              f"{str(r['scopes_captured']):>6} {gib(r['predicted_peak']):>10} "
              f"{gib(r['measured_peak']):>10} {pct(r['error_pct']):>6} "
              f"{gib(r.get('measured_steady_peak')):>10} {pct(r.get('steady_error_pct')):>6} "
              f"{str(r['fallback']):>8} {'yes' if r['oom'] else 'no':>4}")
        if r.get("failure"):
            print(f"    failure: {str(r['failure'])[:160]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["planner", "profile-tiny"], default="planner")
    ap.add_argument("--profile", default="qwen3-30b-a3b-12layer")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "planner.json"))
    ap.add_argument("--limit", help="memory limit L for cases a and b (default: computed)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--steady", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--worker", choices=["calibrate", "steady"], help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.mode == "profile-tiny" and args.out.endswith("planner.json"):
        args.out = str(Path(args.out).with_name("profile_tiny.json"))
    records = planner_mode(args) if args.mode == "planner" else profile_tiny_mode(args)
    Path(args.out).write_text(json.dumps(records, indent=2, default=str) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    print_table(records)


if __name__ == "__main__":
    main()
