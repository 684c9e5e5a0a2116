"""What a command does differently when it is one rank of a distributed run.

`command_runtime(spec, ep)` is a context: None in a single process (and `--ep` > 1 there is a
usage error), else the rank's Runtime with a step watchdog running, torn down on exit. Rank 0
alone renders; `merge_ranks` builds the one document `--json` prints, with each rank's
figures under `ranks`.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import UsageError
from .launch import collective_timeout_s, worker_env


def device_kind(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


@contextlib.contextmanager
def command_runtime(spec, ep: int = 1):
    env = worker_env()
    if env is None:
        if ep != 1:
            raise UsageError(f"--ep {ep} needs several processes: add --nproc N (or start "
                             "the command with torchrun)")
        yield None
        return
    from .runtime import setup, teardown
    from .watchdog import Watchdog

    timeout = collective_timeout_s()
    # The process group's own timeout a little later than the watchdog's: a stuck collective
    # then ends with the watchdog's line, which names the phase, not with a bare timeout.
    rt = setup(ep, spec.profile.model.num_experts, device_kind(spec.profile.run.device),
               timeout * 1.1 + 2)
    try:
        with Watchdog(timeout, rt.rank) as wd:
            wd.phase("set-up (the model, its shards, the optimizer)")
            rt.watchdog = wd
            yield rt
    finally:
        teardown()


def place(rt) -> tuple[int, int, int]:
    """(rank, world size, ep degree) of this process; (0, 1, 1) when not distributed."""
    return (0, 1, 1) if rt is None else (rt.rank, rt.world, rt.ep_size)


def ticker(bar, rt):
    """A per-step callback: advance the progress bar, and beat the rank's watchdog with the
    phase the bar shows ("graph steps (7 of 27 done)"), so a stuck rank says where it was."""
    def tick(description=None):
        bar.advance(description)
        if rt is not None:
            rt.beat(f"{bar.description} ({bar.done} of {bar.total} done)")
    return tick


PER_RANK = ("eager", "graph", "counters", "failure", "captured_ok", "pool_total_bytes",
            "dropped_routes", "bitwise_equal", "grad_max_abs", "eager_losses", "graph_losses",
            "passed", "device_name", "capture_peak_reserved")


def merge_ranks(docs: list[dict], rt) -> dict:
    """Rank 0's document plus every rank's own figures (`ranks`) and the job's shape."""
    out = dict(docs[0])
    out["world_size"] = rt.world
    out["ep"] = rt.ep_size
    out["ranks"] = [{"rank": r, **{k: d[k] for k in PER_RANK if k in d}}
                    for r, d in enumerate(docs)]
    return out
