"""Hardware counters of each expert kernel, read by Nsight Compute (ncu): where a kernel's
time goes (tensor pipe busy, warp stall reasons, L2 and DRAM throughput, occupancy), which
throughput timings alone cannot say.

    python3 benchmarks/ncu_kernels.py run [--tokens 8192] [--routing uniform]
        [--kernels fc1,fc2,dact,dx,wgrad_down,wgrad_gate_up,dense_mm] [--source] [--out PATH]
    python3 benchmarks/ncu_kernels.py launch ...     (what `run` profiles, under ncu)
    python3 benchmarks/ncu_kernels.py summarize RAW.csv [--out PATH]

`run` starts ncu on this script's `launch` (clocks left alone: `--clock-control none`; only
the launches inside the NVTX range `ncu`), exports the report and reads its raw page back
(`ncu --import REP --csv --page raw`), then `summarize`s it. `launch` builds benchmarks/
kernel_sweep.py's case per (T, routing) (Qwen3 expert shape; the product's tiles), runs each
kernel once to compile and warm it, then once more inside the range, in --kernels order;
`dense_mm` is torch.mm of [T k, H] x [H, 2F] (cuBLAS: the same FLOPs as FC1 or dX).
`summarize` keys each profiled launch by that order (the `order` line `launch` prints) and
keeps, per kernel, the headline counters (HEADLINE; `run` asks ncu for base units: ns, Hz,
bytes) and every warp-stall ratio, plus all raw metrics under `raw`.
`--source` adds ncu's per-instruction warp-stall sampling (section SourceCounters, read back
as the SASS source page of each launch): per kernel, the share of samples by how often an
instruction ran (the K loop's instructions run once a K step, a tile's prologue and epilogue
once a tile: `by_executions`), and the instructions with the most samples, with their
leading stall reasons (`top`). Samples are taken at a fixed interval per warp, so a share of
samples is a share of the warps' time.

Writes ncu_kernels.json (--out; default $OUT/ncu_kernels.json, else benchmarks/results/).
Needs ncu on the PATH and a GPU whose counters it can read (see the device notes).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys

from common import default_out, environment, write_json

KERNELS = ("fc1", "fc2", "dact", "dx", "wgrad_down", "wgrad_gate_up", "dense_mm")
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis",
            "WarpStateStats", "SchedulerStats", "Occupancy", "LaunchStats")
# name in the summary -> ncu raw metric
HEADLINE = {
    "duration_us": "gpu__time_duration.sum",
    "sm_mhz": "gpc__cycles_elapsed.avg.per_second",
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor_pipe_pct": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "issued_per_cycle": "sm__inst_issued.avg.per_cycle_active",
    "l2_throughput_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "dram_throughput_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_bytes_per_s": "dram__bytes.sum.per_second",
    "warps_active_per_cycle": "sm__warps_active.avg.per_cycle_active",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
SAMPLES = "Warp Stall Sampling (All Samples)"
STALL_SUFFIX = "_per_issue_active.ratio"


def launch(args) -> None:
    import torch
    import kernel_sweep as ks
    import moegraph_kernels.gemm_launch as gl
    gl.FALLBACK_ON_ERROR = False
    order = []
    for T in map(int, args.tokens.split(",")):
        for routing in args.routing.split(","):
            t, defaults = ks.setup(T, routing, args.skew)
            runs = []
            for kernel in args.kernels.split(","):
                if kernel == "dense_mm":
                    runs.append((kernel, ks.dense_mm(T, t["x"].dtype)))
                else:
                    fn, _outs = ks.runner(kernel, "default", getattr(defaults, kernel),
                                          True, t)
                    runs.append((kernel, fn))
            for _, fn in runs:  # compile and warm, outside the range
                fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("ncu")
            for kernel, fn in runs:
                fn()
                order.append({"T": T, "routing": routing, "kernel": kernel})
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
    print("order " + json.dumps(order), flush=True)


def _number(text: str) -> float | None:
    """An ncu CSV cell as a number (thousands separators dropped), or None for text."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def rows_of(raw_csv: str) -> list[dict]:
    """ncu's raw page as one dict per profiled launch: the header row names the metrics, the
    row after it their units; values keep ncu's thousands separators out."""
    rows = list(csv.reader(io.StringIO(raw_csv)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    head, body = rows[start], rows[start + 2:]
    out = []
    for r in body:
        if len(r) != len(head):
            continue
        out.append({k: v if (n := _number(v)) is None else n for k, v in zip(head, r)})
    return out


def summarize(raw_csv: str, order: list[dict]) -> list[dict]:
    """One record per profiled launch, in `order`: the headline counters, the warp-stall
    ratios (cycles a warp waits per issued instruction, by reason; largest first) and the
    raw metrics."""
    rows = rows_of(raw_csv)
    if len(rows) != len(order):
        raise ValueError(f"ncu profiled {len(rows)} launches, the launch order names "
                         f"{len(order)}: another kernel ran inside the range")
    out = []
    for want, row in zip(order, rows):
        rec = {**want, "kernel_name": row.get("Kernel Name")}
        for name, metric in HEADLINE.items():
            if isinstance(row.get(metric), float):
                rec[name] = row[metric]
        if "sm_mhz" in rec:
            rec["sm_mhz"] = rec["sm_mhz"] / 1e6
        if "duration_us" in rec:
            rec["duration_us"] = rec["duration_us"] / 1e3
            if "dram_bytes_per_s" in rec:
                rec["dram_gbytes"] = rec.pop("dram_bytes_per_s") * rec["duration_us"] / 1e15
        stalls = {k[len(STALL_PREFIX):-len(STALL_SUFFIX)]: v for k, v in row.items()
                  if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX)
                  and "not_issued" not in k and isinstance(v, float)}
        rec["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
        rec["raw"] = {k: v for k, v in row.items() if isinstance(v, float)}
        out.append(rec)
    return out


def source_summary(page_csv: str, top: int = 12) -> dict:
    """ncu's SASS source page of one launch (`--page source --csv --print-source sass`) as
    the share of warp-stall samples by execution count and the `top` instructions."""
    rows = list(csv.reader(io.StringIO(page_csv)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head = rows[start]
    data = [dict(zip(head, r)) for r in rows[start + 1:] if len(r) == len(head)]
    num = lambda v: _number(v) or 0.0  # noqa: E731 - "" and "-" count as no samples
    total = sum(num(d[SAMPLES]) for d in data) or 1.0
    groups: dict[float, list] = {}
    for d in data:
        g = groups.setdefault(num(d["Instructions Executed"]), [0, 0.0])
        g[0] += 1
        g[1] += num(d[SAMPLES])
    reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    out = {"samples": total,
           "by_executions": [{"executed": ex, "instructions": n, "share": s / total}
                             for ex, (n, s) in sorted(groups.items(), key=lambda kv: -kv[1][1])
                             if s > 0],
           "top": []}
    for d in sorted(data, key=lambda d: -num(d[SAMPLES]))[:top]:
        why = sorted(((r[len("stall_"):], num(d[r])) for r in reasons if num(d[r]) > 0),
                     key=lambda kv: -kv[1])[:3]
        out["top"].append({"sass": d["Source"].strip(), "share": num(d[SAMPLES]) / total,
                           "executed": num(d["Instructions Executed"]),
                           "reasons": {k: v / total for k, v in why}})
    return out


def run(args) -> None:
    out = args.out or str(default_out("ncu_kernels.json"))
    rep = os.path.splitext(out)[0] + ".ncu-rep"
    me = os.path.abspath(__file__)
    cmd = ["ncu", "--clock-control", "none", "--nvtx", "--nvtx-include", "ncu/",
           "--replay-mode", "kernel", "-f", "--export", rep]
    for s in SECTIONS + (("SourceCounters",) if args.source else ()):
        cmd += ["--section", s]
    cmd += [sys.executable, me, "launch", "--tokens", args.tokens, "--routing", args.routing,
            "--kernels", args.kernels, "--skew", str(args.skew)]
    prof = subprocess.run(cmd, capture_output=True, text=True)
    order_lines = [ln for ln in prof.stdout.splitlines() if ln.startswith("order ")]
    doc = {"benchmark": "ncu_kernels", **environment(), "ncu_command": " ".join(cmd),
           "records": []}
    if prof.returncode != 0 or not order_lines:
        doc["error"] = (prof.stderr or prof.stdout)[-3000:]
        write_json(out, doc)
        sys.exit(f"ncu_kernels: ncu failed (rc {prof.returncode}); see {out}")
    raw = subprocess.run(["ncu", "--import", rep, "--csv", "--page", "raw",
                          "--print-units", "base"],
                         capture_output=True, text=True, check=True).stdout
    doc["records"] = summarize(raw, json.loads(order_lines[-1][len("order "):]))
    for i, rec in enumerate(doc["records"] if args.source else []):
        page = subprocess.run(["ncu", "--import", rep, "--page", "source", "--csv",
                               "--print-source", "sass", "--launch-skip", str(i),
                               "--launch-count", "1"], capture_output=True, text=True)
        try:
            rec["source"] = source_summary(page.stdout)
        except (StopIteration, KeyError, ValueError) as exc:
            rec["source"] = {"error": f"{type(exc).__name__}: {exc}; {page.stderr[-300:]}"}
    write_json(out, doc)
    for r in doc["records"]:
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["stalls"].items())[:4])
        print(f"T={r['T']} {r['routing']:8s} {r['kernel']:14s} "
              f"{r.get('duration_us', 0):8.1f} us @{r.get('sm_mhz', 0):.0f} MHz "
              f"tensor {r.get('tensor_pipe_pct', float('nan')):5.1f}% "
              f"L2 {r.get('l2_throughput_pct', float('nan')):5.1f}% "
              f"DRAM {r.get('dram_throughput_pct', float('nan')):5.1f}% | {top}")
        if "by_executions" in r.get("source", {}):
            print("    samples by executions: " + ", ".join(
                f"x{g['executed']:.0f} ({g['instructions']} instr) {100 * g['share']:.1f}%"
                for g in r["source"]["by_executions"][:3]))
    print(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "launch"):
        p = sub.add_parser(name)
        p.add_argument("--tokens", default="8192")
        p.add_argument("--routing", default="uniform")
        p.add_argument("--skew", type=float, default=0.25)
        p.add_argument("--kernels", default=",".join(KERNELS))
        p.add_argument("--out", default=None)
        if name == "run":
            p.add_argument("--source", action="store_true",
                           help="add per-instruction warp-stall sampling (SourceCounters)")
    p = sub.add_parser("summarize")
    p.add_argument("raw_csv")
    p.add_argument("--order", required=True, help="the JSON list `launch` printed")
    p.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cmd in ("run", "launch"):
        bad = set(args.kernels.split(",")) - set(KERNELS)
        if bad:
            ap.error(f"--kernels: unknown {', '.join(sorted(bad))}; "
                     f"known: {', '.join(KERNELS)}")
    if args.cmd == "launch":
        launch(args)
    elif args.cmd == "run":
        run(args)
    else:
        with open(args.raw_csv) as fh:
            recs = summarize(fh.read(), json.loads(args.order))
        out = args.out or str(default_out("ncu_kernels.json"))
        write_json(out, {"benchmark": "ncu_kernels", **environment(device=False),
                         "records": recs})
        print(out)


if __name__ == "__main__":
    main()
