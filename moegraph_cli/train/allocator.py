"""The caching allocator's segment mode for a phase of eager steps (`eager_segments`).

The eager phase of `capture` allocates and frees the same activation sizes in a changing order
every step, and the default allocator's fixed-size segments fragment under it: on the H200 the
Qwen1.5-MoE slice at 4 x 4096 held 38.2 GiB reserved for 33.3 GiB allocated
(results/allocator_fragmentation.json). Expandable segments grow one mapping instead, so
reserved stays near allocated -- what the planner predicts -- at the same step time (137.9 vs
137.3 ms there). Graph pools are another matter: under expandable segments their private
pools come out smaller than the planner's model of them, so the mode is switched back before
capture and the pools are made as the planner predicts them.

Left alone where the user chose: a PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) that names
expandable_segments, or MOEGRAPH_EAGER_EXPANDABLE=0.
"""

from __future__ import annotations

import contextlib
import os

import torch

ENV = "MOEGRAPH_EAGER_EXPANDABLE"


def _user_chose() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments" in conf or os.environ.get(ENV, "1") == "0"


def _set(on: bool) -> None:
    # torch.cuda.memory._set_allocator_settings warns FutureWarning on torch 2.11+ and calls
    # this; the old name is kept for a torch without it.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(f"expandable_segments:{on}")


@contextlib.contextmanager
def eager_segments():
    """Expandable segments inside the block (yields whether they were switched on); the
    default fixed segments again after it, freed memory returned first."""
    if not torch.cuda.is_available() or _user_chose():
        yield False
        return
    _set(True)
    try:
        yield True
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        _set(False)
