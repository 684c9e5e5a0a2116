"""Shared by the benchmark scripts: where results go, what every results file records about the
run, CUDA timing, kernel tables and the CLI in a fresh process.

Every results file is one JSON document: `environment()` (GPU, torch, Triton, git commit,
date, the command line, any kernel switch set in the environment) next to the numbers.
Scripts run from the repository root (`python3 benchmarks/X.py`), with the package installed.
Nothing here imports torch at module level, so a CPU-only script (startup.py) stays light.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_out(name: str) -> Path:
    """$OUT/name when the driver sets OUT, else benchmarks/results/name."""
    return Path(os.environ.get("OUT") or REPO / "benchmarks" / "results") / name


def git_commit() -> str | None:
    """$MOEGRAPH_COMMIT when set (a copied tree whose git metadata may be stale, such as the
    device machine's copy of a working tree); else the short hash of HEAD, with `-dirty` when
    tracked files differ from it; None outside a git checkout."""
    if os.environ.get("MOEGRAPH_COMMIT"):
        return os.environ["MOEGRAPH_COMMIT"]

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        except OSError:  # no git on this machine
            return None
    head = git("rev-parse", "--show-toplevel")
    if head is None or head.returncode != 0 or Path(head.stdout.strip()) != REPO:
        return None
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def version_of(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(device: bool = True) -> dict:
    """What a results file says about its run: the GPU (with `device`: a CPU-only script
    passes False and records gpu None, importing no torch), torch and Triton versions, the
    commit, the date, the command line, and any kernel switch or tile override set in the
    environment (`kernel_env`, as the CLI's own documents record it)."""
    info = {"gpu": None, "torch": version_of("torch"), "triton": version_of("triton"),
            "commit": git_commit(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(["python3", *sys.argv])}
    if device:
        import torch
        info["torch"] = str(torch.__version__)
        from moegraph_cli.train.harness import device_info
        gpu = device_info()
        info.update(gpu=gpu["gpu"], triton=gpu["triton"])
        if "kernel_env" in gpu:
            info["kernel_env"] = gpu["kernel_env"]
    return info


def write_json(path: str | Path, doc: dict) -> None:
    """Write the results document (rewritten as a run goes, so a time limit loses little)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr, flush=True)


def cli_json(args: list[str], timeout: int = 600,
             env: dict | None = None) -> tuple[dict | None, str]:
    """`python -m moegraph_cli.app ARGS --json` in a fresh process (no allocator state shared
    between cases), with `env` added to the environment: (its JSON document or None, the tail
    of its stderr)."""
    cmd = [sys.executable, "-m", "moegraph_cli.app", *args, "--json"]
    print("$ moegraph " + " ".join(args), file=sys.stderr, flush=True)
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    try:
        return json.loads(p.stdout), p.stderr.strip()[-400:]
    except json.JSONDecodeError:
        return None, (p.stderr.strip() or p.stdout.strip())[-400:] or f"exit {p.returncode}"


def error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


# --- CUDA timing ---------------------------------------------------------------------------

def time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median ms of one call: CUDA events around each of `iters` calls, after warm-up."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def throughput_ms(fn, reps: int, rounds: int = 5, warmup: int = 2) -> float:
    """ms per call, the median over `rounds` of `reps` calls back to back between one pair
    of events with no sync inside: host launch work overlaps GPU work, as in training."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        per_round.append(s.elapsed_time(e) / reps)
    return statistics.median(per_round)


def nvml_device():
    """(pynvml, the NVML handle of torch's current GPU), NVML initialised."""
    import pynvml
    import torch
    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())


def sm_clock_reader():
    """A callable giving the GPU's SM clock (MHz) now, from NVML; None where NVML is missing."""
    try:
        pynvml, h = nvml_device()
        pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
    except Exception:  # noqa: BLE001 - no NVML: the timings still count
        return None
    return lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)


def round_orders(names: list, rounds: int, seed: int = 0) -> list[list]:
    """The order of each round of interleaved_ms: round 0 as given, then a seeded shuffle a
    round. Not a rotation: a rotation keeps every fn behind the same neighbour in every round,
    and under a power cap a burst inherits the clock its predecessor left (two identical
    kernels, 37 candidates rotated, measured 2-12% apart, results/NOTES.md)."""
    import random
    rng = random.Random(seed)
    out = [list(names)]
    for _ in range(1, rounds):
        order = list(names)
        rng.shuffle(order)
        out.append(order)
    return out


def interleaved_ms(fns: dict, reps: int, rounds: int = 5, warmup: int = 2,
                   lead=None) -> dict:
    """throughput_ms of each fn, their rounds interleaved (round r runs every fn in turn, in
    round_orders' order), so that a GPU whose clock drifts as it warms under its power cap does
    not favour whichever fn is timed first. `lead`: a fn run `reps` times, untimed, before each
    timed burst, so that every burst starts from the state the same predecessor leaves.
    {name: {"ms": median, "sm_mhz": median SM clock sampled while each round ran (None
    without NVML)}}."""
    import torch
    clock = sm_clock_reader()
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    torch.cuda.synchronize()
    ms = {n: [] for n in names}
    mhz = {n: [] for n in names}
    for order in round_orders(names, rounds):
        for name in order:
            for _ in range(reps if lead is not None else 0):
                lead()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                fns[name]()
            e.record()
            if clock is not None:  # the host is ahead of the GPU here: it is running them
                mhz[name].append(clock())
            torch.cuda.synchronize()
            ms[name].append(s.elapsed_time(e) / reps)
    return {n: {"ms": statistics.median(ms[n]),
                "sm_mhz": statistics.median(mhz[n]) if mhz[n] else None} for n in names}


def time_led_graphs(recs: list[dict], graphs: dict, rounds: int, burst_ms: float) -> None:
    """Time each graph's replay with interleaved_ms (graphs["default"] among them), each timed
    burst about `burst_ms` long and led by as long an untimed burst of the default's; write
    `ms`, `sm_mhz`, `reps` and `ratio_to_default` into the record whose `entry` names it."""
    one = interleaved_ms({"default": graphs["default"].replay}, 1, 1, warmup=2)
    reps = max(3, round(burst_ms / max(one["default"]["ms"], 1e-3)))
    timed = interleaved_ms({n: g.replay for n, g in graphs.items()}, reps, rounds, warmup=1,
                           lead=graphs["default"].replay)
    for rec in recs:
        if rec["entry"] in timed:
            rec.update(timed[rec["entry"]], reps=reps,
                       ratio_to_default=timed[rec["entry"]]["ms"] / timed["default"]["ms"])


def graphed_ab(fns: dict, records: dict, rounds: int, burst_ms: float, *,
               compare=lambda name: True, diff: bool = False) -> list[dict]:
    """A side-by-side run of graphs: fns {name: fn returning its output tensors}, "default"
    first among them; records {name: the record to fill}. Each fn is captured in one CUDA
    graph (capture_graph) and replayed once; where compare(name), its outputs are compared
    with the default's: `equal_default` (bitwise) and, with `diff`, `max_abs_diff`. A fn that
    fails gets `error` (the run goes on without it). Then time_led_graphs times the graphs
    (when the default's was captured). Returns the records in fns' order."""
    import torch
    graphs, outs = {}, {}
    for name, fn in fns.items():
        rec = records[name]
        try:
            def body(fn=fn, name=name):
                outs[name] = fn()
            graphs[name] = capture_graph(body)
            graphs[name].replay()
            torch.cuda.synchronize()
            if compare(name):
                got, want = outs[name], outs.get("default", outs[name])
                rec["equal_default"] = all(torch.equal(a, b) for a, b in zip(got, want))
                if diff:
                    rec["max_abs_diff"] = max(float((a.float() - b.float()).abs().max())
                                              for a, b in zip(got, want))
        except Exception as exc:  # noqa: BLE001 - a failing variant: recorded, the run goes on
            rec["error"] = error_text(exc)
    recs = [records[n] for n in fns]
    if "default" in graphs:
        time_led_graphs(recs, graphs, rounds, burst_ms)
    del graphs, outs
    torch.cuda.empty_cache()
    return recs


def capture_graph(fn):
    """fn captured in one CUDA graph, after three warm-up calls on a side stream."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def kernel_ms(fn, width: int = 90) -> dict[str, float]:
    """GPU ms per kernel name (its first `width` characters) over one call of fn
    (torch.profiler), largest first."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            us = e.device_time if hasattr(e, "device_time") else e.cuda_time
            table[e.name[:width]] = table.get(e.name[:width], 0.0) + us / 1e3
    return dict(sorted(table.items(), key=lambda kv: -kv[1]))


def count_kernels(fn) -> int:
    """CUDA kernels launched by one call of fn (memcpy / memset excluded)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset", "[memory]")))


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description=__doc__ + "\nRun alone: print the environment record "
                            "a results file made here would carry.").parse_args()
    print(json.dumps(environment(device=False), indent=1))
