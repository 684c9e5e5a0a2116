"""The inputs of `capture`, `verify` and `profile` that need no device, checked before one is
picked: a CPU machine reports a bad plan, size, step count or token file (exit 2), and only
then that CUDA is missing (exit 4). The profile and the `--set` overrides were checked when
the RunSpec was resolved."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import check_option
from ..plan.capability import check_capturable, check_whole_step
from ..errors import UsageError
from ..train.runspec import RunSpec


@dataclass
class Inputs:
    plan: object | None = None       # plan.planfile.Plan, checked for this run and its ranks
    memory_limit: int | None = None  # bytes


def check_inputs(spec: RunSpec, plan_file: str | None = None, memory_limit: str | None = None,
                 steps: int | None = None, warmup: int | None = None, world: int = 1,
                 ep: int = 1) -> Inputs:
    """Load and check everything a GPU command was given, for a run on `world` ranks with
    `ep`-way expert parallelism; last, refuse a setting graphs cannot capture (exit 4)."""
    prof, run = spec.profile, spec.profile.run
    check_option("--steps", steps)
    check_option("--warmup", warmup)
    limit = None
    if memory_limit is not None:
        from ..units import parse_bytes
        limit = parse_bytes(memory_limit, "--memory-limit")
    plan = None
    if plan_file is not None:
        from ..plan.planfile import load_plan
        plan = load_plan(plan_file, prof, world, ep)
    if world > 1 and run.grad_accum > 1:
        raise UsageError("run.grad_accum > 1 runs in one process only for now; on several "
                         "processes raise run.batch instead")
    if "step" in run.scopes:
        check_whole_step(world)
    if run.data:
        from ..train.trainer import check_token_file
        check_token_file(run.data, prof.model.vocab_size,
                         run.batch * run.grad_accum * world * run.seq_len)
    check_capturable(prof, None if plan is not None else run.pool)
    return Inputs(plan=plan, memory_limit=limit)
