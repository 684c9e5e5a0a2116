"""Run a function in N CPU processes joined by a gloo process group, for tests of the
distributed code without GPUs. A failure in any process fails the test with that process's
traceback.

The processes are forked from a forkserver that imported torch and moegraph once for the
whole test run (a spawned process would import them again, several seconds each on a small
machine). Every call still gets fresh processes and a fresh process group: nothing one test
does in its ranks is seen by the next. The forkserver never runs torch itself, so a forked
rank starts with no thread pools."""

from __future__ import annotations

import multiprocessing
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from machine_util import usable_cores

# What the ranks import; the forkserver imports them once, before it forks any rank.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.device_mesh", "moegraph_cli.distributed.runtime",
           "moegraph_cli.distributed.model", "moegraph_cli.train.harness",
           "moegraph_cli.train.runspec", "moegraph_cli.train.trainer", "moegraph_cli.moe.ep",
           "moegraph_cli.moe.experts", "moegraph_cli.moe.reference", "moegraph_cli.models",
           "moegraph_cli.app", "moegraph_cli.commands.verify", "cli_util", "gloo_util"]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, env: dict, fn, args) -> None:
    # The caller's environment as it is now, not the forkserver's from when it started.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # The ranks share the machine's cores: one thread each beyond that many ranks, as
    # torchrun sets OMP_NUM_THREADS=1 (more threads only contend).
    torch.set_num_threads(max(1, usable_cores() // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():  # a command's runtime tears the group down itself
            dist.destroy_process_group()


def run_gloo(fn, world: int, *args) -> None:
    """fn(rank, world, *args) in `world` processes; fn and args must be picklable (a
    module-level function). free_port's port is free when asked, not when rank 0 binds it:
    another process (the other pytest worker's groups) may take it in between. Rank 0 then
    fails to listen (EADDRINUSE) before fn runs anywhere, and the call is made again on a
    new port, up to ATTEMPTS times."""
    for attempt in range(ATTEMPTS):
        try:
            mp.start_processes(_entry, args=(world, free_port(), dict(os.environ), fn, args),
                               nprocs=world, join=True, start_method="forkserver")
            return
        except mp.ProcessRaisedException as exc:
            if not _port_taken(exc) or attempt == ATTEMPTS - 1:
                raise


ATTEMPTS = 3


def _port_taken(exc: Exception) -> bool:
    """Whether a rank failed because its process group's port was taken (the store's
    listen in init_process_group), not in fn."""
    text = str(exc)
    return "EADDRINUSE" in text and "init_process_group" in text
