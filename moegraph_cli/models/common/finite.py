"""Which weight is not finite: one scan of a model's tensors, shared by whoever must refuse
NaN or infinite weights before using them (`verify` before it compares; a checkpoint loader
after it reads)."""

from __future__ import annotations

from typing import Iterable


def first_non_finite(named_tensors: Iterable) -> tuple[str, str] | None:
    """(name, what) of the first floating-point tensor holding a NaN or an infinity, e.g.
    ("layers.0.moe.w_gate_up", "nan at [3, 17, 2]"); None when every value is finite.
    `named_tensors` yields (name, tensor) pairs: a state dict's items(), named_parameters();
    a sharded tensor (DTensor) is scanned in this rank's shard."""
    import torch

    for name, tensor in named_tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        local = local.detach()
        if not local.is_floating_point() or local.numel() == 0:
            continue
        finite = torch.isfinite(local)
        if bool(finite.all()):
            continue
        index = [int(i) for i in (~finite).nonzero()[0]]
        value = float(local[tuple(index)])
        return name, f"{value} at {index}"
    return None
