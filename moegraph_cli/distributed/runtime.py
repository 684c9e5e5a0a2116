"""One process of a distributed run: its process groups, device meshes and the cross-rank
agreements the graph engine and the commands need.

Groups (all from torch.distributed, set up once per process):
- the world group (NCCL on GPUs, gloo on CPUs) with a timeout, so an eager collective that
  never completes ends the run with an error instead of a hang;
- a 2-D DeviceMesh (dp, ep) of shape (world / ep, ep): experts are split over `ep` (each EP
  rank owns num_experts / ep experts) and FSDP2-sharded over `dp` (`dp_mesh`: the world / ep
  ranks that hold the same experts; dist/model.py);
- a 1-D DeviceMesh over the whole world for FSDP2: every rank trains on its own data, so dense
  parameters are sharded over all of them;
- a gloo group on the CPU for decisions (graph vs eager, rollback): agreeing on a flag there
  never waits for the GPU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UsageError
from ..moe.ep import EpGroup
from .layout import check_parallelism  # noqa: F401 - torch-free, so `plan` can check too


@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    ep: EpGroup | None  # None when ep == 1: every rank holds every expert
    ep_size: int
    dp_group: object  # the expert replicas of this rank (size world / ep)
    dp_size: int
    fsdp_mesh: object
    control: object  # gloo group for decisions
    watchdog: object = None  # dist/watchdog.Watchdog while a command runs
    dp_mesh: object = None  # 1-D DeviceMesh over dp_group: the experts' FSDP2 mesh

    def beat(self, phase: str | None = None) -> None:
        """A heartbeat for the step watchdog (a captured collective has no timeout)."""
        if self.watchdog is not None:
            self.watchdog.phase(phase) if phase else self.watchdog.beat()

    @property
    def expert_range(self) -> tuple[int, int] | None:
        return None if self.ep is None else self.ep.expert_range

    # -- agreements -----------------------------------------------------------------------
    def agree(self, local: dict[str, str | None]) -> dict[str, str | None]:
        """Per unit (same keys, same order on every rank): None where no rank has a reason,
        else the first rank's reason, prefixed with that rank."""
        units = list(local)
        flags = torch.tensor([1 if local[u] else 0 for u in units], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
        if not int(flags.sum()):
            return {u: None for u in units}
        everyone = self.gather_all(local)
        out = {}
        for u in units:
            out[u] = next((f"rank {r}: {d[u]}" for r, d in enumerate(everyone) if d.get(u)),
                          None)
        return out

    def all_ok(self, ok: bool, reason: str | None = None) -> tuple[bool, str | None]:
        """(every rank ok, the first failing rank's reason)."""
        decided = self.agree({"ok": None if ok else (reason or "failed")})
        return decided["ok"] is None, decided["ok"]

    def gather_all(self, obj) -> list:
        """Every rank's picklable object, on every rank (over the gloo group)."""
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.control)


def setup(ep: int, num_experts: int, device_kind: str, timeout_s: float) -> Runtime:
    """Join the job torchrun (or `--nproc`) started: env RANK, WORLD_SIZE, LOCAL_RANK."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    check_parallelism(world, ep, num_experts)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_kind == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise UsageError(f"rank {rank} needs GPU {local_rank} but this machine has "
                             f"{torch.cuda.device_count()}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    fsdp_mesh = init_device_mesh(device.type, (world,))
    ep_group = None
    if ep > 1:
        ep_group = EpGroup(mesh.get_group("ep"), ep, mesh.get_local_rank("ep"), num_experts)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return Runtime(rank=rank, world=world, local_rank=local_rank, device=device, ep=ep_group,
                   ep_size=ep, dp_group=mesh.get_group("dp"), dp_size=world // ep,
                   fsdp_mesh=fsdp_mesh, dp_mesh=mesh["dp"], control=control)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
