"""The model of one rank: built on the meta device, sharded, then only the local shard is
materialised (seeded, or read from a checkpoint slice by slice).

- Experts: the EP rank's `num_experts / ep` experts. With N ranks and EP degree E each expert
  lives on N / E ranks (the `dp` mesh dim, runtime.py):
  - N == E: plain tensors at stable addresses (graphs read them in place), nothing else;
  - N > E: FSDP2-sharded over those N / E ranks (weights, gradients and AdamW states), in the
    decoder layer's FSDP unit but on the dp mesh (a second parameter group of the unit:
    `shard_placement_fn` with a per-parameter mesh, as torchtitan does), so per-rank expert
    memory falls as replicas are added. On dim 0 (whole experts) where the replicas divide
    the rank's experts, else on dim 1 (the same rows of every expert) where they divide each
    stack's rows (layout.expert_shard_dim; torchtitan likewise takes Shard(1) past one expert
    a replica): with dim 0 alone a replica past the local experts would hold only padding,
    and per-rank expert memory would stop falling at one expert a layer. With E == 1 the dp
    mesh is the whole world: the experts simply join the layer's one parameter group (their
    placement then only names the dim). Sharded experts are DTensors, hence
    "moving" parameters of the moe graphs (harness.build_session), and never gradient sinks
    (the trainer marks none): their gradients leave through autograd into the unsharded
    `.grad` that FSDP2's post-backward reduce-scatters. A rank whose experts received no
    route gets no expert gradient; `set_reduce_scatter_unused_params` sends zeros for it, so
    every rank joins the same reduce-scatter.
  A torch whose fully_shard has no per-parameter mesh keeps the experts replicated over the
  dp ranks when 1 < E < N (plain tensors; the trainer all-reduces their gradients).
- Everything else (embedding, attention, norms, router, shared expert, lm head, dense MLP
  layers): FSDP2 `fully_shard` over all ranks, one unit per decoder layer; with an untied
  head (torchtitan's units) one for the embedding, resharded after its forward and gathered
  again for its backward at the end, and one for the final norm with the lm head, kept from
  its forward to its backward (the backward's first), whose gradients are reduce-scattered
  and freed there; the root then holds no parameter. So neither the vocabulary-sized weights
  nor the head's gradient live through the layers' backward (with the root holding both,
  both weights lived the whole step and the head's [V, H] gradient the whole backward). A
  tied head keeps the embedding and the final norm in the root (its weight is read at both
  ends of the step).
  Parameters in the run dtype; gradients reduce-scattered in fp32
  (MixedPrecisionPolicy.reduce_dtype).
- Gradients are summed across ranks, not averaged (gradient divide factor 1): the trainer
  scales each rank's loss by 1/world instead, which makes the dense gradients (summed by
  FSDP2) and the expert gradients (summed over the EP group by the all-to-all backward, then
  over their replicas by FSDP2's reduce-scatter) the gradient of the global mean loss alike.
- Cost and overlap of sharded experts: a layer all-gathers its experts before its forward and
  again before its backward (they are resharded after the forward, so unsharded experts live
  only while their layer runs), and reduce-scatters their fp32 gradients after its backward.
  Layer i's pre-forward also issues layer i + 1's all-gather
  (`set_modules_to_forward_prefetch`); in the backward FSDP2's implicit prefetch gathers
  layer i - 1 while layer i runs; on CUDA FSDP2 runs both collectives on its own streams,
  beside the compute. On gloo a collective blocks the thread that issues it, so nothing
  overlaps on a CPU. Measured on CPU only (gloo, 4 ranks on 2 busy cores, ep 2,
  tiny-qwen3-moe with vocab 2048: 2 MoE layers of 8 experts, hidden 512, width 256; 128
  tokens a rank; fp32; medians of 7 steps, 4 runs): a step took 0.74-0.93 s, the experts'
  all-gathers 0.06-0.08 s of it and their reduce-scatters 0.04-0.10 s (about 15% together);
  replicated experts instead (2 runs): a 0.84-0.92 s step, 0.05-0.07 s of it in their
  gradients' all-reduce. Per rank and step, with r replicas, the all-reduce moves 2 (r-1)/r
  of the fp32 gradients; sharding moves (r-1)/r of them (reduce-scatter) plus twice (r-1)/r
  of the weights in the run dtype (the two all-gathers).
- Loading: the local shard of a stack sharded on dim 0 is a contiguous range of global experts
  (its dim-0 chunk of the EP rank's experts), the same range for every stack, so
  `seeded_init_` and `load_local_` fill it as a plain local expert stack of that range
  (`_expert_shards_as_stacks`). A stack sharded on dim 1 is filled whole, one layer's stacks
  at a time (a transient of that layer's local experts), and this rank's rows copied into
  its shard (`_rows_staged`): the values are the one-process model's either way.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..io.checkpoint import plan_load
from ..io.checkpoint_local import load_local_
from ..config import read_hf_config
from ..models import DTYPES, MoeCausalLM
from ..models.common.init import (dim0_chunk, is_expert_stack, seeded_init_, shard_chunk,
                                  shard_dim)
from .layout import expert_shard_dim, experts_sharded
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


def expert_dim(model: torch.nn.Module, rt: Runtime) -> int:
    """The dim this run's expert stacks are sharded on over their replicas (layout.py's rule:
    whole experts where the replicas divide them, else rows of every expert)."""
    stacks = expert_parameters(model)
    if not stacks:
        return 0
    return expert_shard_dim(stacks[0].shape[0], rt.dp_size, {p.shape[1] for p in stacks})


def _expert_placement(rt: Runtime, experts: set, dim: int):
    """fully_shard's `shard_placement_fn` putting the experts on the dp mesh, sharded on
    `dim`, or None where this torch has no per-parameter mesh. With ep 1 the dp mesh is the
    layer's own: only the dim is placed (None where it is 0, FSDP2's default)."""
    if rt.ep_size == 1:
        return (lambda p: Shard(dim) if p in experts else None) if dim else None
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                      ShardPlacementResult)
    except ImportError:
        return None
    info = FSDPMeshInfo(rt.dp_mesh, shard_mesh_dim=0)  # one object: FSDP2 groups by it
    return lambda p: ShardPlacementResult(Shard(dim), info) if p in experts else None


def _shard(model: MoeCausalLM, rt: Runtime) -> None:
    """fully_shard every decoder layer, the embedding, the head and the root (see the
    module docstring)."""
    experts = set(expert_parameters(model))
    sharded = bool(experts) and experts_sharded(rt.world, rt.ep_size)
    placement = _expert_placement(rt, experts, expert_dim(model, rt)) if sharded else None
    if sharded and rt.ep_size > 1 and placement is None:
        raise RuntimeError("FSDP2 has a per-parameter mesh (layout.per_parameter_mesh) but "
                           "no expert placement was built")
    plain = set() if sharded else experts
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    units = []
    for layer in model.layers:
        mine = {p for p in layer.parameters() if p in experts}
        kwargs = {"shard_placement_fn": placement} if mine and placement is not None else {}
        units.append(fully_shard(layer, mesh=rt.fsdp_mesh, mp_policy=policy,
                                 ignored_params=(mine & plain) or None, **kwargs))
        # A rank whose experts got no route sends zeros. (With ep == 1 every rank routes to
        # its experts: a torch without the setting needs none.)
        unused = getattr(units[-1], "set_reduce_scatter_unused_params", None)
        if mine and sharded and unused is not None:
            unused(True, recurse=False)
    if sharded:
        for unit, after in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([after])
    if model.lm_head is not None:  # untied: the embedding, and the final norm with the head
        units.append(fully_shard(model.embed_tokens, mesh=rt.fsdp_mesh, mp_policy=policy))
        head = fully_shard([model.norm, model.lm_head], mesh=rt.fsdp_mesh, mp_policy=policy,
                           reshard_after_forward=False)
        units.append(model.norm if isinstance(head, list) else head)  # one state for both
    units.append(fully_shard(model, mesh=rt.fsdp_mesh, mp_policy=policy,
                             ignored_params=plain or None))
    for unit in units:
        _set_sum_reduction(unit)


@contextlib.contextmanager
def _expert_shards_as_stacks(model: torch.nn.Module, rt: Runtime):
    """Yield the global expert range this rank's expert tensors hold; while inside, every
    FSDP2-sharded expert stack is registered as a plain Parameter over its local shard (same
    storage), which `seeded_init_` and `load_local_` fill as a local expert stack."""
    lo = 0 if rt.expert_range is None else rt.expert_range[0]
    swapped, rows = [], set()
    try:
        for name, p in list(model.named_parameters()):
            if not (is_expert_stack(name) and is_sharded(p)) or shard_dim(p) != 0:
                continue
            local, c_lo, c_hi = dim0_chunk(p)
            rows.add((c_lo, c_hi))
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            swapped.append((owner, leaf, p))
            owner._parameters[leaf] = torch.nn.Parameter(local, requires_grad=p.requires_grad)
        if not swapped:
            yield rt.expert_range
            return
        if len(rows) != 1:  # every stack has E / ep rows, chunked alike
            raise RuntimeError(f"expert stacks hold different expert rows: {sorted(rows)}")
        c_lo, c_hi = rows.pop()
        yield lo + c_lo, lo + c_hi
    finally:
        for owner, leaf, p in reversed(swapped):
            owner._parameters[leaf] = p


@contextlib.contextmanager
def _rows_staged(model: torch.nn.Module, names):
    """While inside, each expert stack in `names` (sharded on dim 1: the same rows of every
    local expert) is registered as a plain Parameter over a whole local stack, which
    `seeded_init_` and `load_local_` fill as a plain local expert stack; on leaving without an
    error, this rank's rows of it are copied into its shard. One layer's stacks at a time:
    the transient is that layer's local experts, whole."""
    staged = []
    try:
        for name in names:
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            p = owner._parameters[leaf]
            whole = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
            staged.append((owner, leaf, p, whole))
            owner._parameters[leaf] = torch.nn.Parameter(whole, requires_grad=p.requires_grad)
        yield
        with torch.no_grad():
            for _, _, p, whole in staged:
                local, lo, hi = shard_chunk(p, 1)
                local.copy_(whole.narrow(1, lo, hi - lo))
    finally:
        for owner, leaf, p, _ in reversed(staged):
            owner._parameters[leaf] = p


def _fill(model, spec: RunSpec, cfg, seed: int, expert_range, names=None, plan=None) -> None:
    if spec.checkpoint is not None:
        load_local_(model, spec.checkpoint, cfg, expert_range, check_finite=True, names=names,
                    plan=plan)
    else:
        seeded_init_(model, seed, cfg.initializer_range, expert_range, names=names)


def build_sharded_model(spec: RunSpec, rt: Runtime, seed: int | None = None) -> MoeCausalLM:
    prof = spec.profile
    cfg = read_hf_config(spec.checkpoint) if spec.checkpoint is not None else prof.model
    dtype = DTYPES[prof.run.dtype]
    with torch.device("meta"):
        model = MoeCausalLM(cfg, prof.moe, ep=rt.ep).to(dtype)
    _shard(model, rt)
    model.to_empty(device=rt.device)
    for name, buf in model.named_buffers():
        buf.zero_()  # the drop counters: to_empty leaves them uninitialised
    seed = prof.run.seed if seed is None else seed
    by_rows: dict[str, list[str]] = {}  # layer -> its expert stacks sharded on dim 1
    for name, p in model.named_parameters():
        if is_expert_stack(name) and is_sharded(p) and shard_dim(p) == 1:
            by_rows.setdefault(".".join(name.split(".")[:2]), []).append(name)
    rest, plan = None, None
    if by_rows:
        # one load plan (the headers read once) for the fills below
        plan = plan_load(spec.checkpoint, cfg) if spec.checkpoint is not None else None
        staged = {n for names in by_rows.values() for n in names}
        rest = {n for n, _ in [*model.named_parameters(), *model.named_buffers()]} - staged
    with _expert_shards_as_stacks(model, rt) as expert_range:
        _fill(model, spec, cfg, seed, expert_range, rest, plan)
    for names in by_rows.values():
        with _rows_staged(model, names):
            _fill(model, spec, cfg, seed, rt.expert_range, set(names), plan)
    model.aux_reduce = _sum_over_ranks(dist.group.WORLD)
    model.aux_world = rt.world
    return model
