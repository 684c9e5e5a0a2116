"""Start-up time of a command that needs no GPU: `moegraph inspect --profile tiny-qwen3-moe
--json`, run N times in fresh processes (`python -m moegraph_cli.app ...`), median wall time.

    python3 benchmarks/startup.py [--runs 10] [--root DIR] [--label TEXT] [--out PATH]

A CPU measurement: nothing here touches a GPU (and the record says so). Each run is a new
interpreter, so the figure is what a user waits for (interpreter start, imports, the command,
exit); the file system cache is warm after the first run, which is excluded as a warm-up.
`python -c pass` is timed the same way as the floor; `heavy_modules_imported` lists which of
torch, numpy, triton and safetensors the command imported. `--root DIR` times another source
tree of moegraph (e.g. an exported older commit) instead of the installed one.

Prints the JSON and writes it to startup.json (--out; default $OUT/startup.json, else
benchmarks/results/startup.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import default_out, environment, version_of, write_json

COMMAND = ["inspect", "--profile", "tiny-qwen3-moe", "--json"]
PROBE = ("import sys, runpy; sys.argv = ['moegraph'] + sys.argv[1:]\n"
         "try:\n    runpy.run_module('moegraph_cli.app', run_name='__main__')\n"
         "except SystemExit:\n    pass\n"
         "print(sorted(m for m in ('torch', 'numpy', 'triton', 'safetensors.torch') "
         "if m in sys.modules), file=sys.stderr)")


def _env(root: Path | None) -> dict:
    env = dict(os.environ)
    if root is not None:  # the tree's own package first on sys.path, before any install
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
    return env


def time_runs(argv: list[str], runs: int, env: dict, cwd: Path) -> list[float]:
    times = []
    for i in range(runs + 1):
        start = time.perf_counter()
        done = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        elapsed = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"startup: {' '.join(argv)} exited {done.returncode}: "
                     f"{done.stderr.strip()[-500:]}")
        if i:  # the first run warms the file system cache
            times.append(elapsed)
    return times


def _summary(times: list[float]) -> dict:
    return {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
            "max_s": round(max(times), 4), "runs_s": [round(t, 4) for t in times]}


def measure(runs: int, root: Path | None) -> dict:
    env, cwd = _env(root), (root or Path.cwd())
    cmd = [sys.executable, "-m", "moegraph_cli.app", *COMMAND]
    where = subprocess.run([sys.executable, "-c", "import moegraph_cli; print(moegraph_cli"
                            ".__file__)"], env=env, cwd=cwd, capture_output=True, text=True)
    imported = subprocess.run([sys.executable, "-c", PROBE, *COMMAND], env=env, cwd=cwd,
                              capture_output=True, text=True).stderr.strip().splitlines()
    return {
        "measured_command": "python -m moegraph_cli.app " + " ".join(COMMAND),
        "package": where.stdout.strip(),
        "heavy_modules_imported": imported[-1] if imported else None,
        "runs": runs,
        **_summary(time_runs(cmd, runs, env, cwd)),
        "python_floor": _summary(time_runs([sys.executable, "-c", "pass"], runs, env, cwd)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--root", type=Path, help="time this source tree of moegraph instead")
    ap.add_argument("--label", default=None, help="a name for this measurement")
    ap.add_argument("--out", type=Path, default=default_out("startup.json"))
    args = ap.parse_args()
    env = environment(device=False)
    record = {
        "benchmark": "startup",
        "label": args.label,
        "device": "CPU only: a start-up measurement, no GPU involved",
        **env,
        "python": platform.python_version(),
        "typer": version_of("typer"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        **measure(args.runs, args.root.resolve() if args.root else None),
    }
    print(json.dumps(record, indent=2))
    write_json(args.out, record)


if __name__ == "__main__":
    main()
