"""Which weight is not finite: one scan of a model's tensors, shared by whoever must refuse
NaN or infinite weights before using them (`verify` before it compares; a checkpoint loader
after it reads, io/checkpoint.py).

The scan is one reduction per tensor, `aminmax` (a NaN anywhere makes both NaN, an infinity
makes one of them infinite, so both are finite exactly when every value is): one pass over
the tensor, no temporary of its size, and one host sync per device for all the tensors. Only
a tensor it flags is searched for the place of its first bad value."""

from __future__ import annotations

from typing import Iterable


def first_non_finite(named_tensors: Iterable) -> tuple[str, str] | None:
    """(name, what) of the first floating-point tensor holding a NaN or an infinity, e.g.
    ("layers.0.moe.w_gate_up", "nan at [3, 17, 2]"); None when every value is finite.
    `named_tensors` yields (name, tensor) pairs: a state dict's items(), named_parameters();
    a sharded tensor (DTensor) is scanned in this rank's shard."""
    import torch

    scanned = []
    for name, tensor in named_tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        local = local.detach()
        if local.is_floating_point() and local.numel() > 0:
            scanned.append((name, local))
    by_device: dict = {}
    for i, (_, local) in enumerate(scanned):
        by_device.setdefault(local.device, []).append(i)
    bad = set()
    for device, indices in by_device.items():
        ends = torch.stack([torch.stack(torch.aminmax(scanned[i][1])).double()
                            for i in indices])
        finite = torch.isfinite(ends).all(dim=1).tolist()  # the one sync of this device
        bad.update(i for i, ok in zip(indices, finite) if not ok)
    if not bad:
        return None
    name, local = scanned[min(bad)]
    index = [int(i) for i in (~torch.isfinite(local)).nonzero()[0]]
    return name, f"{float(local[tuple(index)])} at {index}"
