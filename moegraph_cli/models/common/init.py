"""Seeded initialisation that gives the same full model for any world size and EP degree.

Every parameter draws N(0, std) from a generator of its own, seeded from (seed, name) through
sha256; expert e of a stacked expert parameter from (seed, name, e). A value therefore depends
only on the seed, the parameter's name, where it sits in the full tensor and the generator's
device type (CPU and CUDA generators give different streams): not on the order of parameters,
on which other parameters exist, on how FSDP shards the dense ones, or on which experts an EP
rank holds. Norm weights are one.

Values are drawn in float32 and cast to the parameter's dtype with round-to-nearest, so a bf16
model holds exactly the bf16 rounding of the fp32 model on CPU and on CUDA alike (drawing in bf16
directly would give a different stream, and a different one per device kind).

Which rows of the full tensor this rank holds (`owned_rows`) is decided here and read by the
sharded checkpoint loader (checkpoint_local.py) too:
- a plain tensor: all rows;
- a plain expert stack `...moe.w_gate_up` [E_local, 2F, H] / `...moe.w_down` [E_local, H, F]:
  global experts `expert_range = (lo, hi)`, local slice i holding expert lo + i;
- a DTensor (FSDP2): its dim-0 chunk, `torch.chunk(full, n, dim=0)` over each mesh dim it is
  sharded on, in mesh-dim order; trailing ranks may hold fewer rows or none. (An expert stack
  sharded on dim 1 is filled whole and cut by distributed/model.py: `shard_chunk`.)
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

EXPERT_STACKS = ("moe.w_gate_up", "moe.w_down",  # dim 0 is the expert
                 "moe.b_gate_up", "moe.b_down")  # (GPT-OSS's expert biases)
# Buffers that start at zero: DeepSeek's router correction bias (in the checkpoint) and the
# load it counts for the bias update.
ZERO_BUFFERS = ("e_score_correction_bias", "expert_load")


def is_expert_stack(name: str) -> bool:
    return name.endswith(EXPERT_STACKS)


def stable_seed(seed: int, *key) -> int:
    """A 63-bit generator seed from (seed, *key), the same in every process and Python run."""
    text = "/".join(str(k) for k in (seed, *key))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def dim0_chunk(p: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(local tensor, lo, hi): this rank holds rows [lo, hi) of the full tensor along dim 0.

    Computed from the DTensor's own mesh coordinate and placements, without collectives, and
    checked against its local shape."""
    return shard_chunk(p, 0)


def shard_dim(p: torch.Tensor) -> int:
    """The tensor dim a DTensor is sharded on (0 for a plain tensor or a replicated one)."""
    dims = {pl.dim for pl in getattr(p, "placements", ()) if isinstance(pl, Shard)}
    return dims.pop() if len(dims) == 1 else 0


def shard_chunk(p: torch.Tensor, dim: int) -> tuple[torch.Tensor, int, int]:
    """(local tensor, lo, hi): this rank holds [lo, hi) of the full tensor along `dim`, by
    torch.chunk over each mesh dim it is sharded on (see dim0_chunk)."""
    if not isinstance(p, DTensor):
        return p, 0, p.shape[dim]
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"this rank is not in the mesh of a DTensor of shape {list(p.shape)}")
    lo, hi = 0, p.shape[dim]
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        # _StridedShard subclasses Shard with another layout, hence the exact type check.
        if type(placement) is not Shard or placement.dim != dim:
            raise ValueError(f"DTensor of shape {list(p.shape)} has placement {placement}; "
                             f"only Shard({dim}) and Replicate are supported here")
        rows, n_chunks = hi - lo, mesh.size(mesh_dim)
        step = -(-rows // n_chunks)  # torch.chunk: ceil-sized chunks, the last ones short
        i = coord[mesh_dim]
        lo, hi = lo + min(i * step, rows), lo + min((i + 1) * step, rows)
    local = p.to_local()
    want = list(p.shape)
    want[dim] = hi - lo
    if list(local.shape) != want:
        raise RuntimeError(f"DTensor of shape {list(p.shape)} with placements {p.placements}: "
                           f"expected [{lo}, {hi}) of dim {dim} locally, its local shape is "
                           f"{list(local.shape)}")
    return local, lo, hi


def owned_rows(name: str, p: torch.Tensor,
               expert_range: tuple[int, int] | None = None) -> tuple[torch.Tensor, int, int]:
    """(local tensor, lo, hi) for parameter `name`: the rows (experts, for an expert stack) of
    the full tensor along dim 0 that this rank holds; see the module docstring."""
    if is_expert_stack(name) and not isinstance(p, DTensor):
        lo, hi = expert_range if expert_range is not None else (0, p.shape[0])
        if not 0 <= lo <= hi or p.shape[0] != hi - lo:
            raise ValueError(f"{name} holds {p.shape[0]} experts but expert_range is "
                             f"{expert_range}")
        local = p
    elif is_expert_stack(name) and expert_range is not None:
        raise ValueError(f"{name} is a DTensor; expert_range applies only to plain expert stacks")
    else:
        local, lo, hi = dim0_chunk(p)
    if local.device.type == "meta":
        raise ValueError(f"parameter {name} is on the meta device; materialise the model "
                         "(to_empty) first")
    return local, lo, hi


def _normal_fp32(shape, std: float, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std,
                                                                          generator=gen)


def seeded_value(name: str, shape, seed: int, std: float, expert: int | None = None,
                 device="cpu") -> torch.Tensor:
    """The fp32 value of parameter `name` (its full `shape`), or of expert `expert` of an expert
    stack (`shape` is then one expert's). `seeded_init_` fills models from this; `moegraph
    init` writes checkpoints from it one tensor at a time, without building the model."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float32, device=device)
    if name.endswith(ZERO_BUFFERS):
        return torch.zeros(shape, dtype=torch.float32, device=device)
    key = (name,) if expert is None else (name, expert)
    return _normal_fp32(shape, std, torch.device(device), stable_seed(seed, *key))


@torch.no_grad()
def seeded_init_(model: nn.Module, seed: int, std: float,
                 expert_range: tuple[int, int] | None = None, names=None) -> None:
    """Fill every parameter in place: norms one, the rest N(0, std) per (seed, name[, expert]).

    A DTensor parameter is drawn whole (one parameter at a time, so the transient is one fp32
    tensor) and this rank's chunk copied into its local tensor. An expert stack draws only the
    experts this rank holds, one expert at a time. `names`: only those parameters (and then
    no buffer)."""
    for name, p in model.named_parameters():
        if names is not None and name not in names:
            continue
        local, lo, hi = owned_rows(name, p, expert_range)
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif is_expert_stack(name):
            for e in range(lo, hi):
                local[e - lo].copy_(seeded_value(name, p.shape[1:], seed, std, e, local.device))
        else:
            local.copy_(seeded_value(name, p.shape, seed, std, None, local.device)[lo:hi])
    for name, buf in model.named_buffers() if names is None else ():
        if name.endswith(ZERO_BUFFERS):
            buf.zero_()
