"""The training step of one rank: its slice of the global batch, the loss scaled by 1/world
(gradients are summed across ranks, see distributed/model.py), AdamW on the local shards.
Expert gradients reach their replicas through FSDP2's reduce-scatter when the experts are
sharded (ep < world); only experts kept replicated (a torch without FSDP2's per-parameter
mesh) are all-reduced here. A step whose bounded EP dispatch overflowed on any rank is redone
before the optimizer sees it (overflow.py).

AdamW runs on plain tensors: the sharded (DTensor) parameters through aliases of their local
shards, their gradients likewise. A fused AdamW over DTensors works too but pays DTensor's
dispatch on the host every step, which a launch-bound step cannot afford; AdamW is
elementwise, so the update is the same bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..train.trainer import GraphTrainer
from ..train.trainer import allocate_grads
from .model import expert_parameters, is_sharded
from .overflow import OverflowGuard
from .runtime import Runtime


def _adamw(params: list, lr: float, weight_decay: float):
    if not params:
        return None
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


class _Optimizers:
    """One AdamW over plain tensors: the plain parameters (experts when ep == world) and, for
    each sharded parameter (sharded experts too), an alias of its local shard
    (`to_local().detach()` shares the storage FSDP2 keeps for the run). Gradients must exist
    (allocate_grads) and are zeroed in place, never set to None."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float):
        params = [p for p in model.parameters() if p.requires_grad]
        self.sharded = [p for p in params if is_sharded(p)]
        self.local = [p.to_local().detach() for p in self.sharded]
        plain = [p for p in params if not is_sharded(p)]
        self.optimizer = _adamw(self.local + plain, lr, weight_decay)
        self.plain = plain

    def _bind_grads(self) -> list[torch.Tensor]:
        grads = []
        for p, local in zip(self.sharded, self.local):
            local.grad = p.grad.to_local()
            grads.append(local.grad)
        return grads + [p.grad for p in self.plain]

    def zero_grad(self, set_to_none: bool = False) -> None:
        grads = [g for g in self._bind_grads() if g is not None and g.numel()]
        if grads:
            torch._foreach_zero_(grads)

    def step(self) -> None:
        self._bind_grads()
        if self.optimizer is not None:
            self.optimizer.step()


class DistTrainer(GraphTrainer):
    def __init__(self, model, lr: float, weight_decay: float, rt: Runtime):
        self.model = model
        self.rt = rt
        self.optimizer = _Optimizers(model, lr, weight_decay)
        allocate_grads(model)
        self.session = None
        # experts replicated over rt.dp_size > 1 ranks as plain tensors (distributed/model.py)
        replicated = rt.dp_size > 1
        self.experts = [p for p in expert_parameters(model) if replicated and not is_sharded(p)]
        self.overflow = OverflowGuard(model)

    def _forward_backward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=False)
        out = self.model(input_ids, labels=input_ids, keep_logits=False)
        (out.loss / self.rt.world).backward()
        return out.loss.detach()

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.session is not None:
            self.session.new_step()
        loss = self.overflow.run(lambda: self._forward_backward(input_ids), self.session)
        if self.experts:
            reduce_expert_grads(self.experts, self.rt.dp_group)
        self.optimizer.step()
        return loss


def reduce_expert_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the expert gradients over their replicas (the dp mesh dim), in fp32."""
    for p in params:
        g32 = p.grad.float()
        dist.all_reduce(g32, group=group)
        p.grad.copy_(g32)
