"""Activation recompute on one GPU: what it costs, and the operating points it opens.

    python3 benchmarks/recompute.py [--stages overhead,fit80,largest] [--steps 5]
        [--overhead-modes none,full,fc1,attn,attn+fc1] [--out PATH]

Every case is a `moegraph` command in a fresh process (`--json`):
- `overhead`: qwen3-30b-a3b-4layer at 4 x 4096 tokens, `capture --scopes attn,moe` with
  `run.recompute` = each of --overhead-modes: eager and graph step ms, tokens/s, MFU, peak
  reserved. The overhead of a mode is its step time over `none`'s, same run.
- `fit80`: qwen3-30b-a3b-12layer at 4 x 4096 under 80 GiB: `plan --budget 80GiB` with
  run.recompute=none (expected: nothing fits) and auto (recompute chosen), then
  `capture --plan --memory-limit 80GiB`: fallback count, predicted peak against the measured
  peak reserved (eager and graph phases), tokens/s and MFU.
- `largest`: the same model and cap, batches 1..8 of 4096: the largest batch `plan` fits
  with run.recompute=none and with auto, each captured under its plan (tokens/s, MFU).
Writes recompute.json (--out; default $OUT/recompute.json, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cli_json, default_out, environment, write_json  # noqa: E402

FOUR = "qwen3-30b-a3b-4layer"
TWELVE = "qwen3-30b-a3b-12layer"
GIB = 2**30


def _phase(r: dict | None, name: str) -> dict | None:
    if not r or name not in r:
        return None
    p = r[name]
    return {k: p.get(k) for k in ("step_ms", "tokens_per_s", "mfu", "peak_reserved",
                                  "peak_allocated")}


def overhead(modes: list[str], steps: int) -> dict:
    out = {}
    for mode in modes:
        r, err = cli_json(["capture", "-p", FOUR, "--scopes", "attn,moe", "--steps", str(steps),
                           "--warmup", "2", "--set", "run.batch=4", "--set", "run.seq_len=4096",
                           "--set", f"run.recompute={mode}"], timeout=900)
        out[mode] = {"eager": _phase(r, "eager"), "graph": _phase(r, "graph"),
                     "counters": r and r.get("counters"), "error": None if r else err}
    base = out.get("none", {})
    for mode, row in out.items():
        for phase in ("eager", "graph"):
            a, b = (row.get(phase) or {}).get("step_ms"), (base.get(phase) or {}).get("step_ms")
            row[f"{phase}_over_none"] = a / b if a and b else None
    return out


def plan_and_capture(batch: int, recompute: str, steps: int, capture: bool = True) -> dict:
    sets = ["--set", f"run.batch={batch}", "--set", "run.seq_len=4096",
            "--set", f"run.recompute={recompute}"]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "plan.yaml")
        plan, err = cli_json(["plan", "-p", TWELVE, "--budget", "80GiB", "--out", path, *sets])
        row = {"batch": batch, "recompute": recompute, "plan_fits": plan is not None,
               "plan_error": None if plan else err}
        if plan is None:
            return row
        row["plan"] = {k: plan.get(k) for k in ("predicted_peak", "required_budget",
                                                "eager_phase_peak", "graph_phase_peak",
                                                "recompute_why", "recompute_ms", "saved_ms",
                                                "pool")}
        row["layers"] = [{k: layer.get(k) for k in ("layer", "scopes", "recompute")}
                         for layer in plan["layers"]]
        if not capture:
            return row
        r, err = cli_json(["capture", "-p", TWELVE, "--plan", path, "--memory-limit", "80GiB",
                           "--steps", str(steps), "--warmup", "2", *sets], timeout=900)
    row.update({"eager": _phase(r, "eager"), "graph": _phase(r, "graph"),
                "counters": r and r.get("counters"), "failure": r and r.get("failure"),
                "capture_peak_reserved": r and r.get("capture_peak_reserved"),
                "capture_error": None if r else err})
    if r:
        measured = max(r["eager"]["peak_reserved"], r["graph"]["peak_reserved"])
        row["measured_peak_reserved"] = measured
        row["predicted_over_measured"] = plan["predicted_peak"] / measured
    return row


def largest(steps: int) -> dict:
    out = {}
    for recompute in ("none", "auto"):
        fits = [b for b in range(1, 9) if plan_and_capture(b, recompute, steps, False)["plan_fits"]]
        out[recompute] = plan_and_capture(max(fits), recompute, steps) if fits else \
            {"recompute": recompute, "plan_fits": False}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="overhead,fit80,largest")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--overhead-modes", default="none,full,fc1,attn,attn+fc1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out) if args.out else default_out("recompute.json")
    doc = {"benchmark": "recompute", **environment(), "command": " ".join(sys.argv)}
    for stage in args.stages.split(","):
        if stage == "overhead":
            doc["overhead"] = overhead(args.overhead_modes.split(","), args.steps)
        elif stage == "fit80":
            doc["fit80"] = {"none": plan_and_capture(4, "none", args.steps, False),
                            "auto": plan_and_capture(4, "auto", args.steps)}
        elif stage == "largest":
            doc["largest"] = largest(args.steps)
        else:
            ap.error(f"unknown stage {stage!r}")
        write_json(out, doc)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
