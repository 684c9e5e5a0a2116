"""The machine the tests run on."""

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
