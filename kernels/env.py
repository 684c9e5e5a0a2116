"""Tile overrides from the environment (what the benchmarks' sweeps print), read once when a
kernel module is imported. No torch here: the CLI imports KernelEnvError to report a bad value
as a usage error."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter (set before Triton decorates a
    kernel)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class KernelEnvError(ValueError):
    """A MOEGRAPH_* kernel variable that does not parse."""


def flag_from_env(name: str, default: bool) -> bool:
    """`name` as 0 / 1 (default when unset or empty)."""
    value = os.environ.get(name)
    if not value:
        return default
    if value not in ("0", "1"):
        raise KernelEnvError(f"{name}={value!r}: expected 0 or 1")
    return value == "1"


def ints_from_env(name: str, fields: str) -> tuple[int, ...] | None:
    """The comma-separated integers of `name` (None when unset or empty), one per field of
    `fields` ("bm,bn,bk,group,warps,stages")."""
    value = os.environ.get(name)
    if not value:
        return None
    want = fields.split(",")
    try:
        ints = tuple(int(v) for v in value.split(","))
    except ValueError:
        ints = ()
    if len(ints) != len(want) or min(ints) <= 0:
        raise KernelEnvError(f"{name}={value!r}: expected {len(want)} positive integers "
                             f"{fields}")
    return ints
