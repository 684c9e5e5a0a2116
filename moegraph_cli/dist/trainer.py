"""The training step of one rank: its slice of the global batch, the loss scaled by 1/world
(gradients are summed across ranks, see dist/model.py), expert gradients all-reduced over
their replicas when ep < world, AdamW on the local shards.

Sharded (DTensor) and plain (expert) parameters get separate optimizers: one fused AdamW call
cannot mix DTensors with plain tensors. AdamW is elementwise, so this is the same update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..harness import GraphTrainer
from ..train import allocate_grads
from .model import expert_parameters, is_sharded
from .runtime import Runtime


def _adamw(params: list, lr: float, weight_decay: float):
    if not params:
        return None
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


class _Optimizers:
    """zero_grad / step over the sharded and the plain parameters' optimizers."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float):
        params = [p for p in model.parameters() if p.requires_grad]
        self.parts = [o for o in (_adamw([p for p in params if is_sharded(p)], lr, weight_decay),
                                  _adamw([p for p in params if not is_sharded(p)], lr,
                                         weight_decay)) if o is not None]

    def zero_grad(self, set_to_none: bool = False) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.parts:
            o.step()


class DistTrainer(GraphTrainer):
    def __init__(self, model, lr: float, weight_decay: float, rt: Runtime):
        self.model = model
        self.rt = rt
        self.optimizer = _Optimizers(model, lr, weight_decay)
        allocate_grads(model)
        self.session = None
        self.experts = expert_parameters(model)

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.session is not None:
            self.session.new_step()
        self.optimizer.zero_grad(set_to_none=False)
        out = self.model(input_ids, labels=input_ids)
        (out.loss / self.rt.world).backward()
        if self.rt.dp_size > 1:
            reduce_expert_grads(self.experts, self.rt.dp_group)
        self.optimizer.step()
        return out.loss.detach()


def reduce_expert_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the expert gradients over their replicas (the dp mesh dim), in fp32."""
    for p in params:
        g32 = p.grad.float()
        dist.all_reduce(g32, group=group)
        p.grad.copy_(g32)
