"""Eager against graphed training steps, per (profile, pool strategy) and per family, through
the CLI a user runs, each command in a fresh process.

    python3 benchmarks/capture.py [--profiles P,...] [--pools shared,per_scope,per_entry]
        [--steps 20] [--modes dropless] [--reference auto|on|off] [--no-verify]
        [--set SECTION.FIELD=VALUE ...] [--out PATH]
    python3 benchmarks/capture.py --families [--out PATH]

Per case:
- `moegraph capture --scopes attn,moe --pool POOL --json`: eager and graph step ms (medians of
  CUDA-event-timed steps after warm-up), throughput change, peak reserved / allocated of each
  phase (the graph phase after capture's leftovers are released; the capture-time peak on its
  own), the graph pools' bytes (memory_snapshot by pool id), captured / replayed / fallback
  counts, MFU;
- `moegraph verify --lr0 --set moe.mode=MODE` for each of `--modes` (dropless, capacity):
  graph against eager at learning rate 0, losses bitwise equal, gradient max-abs;
- with `--reference`, `moegraph verify --reference transformers`: fp32 logits against the
  family's transformers class on the same weights (`auto`: the tiny profiles only).
Default cases: the Qwen3 profiles under each pool strategy (the pool's memory cost: per-entry
pools against one shared pool). `--families`: every family's tiny profile and a model or
slice of it that fits one GPU, shared pool, both MoE modes, the reference on the tiny ones. transformers' own step on the
same shapes is benchmarks/whole_step.py's (`--only` any of these profiles).
The planner's accuracy against these measurements is benchmarks/planner.py's (`--measured`).

Writes capture.json (--out; default $OUT/capture.json, else benchmarks/results/capture.json;
`--families`: families.json).
"""

from __future__ import annotations

import argparse
import time

from common import cli_json, default_out, environment, write_json

CASES = [  # (profile, pool)
    ("tiny-qwen3-moe", "shared"), ("tiny-qwen3-moe", "per_entry"),
    ("qwen3-30b-a3b-4layer", "shared"), ("qwen3-30b-a3b-4layer", "per_entry"),
    ("qwen3-30b-a3b-12layer", "shared"), ("qwen3-30b-a3b-12layer", "per_scope"),
    ("qwen3-30b-a3b-12layer", "per_entry"),
]
FAMILIES = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe",
            "tiny-deepseek-v3", "tiny-gpt-oss", "qwen3-30b-a3b-4layer", "mixtral-8x7b-4layer",
            "olmoe-1b-7b", "qwen1.5-moe-a2.7b-4layer", "qwen2-57b-a14b-4layer",
            "moonlight-16b-a3b-4layer", "gpt-oss-20b-4layer"]


def capture_fields(cap: dict) -> dict:
    e, g = cap["eager"], cap["graph"]
    return {
        "eager_ms": e["step_ms"], "graph_ms": g["step_ms"], "speedup": cap["speedup"],
        "throughput_change_pct": (cap["speedup"] - 1) * 100 if cap["speedup"] else None,
        "eager_peak_reserved": e["peak_reserved"], "graph_peak_reserved": g["peak_reserved"],
        "eager_peak_allocated": e["peak_allocated"], "graph_peak_allocated": g["peak_allocated"],
        "capture_peak_reserved": cap.get("capture_peak_reserved"),
        "reserved_change_pct": (g["peak_reserved"] / e["peak_reserved"] - 1) * 100
        if g.get("peak_reserved") and e.get("peak_reserved") else None,
        "pool_total_bytes": cap["pool_total_bytes"], "pools": cap["pools"],
        "counters": cap["counters"], "captured_ok": cap["captured_ok"],
        "failure": cap["failure"], "mfu_eager": e.get("mfu"), "mfu_graph": g.get("mfu"),
        "batch": cap["batch"], "seq_len": cap["seq_len"],
        "dropped_routes": cap.get("dropped_routes"),
    }


def run_case(profile: str, pool: str, args, reference: bool) -> dict:
    t0 = time.time()
    extra = [x for s in args.set for x in ("--set", s)]
    rec: dict = {"profile": profile, "scopes": "attn,moe", "pool": pool}
    cap, err = cli_json(["capture", "--profile", profile, "--scopes", "attn,moe", "--pool", pool,
                         "--steps", str(args.steps), *extra])
    if cap is None:
        rec["error"] = err
    else:
        rec.update(capture_fields(cap))
    if not args.no_verify:
        for mode in args.modes.split(","):
            ver, err = cli_json(["verify", "--profile", profile, "--scopes", "attn,moe",
                                 "--pool", pool, "--lr0", "--steps", "6",
                                 "--set", f"moe.mode={mode}", *extra])
            rec[f"lr0_{mode}"] = {"error": err} if ver is None else {
                "bitwise_equal": ver["bitwise_equal"], "grad_max_abs": ver["grad_max_abs"],
                "counters": ver["counters"]}
    if reference:
        ref, err = cli_json(["verify", "--profile", profile, "--lr0", "--steps", "2",
                             "--reference", "transformers", *extra])
        rec["reference_transformers"] = {"error": err} if ref is None else ref.get("reference")
    rec["wall_s"] = round(time.time() - t0, 1)
    return rec


def print_table(records) -> None:
    print(f"\n{'profile':26} {'pool':10} {'eager ms':>9} {'graph ms':>9} {'thru':>8} "
          f"{'eager GiB':>9} {'graph GiB':>9} {'res%':>7} {'fb':>3}  lr0 bitwise")
    for r in records:
        if "error" in r:
            print(f"{r['profile']:26} {r['pool']:10} ERROR {r['error'][-200:]}")
            continue
        lr0 = " ".join(f"{k[4:]}={v.get('bitwise_equal')}" for k, v in r.items()
                       if k.startswith("lr0_"))
        tc, rc = r["throughput_change_pct"], r["reserved_change_pct"]
        print(f"{r['profile']:26} {r['pool']:10} {r['eager_ms']:9.2f} {r['graph_ms']:9.2f} "
              f"{'-' if tc is None else format(tc, '+7.1f') + '%':>8} "
              f"{r['eager_peak_reserved'] / 2**30:9.2f} {r['graph_peak_reserved'] / 2**30:9.2f} "
              f"{'-' if rc is None else format(rc, '+6.1f') + '%':>7} "
              f"{r['counters']['fallback']:3d}  {lr0}"
              + (f"  FAIL {r['failure'][:80]}" if r.get("failure") else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", action="store_true",
                    help="every family's profiles (shared pool, both modes, the reference)")
    ap.add_argument("--profiles", default=None, help="comma list: only these profiles")
    ap.add_argument("--pools", default=None, help="comma list: only these pool strategies")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default=None,
                    help="MoE modes verified at lr 0 (default dropless; --families: both)")
    ap.add_argument("--reference", choices=["auto", "on", "off"], default=None,
                    help="fp32 logits against transformers (default off; --families: auto)")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.modes = args.modes or ("dropless,capacity" if args.families else "dropless")
    args.reference = args.reference or ("auto" if args.families else "off")
    args.out = args.out or str(default_out("families.json" if args.families else "capture.json"))
    cases = [(p, "shared") for p in FAMILIES] if args.families else CASES
    if args.profiles:  # a profile without a listed case runs with the shared pool
        names = args.profiles.split(",")
        cases = [c for c in cases if c[0] in names] + [
            (p, "shared") for p in names if p not in {c[0] for c in cases}]
    if args.pools:
        cases = [c for c in cases if c[1] in args.pools.split(",")]
    doc = {"benchmark": "families" if args.families else "capture", **environment(),
           "records": []}
    for profile, pool in cases:
        reference = args.reference == "on" or (args.reference == "auto"
                                               and profile.startswith("tiny-"))
        doc["records"].append(run_case(profile, pool, args, reference))
        write_json(args.out, doc)
    print_table(doc["records"])


if __name__ == "__main__":
    main()
