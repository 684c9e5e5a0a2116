"""Run a function in N CPU processes joined by a gloo process group (torch.multiprocessing
spawn), for tests of the distributed code without GPUs. A failure in any process fails the
test with that process's traceback."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world: int, *args) -> None:
    """fn(rank, world, *args) in `world` processes; fn and args must be picklable (a
    module-level function)."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
