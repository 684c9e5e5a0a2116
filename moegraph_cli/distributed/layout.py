"""--nproc / --ep checks that need no torch (`moegraph plan` runs them on any machine), and
how the experts are laid out over their replicas (the one question here that asks torch, by
reading its source where torch is not imported yet)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

from ..errors import UsageError


def check_parallelism(world: int, ep: int, num_experts: int) -> None:
    """--ep must divide the world size and the number of experts (exit 2 otherwise)."""
    if ep < 1:
        raise UsageError(f"--ep {ep} must be at least 1")
    if world % ep:
        raise UsageError(f"--ep {ep} does not divide the world size {world} (--nproc); "
                         f"choose one of {', '.join(str(d) for d in _divisors(world))}")
    if num_experts and num_experts % ep:
        raise UsageError(f"--ep {ep} does not divide the model's {num_experts} experts; "
                         f"choose a divisor of both {world} and {num_experts}")
    if not num_experts and ep > 1:
        raise UsageError(f"--ep {ep}: the model has no experts to shard")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=None)
def per_parameter_mesh() -> bool:
    """Whether this torch's FSDP2 can put some of a unit's parameters on a mesh of their own
    (`shard_placement_fn` returning a ShardPlacementResult; torch 2.13 can, 2.11 cannot).
    Asked only where 1 < ep < world. Where torch is not imported yet (`moegraph plan`, which
    otherwise needs none), the answer is read from FSDP2's source: importing torch and FSDP2
    takes seconds, the plan itself under one."""
    if "torch" not in sys.modules:
        found = _mesh_in_source()
        if found is not None:
            return found
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import (  # noqa: F401
            FSDPMeshInfo, ShardPlacementResult)
    except ImportError:
        return False
    return True


FSDP_COMMON = ("distributed", "fsdp", "_fully_shard", "_fsdp_common.py")
MESH_CLASSES = ("class FSDPMeshInfo", "class ShardPlacementResult")


def _mesh_in_source(root: str | None = None) -> bool | None:
    """Whether torch's FSDP2 source (under the torch package directory `root`, by default
    the installed one, found without importing it) defines both classes per_parameter_mesh
    imports; None where that source cannot be read (then the import answers)."""
    if root is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        root = list(spec.submodule_search_locations)[0]
    try:
        text = Path(root, *FSDP_COMMON).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return all(cls in text for cls in MESH_CLASSES)


def experts_sharded(world: int, ep: int) -> bool:
    """Whether each expert is FSDP2-sharded over its world / ep replicas (distributed/model.py):
    with ep == 1 the replicas are the layer unit's own mesh, any FSDP2 shards them; with
    1 < ep < world only a torch with a per-parameter mesh can, and on another the experts stay
    whole on every replica (plain tensors, their gradients all-reduced in fp32). The planner
    asks the same question, so a plan charges what this torch will run."""
    replicas = world // ep
    return replicas > 1 and (ep == 1 or per_parameter_mesh())


def expert_shard_dim(local_experts: int, replicas: int, row_sizes) -> int:
    """The dim FSDP2 shards a rank's expert stacks on over their `replicas`: 0, whole experts,
    where the replicas divide the local experts; else 1, the same rows of every expert, where
    they divide each stack's dim 1 (`row_sizes`: FSDP2 shards a dim past 0 only evenly); else
    0, where some replicas then hold only padding (plan/parallel.padding_replicas). So a
    rank's expert memory keeps falling past one expert a replica where the rows allow it."""
    if replicas <= 1 or local_experts % replicas == 0:
        return 0
    return 1 if all(size % replicas == 0 for size in row_sizes) else 0
