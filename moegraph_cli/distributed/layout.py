"""--nproc / --ep checks that need no torch (`moegraph plan` runs them on any machine)."""

from __future__ import annotations

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


def expert_shard_dim(local_experts: int, replicas: int, row_sizes) -> int:
    """The dim FSDP2 shards a rank's expert stacks on over their `replicas`: 0, whole experts,
    where the replicas divide the local experts; else 1, the same rows of every expert, where
    they divide each stack's dim 1 (`row_sizes`: FSDP2 shards a dim past 0 only evenly); else
    0, where some replicas then hold only padding (plan/parallel.padding_replicas). So a
    rank's expert memory keeps falling past one expert a replica where the rows allow it."""
    if replicas <= 1 or local_experts % replicas == 0:
        return 0
    return 1 if all(size % replicas == 0 for size in row_sizes) else 0
