"""The uncalibrated planner against the allocator, on every shipped profile that fits one GPU.

    python3 benchmarks/planner_accuracy.py [--steps 3] > accuracy.json

For each profile and pool strategy: `moegraph capture --pool S --json` in a fresh process
(attn+moe on every layer) measures the graph pools (memory_snapshot by pool id) and the eager
and graph phases' peak reserved; the analytical model (no calibration) predicts the same three
figures. Prints one JSON document with both and the relative error of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moegraph_cli.config import load_profile  # noqa: E402
from moegraph_cli.plan.memory import step_model  # noqa: E402

CASES = [("tiny-qwen3-moe", "shared"), ("tiny-qwen3-moe", "per_entry"),
         ("qwen3-30b-a3b-4layer", "shared"), ("qwen3-30b-a3b-4layer", "per_entry"),
         ("qwen3-30b-a3b-12layer", "shared"), ("qwen3-30b-a3b-12layer", "per_entry")]


def _err(pred: int, meas: int | None):
    return None if not meas else pred / meas - 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    records = []
    for profile, pool in CASES:
        cmd = [sys.executable, "-m", "moegraph_cli.app", "capture", "--profile", profile,
               "--pool", pool, "--steps", str(args.steps), "--warmup", "1", "--json"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
        if proc.returncode != 0:
            records.append({"profile": profile, "pool": pool,
                            "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        run = json.loads(proc.stdout)
        model = step_model(load_profile(profile), "cuda")
        every = (True,) * len(model.scopes)
        p = model.predict(every, pool)
        e = model.predict((False,) * len(model.scopes), pool)
        meas = {"pool_bytes": run["pool_total_bytes"],
                "eager_peak_reserved": run["eager"]["peak_reserved"],
                "graph_peak_reserved": run["graph"]["peak_reserved"]}
        pred = {"pool_bytes": p.pool_bytes, "eager_peak_reserved": e.eager_phase_peak,
                "graph_peak_reserved": p.graph_phase_peak}
        records.append({"profile": profile, "pool": pool, "captured_ok": run["captured_ok"],
                        "measured": meas, "predicted": pred,
                        "error": {k: _err(pred[k], meas[k]) for k in meas},
                        "gpu": run.get("gpu"), "torch": run.get("torch"),
                        "triton": run.get("triton"), "date": run.get("date")})
        print(f"{profile} {pool}: " + ", ".join(
            f"{k} {v:+.1%}" for k, v in records[-1]["error"].items() if v is not None),
            file=sys.stderr, flush=True)
    json.dump({"memory_model": "analytical (no calibration)", "records": records},
              sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
