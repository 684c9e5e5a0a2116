"""A step whose bounded EP dispatch overflowed is agreed on by every rank and redone exactly.

The moe scopes that take the bounded all-to-all (moe/ep.py) add the rows they could not send
to their `ep_overflow_rows` buffer, on the device and inside any graph. After the step's
backward, outside every graph, `OverflowGuard.run`:
1. sums those buffers and all-reduces the sum over the world: a SUM of non-negative counts is
   the flag (some rank overflowed: > 0) and the count in one small collective, and every rank
   then holds the same number, so every rank decides the same (DESIGN.md, scale-out rule 7);
2. on overflow: puts back the side-effect counters the discarded pass moved (capacity drops,
   router loads), and runs the step's forward and backward again (the trainer's callable
   zeroes the gradients first) with every MoE call on the all-gather (`worst_case_dispatch`)
   and the graph session suspended: the moe graphs hold the bounded all-to-all, so the redo
   runs eagerly, and nothing is re-captured. That step's losses and gradients are then the
   dropless ones, as one process computes them;
3. counts the steps redone (`ep_overflow_steps`) and the rows over the bound
   (`ep_overflow_rows`, over ranks and layers).
Reading the count is one host sync a step; a run whose moe scopes all take the all-gather
skips all of it (no collective, no sync).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from ..moe.ep import worst_case_dispatch

# Buffers a MoE forward adds to (models/common/ffn.py): restored when a pass is discarded.
COUNTERS = ("dropped_routes", "expert_load")


class OverflowGuard:
    def __init__(self, model: torch.nn.Module):
        self.scopes = [m for m in model.modules() if "ep_overflow_rows" in m._buffers]
        self.counters = [b for name, b in model.named_buffers()
                         if name.rpartition(".")[2] in COUNTERS]
        self.steps = 0
        self.rows = 0

    @property
    def armed(self) -> bool:
        """Some moe scope takes the bounded all-to-all (or has not been called yet)."""
        return any(m.ep_bounded is not False for m in self.scopes)

    def run(self, forward_backward: Callable[[], torch.Tensor], session=None) -> torch.Tensor:
        """forward_backward() (zero the gradients, forward, backward; returns the loss), redone
        through the all-gather when any rank's dispatch overflowed."""
        if not self.scopes or not self.armed:
            return forward_backward()
        over = [m.ep_overflow_rows for m in self.scopes]
        torch._foreach_zero_(over)
        saved = [b.clone() for b in self.counters]
        loss = forward_backward()
        total = torch.stack(over).sum()
        dist.all_reduce(total)
        rows = int(total)
        if rows == 0:
            return loss
        self.steps += 1
        self.rows += rows
        with torch.no_grad():
            for buf, before in zip(self.counters, saved):
                buf.copy_(before)
        suspend = getattr(session, "suspended", None)
        with (suspend() if suspend else contextlib.nullcontext()), worst_case_dispatch():
            return forward_backward()

    def report(self) -> dict:
        return {"ep_overflow_steps": self.steps, "ep_overflow_rows": self.rows}


def overflow_report(trainer) -> dict:
    """A trainer's redone steps and rows over the bound (zeros without expert parallelism)."""
    guard = getattr(trainer, "overflow", None)
    return guard.report() if guard is not None else {"ep_overflow_steps": 0,
                                                     "ep_overflow_rows": 0}
