"""`moegraph plan`'s wall time on the published multi-GPU points and a few single-process cases,
in one or more checkouts side by side (each case run in every checkout before the next case),
and whether their outputs are the same byte for byte. No GPU.

    python3 benchmarks/plan_speed.py --tree 440e37e=/tmp/old --tree HEAD=. [--out PATH]

Each `--tree NAME=DIR` is a checkout whose `moegraph_cli` runs from DIR
(`python3 -m moegraph_cli.app plan ARGS --json` with DIR as the working directory).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_json  # noqa: E402

CASES = [
    "-p qwen3-30b-a3b --budget 80GiB --nproc 8 --ep 8 --set run.batch=4 --set run.seq_len=4096",
    "-p qwen3-30b-a3b --budget 80GiB --nproc 8 --ep 8 --set run.batch=4 --set run.seq_len=4096 "
    "--set run.loss_chunk=0",
    "-p deepseek-v3 --budget 80GiB --nproc 256 --ep 64",
    "-p deepseek-v3 --budget 80GiB --nproc 1024 --ep 64",
    "-p gpt-oss-120b --budget 80GiB --nproc 32 --ep 8",
    "-p qwen3-30b-a3b-4layer --budget 80GiB --set run.batch=4 --set run.seq_len=4096",
    "-p qwen3-30b-a3b-12layer --budget 80GiB --set run.batch=4 --set run.seq_len=4096",
    "-p qwen3-30b-a3b-12layer --budget 60GiB --set run.batch=4 --set run.seq_len=4096 "
    "--pool per_entry",  # below the static memory: exit 1
    "-p qwen3-30b-a3b-4layer --budget 40GiB --nproc 2 --ep 2 --set run.batch=4 "
    "--set run.seq_len=4096",
    "-p mixtral-8x7b --budget 80GiB --nproc 16 --ep 8",
    "-p moonlight-16b-a3b --budget 80GiB --nproc 8 --ep 4 --pool per_scope",
    "-p tiny-qwen3-moe --budget 8GiB",
    "-p tiny-deepseek-v3 --budget 1GiB --nproc 4 --ep 2",
    "-p qwen2-57b-a14b --budget 80GiB --nproc 16 --ep 4 --set run.recompute=fc1",
    "-p olmoe-1b-7b --budget 20GiB --set run.batch=8 --set run.seq_len=4096",  # exit 1
]


def _tree(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not (Path(path) / "moegraph_cli").is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: want NAME=DIR, DIR a checkout")
    return name, Path(path).resolve()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=_tree, action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--out", default="benchmarks/results/plan_speed_cpu.json")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    records = []
    for case in CASES:
        rec, outs = {"args": case}, []
        for name, tree in args.tree:
            start = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "moegraph_cli.app", "plan", *case.split(),
                                "--json"], cwd=tree, env=env, capture_output=True, text=True)
            rec[name] = {"seconds": round(time.perf_counter() - start, 3),
                         "returncode": r.returncode}
            outs.append((r.stdout, r.stderr))
        rec["same_output"] = all(o == outs[0] for o in outs)
        records.append(rec)
        print(case, {n: rec[n]["seconds"] for n, _ in args.tree}, rec["same_output"],
              flush=True)
    write_json(args.out, {"benchmark": "moegraph plan wall time", **environment(device=False),
                          "command": " ".join(sys.argv),
                          "trees": [name for name, _ in args.tree], "cpu_count": os.cpu_count(),
                          "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
