"""Pool groups: which graphs share a memory pool, the order they are captured in, the group's
replay state, and the bytes each pool holds (read from the allocator, not estimated).

Strategies:
- `per_entry`: every graph (each scope's forward and backward) gets a private pool. This is
  what plain per-scope capture does and what runs out of memory at scale.
- `per_scope`: one pool per scope kind (all attn graphs share one, all moe graphs another).
- `shared`: one pool for every graph.
Within a pool, forward graphs are captured in execution order and backward graphs in reverse,
exactly the order a training step replays them, so a block one graph frees at capture time
and a later graph reuses is dead by the time that later graph replays.

A pooled group replays all-or-nothing within a step: once any member must run eagerly (its
contract broke, or it was re-entered before its backward ran), every member called after
that in the same step runs eagerly too and counts a fallback. The group is reset by
`new_step()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STRATEGIES = ("shared", "per_scope", "per_entry")


@dataclass
class PoolGroup:
    name: str
    pooled: bool  # False: every graph private (per_entry); fallback is then per member
    handle: object = None  # torch.cuda.graph_pool_handle() for pooled groups
    members: list = field(default_factory=list)
    eager_this_step: str | None = None  # first reason the group went eager this step
    pending_backward: int = 0  # forward replays whose backward has not replayed yet
    agreed: bool = False  # decisions are agreed across ranks before each step (distributed)

    def new_step(self) -> None:
        self.eager_this_step = None
        self.pending_backward = 0

    def make_handle(self, backend) -> None:
        if self.pooled and self.handle is None:
            self.handle = backend.pool_handle()

    def release(self) -> None:
        self.handle = None
        self.new_step()


def group_names(names: list[str], kinds: list[str], strategy: str,
                explicit: dict[str, str] | None = None) -> list[str | None]:
    """The pool-group name of each scope; None means private pools (per_entry)."""
    if explicit is not None:
        return [explicit.get(n) for n in names]
    if strategy == "shared":
        return ["shared"] * len(names)
    if strategy == "per_scope":
        return [f"{k}" for k in kinds]
    if strategy == "per_entry":
        return [None] * len(names)
    raise ValueError(f"unknown pool strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def capture_order(num_scopes: int) -> list[tuple[str, int]]:
    """("fwd", i) for i in execution order, then ("bwd", i) in reverse: replay order."""
    return [("fwd", i) for i in range(num_scopes)] + \
        [("bwd", i) for i in reversed(range(num_scopes))]


def pool_bytes(pool_ids: set[tuple]) -> dict[tuple, dict]:
    """Reserved and allocated bytes per pool id, from `torch.cuda.memory_snapshot()` segments."""
    out = {pid: {"reserved": 0, "allocated": 0, "segments": 0} for pid in pool_ids}
    for seg in torch.cuda.memory_snapshot():
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        if pid in out:
            out[pid]["reserved"] += int(seg["total_size"])
            out[pid]["allocated"] += int(seg.get("allocated_size", 0))
            out[pid]["segments"] += 1
    return out
