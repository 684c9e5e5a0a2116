"""Configurations graph capture does not support: refused before anything is captured."""

from __future__ import annotations

from ..config import Profile
from ..errors import NotCapturableError


def check_whole_step(world: int) -> None:
    """`--scopes step` is one process only: FSDP2's collectives run outside graphs."""
    if world > 1:
        raise NotCapturableError("--scopes step: the whole step cannot be one graph on several "
                                 "processes (FSDP2's all-gathers and reduce-scatters run outside "
                                 "graphs); use --scopes attn,moe")


def check_capturable(prof: Profile, pool: str | None = None) -> None:
    run = prof.run
    if run.fp8:
        raise NotCapturableError("run.fp8=true: fp8 scaling state is not part of a scope's "
                                 "contract; fp8 capture is not supported")
    if run.pipeline_interleave != 1:
        raise NotCapturableError(f"run.pipeline_interleave={run.pipeline_interleave}: "
                                 "interleaved pipeline schedules replay graphs out of capture "
                                 "order; only 1 is supported")
    if run.dynamic_shapes and (pool or run.pool) in ("shared", "per_scope", "auto"):
        raise NotCapturableError("run.dynamic_shapes=true with a shared pool: graphs sharing "
                                 "a pool must replay one fixed shape; use --pool per_entry")
