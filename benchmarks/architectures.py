"""Every family on the GPU (issues 10, 11): per profile, `verify --lr0` (attn+moe graphs, the
permute-free experts) in dropless and capacity mode, `verify --reference transformers` on the
tiny ones (`--reference-only` for any list), `capture --scopes attn,moe` eager vs graph with
the planner's prediction, and transformers' own step on the same shapes
(benchmarks/hf_step.py). Each command in a fresh process.

Run: python3 benchmarks/architectures.py --out $OUT/architectures.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture import cli_json  # noqa: E402
from common import write_records  # noqa: E402

PROFILES = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe",
            "tiny-deepseek-v3", "tiny-gpt-oss", "qwen3-30b-a3b-4layer", "mixtral-8x7b-4layer",
            "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "qwen1.5-moe-a2.7b-4layer",
            "qwen2-57b-a14b-4layer", "moonlight-16b-a3b-4layer", "gpt-oss-20b-4layer"]


def hf_step(profile: str) -> dict:
    """transformers' own step on the same shapes (benchmarks/hf_step.py, a fresh process)."""
    p = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "hf_step.py"),
                        "--profile", profile], capture_output=True, text=True, timeout=600)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": (p.stderr.strip() or p.stdout.strip())[-400:]}


def run_profile(profile: str, steps: int) -> dict:
    t0 = time.time()
    rec: dict = {"profile": profile}
    for mode in ("dropless", "capacity"):
        ver, err = cli_json(["verify", "--profile", profile, "--lr0", "--steps", "6",
                             "--set", f"moe.mode={mode}"], timeout=600)
        rec[f"lr0_{mode}"] = err if ver is None else {
            "bitwise_equal": ver["bitwise_equal"], "grad_max_abs": ver["grad_max_abs"],
            "counters": ver["counters"]}
    if profile.startswith("tiny-"):
        ref, err = cli_json(["verify", "--profile", profile, "--lr0", "--steps", "2",
                             "--reference", "transformers"], timeout=600)
        rec["reference_transformers"] = err if ref is None else ref.get("reference")
    cap, err = cli_json(["capture", "--profile", profile, "--scopes", "attn,moe",
                         "--steps", str(steps)], timeout=600)
    if cap is None:
        rec["capture_error"] = err
    else:
        rec.update({k: cap.get(k) for k in ("speedup", "pool_total_bytes", "counters",
                                            "failure", "batch", "seq_len", "gpu", "torch",
                                            "triton", "date")})
        rec.update(eager_ms=cap["eager"]["step_ms"], graph_ms=cap["graph"]["step_ms"],
                   eager_peak_reserved=cap["eager"]["peak_reserved"],
                   graph_peak_reserved=cap["graph"]["peak_reserved"],
                   pools=cap.get("pools"), plan=cap.get("plan"))
    hf = hf_step(profile)
    rec["transformers"] = {k: hf.get(k) for k in ("step_ms", "peak_reserved",
                                                   "experts_implementation", "error")}
    if hf.get("step_ms") and rec.get("graph_ms"):
        rec["graph_vs_transformers"] = hf["step_ms"] / rec["graph_ms"]
    rec["wall_s"] = round(time.time() - t0, 1)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma list of profiles")
    ap.add_argument("--reference-only", default=None,
                    help="comma list: only `verify --reference transformers` (fp32) on these")
    ap.add_argument("--out", default="benchmarks/results/architectures.json")
    args = ap.parse_args()
    records = []
    for profile in (args.reference_only or "").split(","):
        if profile:
            ref, err = cli_json(["verify", "--profile", profile, "--lr0", "--steps", "1",
                                 "--reference", "transformers"], timeout=600)
            records.append({"profile": profile, "reference_transformers":
                            err if ref is None else ref.get("reference")})
            print(json.dumps(records[-1]), flush=True)
            write_records(records, args.out)
    if args.reference_only:
        return
    for profile in PROFILES:
        if args.only is None or profile in args.only.split(","):
            records.append(run_profile(profile, args.steps))
            print(json.dumps(records[-1]), flush=True)
            write_records(records, args.out)


if __name__ == "__main__":
    main()
