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
