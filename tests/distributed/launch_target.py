"""A tiny rank program for test_launch.py: gloo collectives that succeed, fail, hang or crash.

The launcher runs it as `python -m launch_target MODE [ARG]` with tests/distributed on PYTHONPATH.
Like the CLI, a rank that fails hands one line to `report_error` and exits with its code;
`crash` instead dies with a raw exception, as a bug outside the CLI's error handling would.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from moegraph_cli.distributed.launch import report_error, worker_env
from moegraph_cli.distributed.watchdog import Watchdog


def run(mode: str, arg: str | None) -> int:
    rank = worker_env().rank
    dist.init_process_group("gloo")
    if mode == "ok":
        total = torch.tensor([float(rank + 1)])  # 1 + 2 = 3 on two ranks
        dist.all_reduce(total)
        print(f"sum={total.item():g}", flush=True)  # every rank prints; only rank 0 may show
        print(f"rank {rank} stderr noise", file=sys.stderr, flush=True)
    elif mode == "fail":
        if rank == 1:
            report_error("bad --ep 3: 8 experts do not split over 3 ranks", 2)
            return 2
        dist.barrier()  # rank 1 never arrives: fails or is stopped by the agent
    elif mode == "hang":
        if rank == 1:
            while True:  # alive, but never joins the collective
                time.sleep(60)
        with Watchdog(3.0, rank) as wd:
            wd.phase("all_reduce")
            dist.all_reduce(torch.ones(1))
    elif mode == "crash":
        if rank == 1:
            raise RuntimeError("boom in rank 1")
        time.sleep(600)  # stopped by the agent once rank 1 is gone
    elif mode == "sleep":
        with open(os.path.join(arg, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        dist.barrier()
        if rank == 0:
            print("ready", flush=True)
        time.sleep(600)
    dist.destroy_process_group()
    return 0


def main() -> int:
    mode = sys.argv[1]
    arg = sys.argv[2] if len(sys.argv) > 2 else None
    try:
        return run(mode, arg)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if mode == "crash":
            raise
        report_error(f"{type(e).__name__}: {e}", 1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
