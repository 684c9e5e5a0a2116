"""The planner's uncalibrated memory model against the allocator, for every family: for each
record of results/architectures.json (capture --scopes attn,moe, shared pool, on the H200),
`moegraph plan --profile P --budget 139GiB --json` (all scopes, shared pool: the same
configuration; CPU is enough) predicts the eager-phase peak, the graph-phase peak and the
pool bytes, and this writes them beside the measured ones.

Run: python3 benchmarks/planner_families.py --out benchmarks/results/planner_families.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_records  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", default="benchmarks/results/architectures.json")
    ap.add_argument("--out", default="benchmarks/results/planner_families.json")
    args = ap.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    records = []
    for m in json.loads(Path(args.measured).read_text()):
        if m.get("graph_peak_reserved") is None:
            continue
        p = subprocess.run([sys.executable, "-m", "moegraph_cli.app", "plan", "--profile",
                            m["profile"], "--budget", "139GiB", "--json"],
                           capture_output=True, text=True, timeout=300)
        plan = json.loads(p.stdout)
        rec = {"profile": m["profile"], "predicted_at": head, "measured_run": m.get("run"),
               "gpu": m.get("gpu"), "torch": m.get("torch"), "triton": m.get("triton"),
               "date": m.get("date"),
               "eager_peak": {"predicted": plan["eager_phase_peak"],
                              "measured": m["eager_peak_reserved"]},
               "graph_peak": {"predicted": plan["graph_phase_peak"],
                              "measured": m["graph_peak_reserved"]},
               "pool_bytes": {"predicted": plan["pool_bytes"],
                              "measured": m["pool_total_bytes"]}}
        for v in (rec["eager_peak"], rec["graph_peak"], rec["pool_bytes"]):
            v["error_pct"] = 100 * (v["predicted"] / v["measured"] - 1)
        records.append(rec)
        print(f"{rec['profile']:28} graph peak {rec['graph_peak']['error_pct']:+.1f}%  eager "
              f"{rec['eager_peak']['error_pct']:+.1f}%  pool {rec['pool_bytes']['error_pct']:+.1f}%")
    write_records(records, args.out)


if __name__ == "__main__":
    main()
