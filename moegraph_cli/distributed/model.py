"""The model of one rank: built on the meta device, sharded, then only the local shard is
materialised (seeded, or read from a checkpoint slice by slice).

- Experts: the EP rank's `num_experts / ep` experts, plain tensors at stable addresses (graphs
  read them in place); replicated over the `dp` mesh dim when ep < world.
- Everything else (embedding, attention, norms, router, shared expert, lm head, dense MLP
  layers): FSDP2 `fully_shard`, one unit per decoder layer plus the root, over all ranks.
  Parameters in the run dtype; gradients reduce-scattered in fp32
  (MixedPrecisionPolicy.reduce_dtype).
- Gradients are summed across ranks, not averaged (gradient divide factor 1): the trainer
  scales each rank's loss by 1/world instead, which makes the dense gradients (summed by
  FSDP2) and the expert gradients (summed by the all-to-all backward) the gradient of the
  global mean loss alike, with no extra pass over the expert gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..io.checkpoint_local import load_local_
from ..config import read_hf_config
from ..models import DTYPES, MoeCausalLM
from ..models.common.init import is_expert_stack, seeded_init_
from .runtime import Runtime

if TYPE_CHECKING:
    from ..train.runspec import RunSpec


def expert_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if is_expert_stack(n)]


def is_sharded(param: torch.Tensor) -> bool:
    """FSDP2-managed (a DTensor outside the forward): never baked into a graph."""
    return isinstance(param, DTensor)


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) whose backward is all_reduce(SUM) of the gradient: every rank's loss
    uses the sum, so each rank's input gets the sum of all ranks' gradients."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_over_ranks(group):
    return lambda t: _SumOverRanks.apply(t, group)


def _set_sum_reduction(module) -> None:
    setter = getattr(module, "set_gradient_divide_factor", None) or \
        getattr(module, "set_reduce_scatter_divide_factor")
    setter(1.0)
    # A divide factor becomes NCCL's PREMUL_SUM, which gloo lacks; a plain SUM is the same
    # reduction for a factor of 1.
    force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
    if force_sum is not None:
        force_sum(True)


def build_sharded_model(spec: RunSpec, rt: Runtime, seed: int | None = None) -> MoeCausalLM:
    prof = spec.profile
    cfg = read_hf_config(spec.checkpoint) if spec.checkpoint is not None else prof.model
    dtype = DTYPES[prof.run.dtype]
    with torch.device("meta"):
        model = MoeCausalLM(cfg, prof.moe, ep=rt.ep).to(dtype)
    experts = set(expert_parameters(model))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    units = []
    for layer in model.layers:
        mine = {p for p in layer.parameters() if p in experts}
        units.append(fully_shard(layer, mesh=rt.fsdp_mesh, mp_policy=policy,
                                 ignored_params=mine or None))
    units.append(fully_shard(model, mesh=rt.fsdp_mesh, mp_policy=policy,
                             ignored_params=experts or None))
    for unit in units:
        _set_sum_reduction(unit)
    model.to_empty(device=rt.device)
    for name, buf in model.named_buffers():
        buf.zero_()  # the drop counters: to_empty leaves them uninitialised
    if spec.checkpoint is not None:
        load_local_(model, spec.checkpoint, cfg, rt.expert_range)
    else:
        seeded_init_(model, prof.run.seed if seed is None else seed, cfg.initializer_range,
                     rt.expert_range)
    model.aux_reduce = _sum_over_ranks(dist.group.WORLD)
    model.aux_world = rt.world
    return model
