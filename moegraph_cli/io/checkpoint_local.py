"""Loading an HF checkpoint into a materialised, sharded model, reading only this rank's bytes.

The model may hold plain tensors, FSDP2 DTensors sharded on dim 0, and expert stacks holding only
the experts in `expert_range`; `models.common.init.owned_rows` says which rows of each full
tensor this rank holds (expert stacks sharded on dim 1 are filled whole, a layer at a time,
through `names`: distributed/model.py). `plan_load` checks the checkpoint from its headers as
for a full load; then each file holding something to fill is opened once and read in offset
order through `safe_open`: a dense tensor as the rows of this rank's chunk (`get_slice`), a
fused expert tensor as `[lo:hi]`, and a per-expert tensor only if its expert is this rank's
(the other experts' tensors are never read).
"""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from .checkpoint import plan_load, read_tensor, refuse_non_finite
from .hf_names import config_summary
from .safetensors_format import shape_str
from ..config import ModelConfig
from ..errors import CheckpointError
from ..models.common.init import is_expert_stack, owned_rows


@torch.no_grad()
def load_local_(model: torch.nn.Module, path: str | os.PathLike, cfg: ModelConfig,
                expert_range: tuple[int, int] | None = None, check_finite: bool = False,
                names=None, plan=None) -> None:
    """Fill every parameter of `model` in place from the checkpoint at `path`, cast to the
    parameter's dtype, reading only what this rank holds (see the module docstring). With
    `check_finite`, a NaN or an infinity in what this rank read is an error naming the HF
    tensor (checkpoint.py `refuse_non_finite`); a rank checks only its own rows, and the
    launcher reports the rank that found one. `names`: fill only those parameters (and saved
    buffers); the checkpoint is still checked against the whole model. `plan`: `plan_load`'s
    of the same path and config, where the caller fills the model in several calls."""
    plan = plan if plan is not None else plan_load(path, cfg)
    params = dict(model.named_parameters())
    # saved buffers (DeepSeek's router correction bias) load like parameters
    params.update({n: b for n, b in model.named_buffers() if n in plan.shapes})
    unfilled = [name for name in params if name not in plan.shapes]
    if unfilled:
        raise CheckpointError(f"checkpoint: no tensor in {plan.root} fills model parameter "
                              f"{unfilled[0]}; the config's model ({config_summary(cfg)}) has "
                              "no such parameter")
    absent = [name for name in plan.shapes if name not in params]
    if absent:
        raise CheckpointError(f"checkpoint: the model has no parameter {absent[0]}, which the "
                              f"config's model ({config_summary(cfg)}) has")

    local_rows = {}  # name -> (local tensor, lo, hi): rows [lo, hi) of the full tensor
    for name, p in params.items():
        if names is not None and name not in names:
            continue
        local, lo, hi = owned_rows(name, p, expert_range)
        full = plan.shapes[name]
        local_experts = is_expert_stack(name) and not isinstance(p, DTensor)
        if local_experts and hi > full[0]:
            raise CheckpointError(f"checkpoint: parameter {name} holds experts {lo}..{hi - 1} "
                                  f"but the checkpoint has {full[0]} experts")
        shape = (full[0], *p.shape[1:]) if local_experts else tuple(p.shape)
        if shape != full:
            raise CheckpointError(f"checkpoint: parameter {name} has shape {shape_str(shape)}, "
                                  f"the checkpoint's tensor has {shape_str(full)}")
        local_rows[name] = (local, lo, hi)

    reads: dict[str, list] = {}  # file -> its reads of what is filled here, in plan order
    for r in plan.reads:
        if r.target in local_rows:
            reads.setdefault(r.file, []).append(r)
    pending: dict = {}  # an MXFP4 tensor's first part, until its second (checkpoint.py)
    for file in plan.files:
        if file not in reads:
            continue  # nothing of `names` in it
        try:
            with safe_open(plan.root / file, framework="pt", device="cpu") as f:
                for r in reads[file]:
                    local, lo, hi = local_rows[r.target]
                    if r.index == ():  # the whole target: a dense tensor or a fused expert stack
                        if hi > lo:  # (layout steps and MXFP4 groups keep dim 0: rows commute)
                            t = read_tensor(r, f.get_slice(r.hf_name)[lo:hi], pending,
                                            local.dtype)
                            if t is not None:
                                local.copy_(t)
                    elif lo <= r.index[0] < hi:  # one expert, or its gate / up rows
                        t = read_tensor(r, f.get_tensor(r.hf_name), pending, local.dtype)
                        if t is not None:
                            local[(r.index[0] - lo, *r.index[1:])].copy_(t)
        except (SafetensorError, OSError) as e:  # the file changed since plan_load read it
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"checkpoint: reading {file} failed: {first_line}") from None
    if check_finite:
        refuse_non_finite(plan, ((name, local) for name, (local, _, _) in local_rows.items()))
