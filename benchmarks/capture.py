"""Eager vs graph training steps per (profile, scopes, pool), each case in a fresh process so
allocator peaks do not leak between cases; plus `verify --lr0` for the same case.

Run: python3 benchmarks/capture.py --out $OUT/capture.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_records  # noqa: E402

CASES = [
    ("tiny-qwen3-moe", "attn,moe", "shared"),
    ("tiny-qwen3-moe", "attn,moe", "per_entry"),
    ("qwen3-30b-a3b-4layer", "attn,moe", "shared"),
    ("qwen3-30b-a3b-4layer", "attn,moe", "per_entry"),
    ("qwen3-30b-a3b-12layer", "attn,moe", "shared"),
    ("qwen3-30b-a3b-12layer", "attn,moe", "per_scope"),
    ("qwen3-30b-a3b-12layer", "attn,moe", "per_entry"),
]


def cli_json(args: list[str], timeout: int) -> tuple[dict | None, str]:
    cmd = [sys.executable, "-m", "moegraph_cli.app", *args, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    try:
        return json.loads(p.stdout), p.stderr.strip()[-400:]
    except json.JSONDecodeError:
        return None, (p.stderr.strip() or p.stdout.strip())[-400:]


def run_case(profile: str, scopes: str, pool: str, steps: int, verify: bool,
             extra: list[str]) -> dict:
    t0 = time.time()
    cap, err = cli_json(["capture", "--profile", profile, "--scopes", scopes, "--pool", pool,
                         "--steps", str(steps), *extra], timeout=600)
    rec = {"profile": profile, "scopes": scopes, "pool": pool}
    if cap is None:
        rec["error"] = err
        return rec
    rec.update({
        "eager_ms": cap["eager"]["step_ms"], "graph_ms": cap["graph"]["step_ms"],
        "speedup": cap["speedup"],
        "throughput_change_pct": (cap["speedup"] - 1) * 100 if cap["speedup"] else None,
        "eager_peak_reserved": cap["eager"]["peak_reserved"],
        "graph_peak_reserved": cap["graph"]["peak_reserved"],
        "eager_peak_allocated": cap["eager"]["peak_allocated"],
        "capture_peak_reserved": cap.get("capture_peak_reserved"),
        "graph_peak_allocated": cap["graph"]["peak_allocated"],
        "reserved_change_pct": (cap["graph"]["peak_reserved"] / cap["eager"]["peak_reserved"]
                                - 1) * 100,
        "pool_bytes": cap["pool_total_bytes"], "pools": len(cap["pools"]),
        "captured": cap["counters"]["captured"], "replayed": cap["counters"]["replayed"],
        "fallback": cap["counters"]["fallback"], "failure": cap["failure"],
        "mfu_eager": cap["eager"]["mfu"], "mfu_graph": cap["graph"]["mfu"],
        "batch": cap["batch"], "seq_len": cap["seq_len"],
        "gpu": cap["gpu"], "torch": cap["torch"], "triton": cap["triton"], "date": cap["date"],
    })
    if verify:
        ver, err = cli_json(["verify", "--profile", profile, "--scopes", scopes, "--pool", pool,
                             "--lr0", "--steps", "6", *extra], timeout=600)
        rec["lr0_bitwise"] = None if ver is None else ver["bitwise_equal"]
        rec["lr0_grad_max_abs"] = None if ver is None else ver["grad_max_abs"]
        if ver is None:
            rec["verify_error"] = err
    rec["wall_s"] = round(time.time() - t0, 1)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma list of profiles")
    ap.add_argument("--pools", default=None, help="comma list of pool strategies")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", default="benchmarks/results/capture.json")
    args = ap.parse_args()
    extra = [x for s in args.set for x in ("--set", s)]
    cases = [c for c in CASES if (args.only is None or c[0] in args.only.split(","))
             and (args.pools is None or c[2] in args.pools.split(","))]
    records = []
    for c in cases:
        records.append(run_case(*c, args.steps, not args.no_verify, extra))
        print(json.dumps(records[-1]), flush=True)
        write_records(records, args.out)
    print(f"\n{'profile':24} {'pool':10} {'eager ms':>9} {'graph ms':>9} {'thru':>7} "
          f"{'eagerRes':>9} {'graphRes':>9} {'res%':>6} {'fb':>3} {'lr0':>5}")
    for r in records:
        if "error" in r:
            print(f"{r['profile']:24} {r['pool']:10} ERROR {r['error'][-200:]}")
            continue
        tc = r["throughput_change_pct"]
        print(f"{r['profile']:24} {r['pool']:10} {r['eager_ms']:9.2f} {r['graph_ms']:9.2f} "
              f"{tc:+6.1f}% {r['eager_peak_reserved'] / 2**30:9.2f} "
              f"{r['graph_peak_reserved'] / 2**30:9.2f} {r['reserved_change_pct']:+5.1f}% "
              f"{r['fallback']:3d} {str(r.get('lr0_bitwise')):>5}"
              + (f" FAIL {r['failure'][:80]}" if r.get("failure") else ""))


if __name__ == "__main__":
    main()
