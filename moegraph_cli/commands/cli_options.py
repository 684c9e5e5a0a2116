"""What the `moegraph` commands share: their options (one spelling and help text for each),
and the steps every command takes: resolve the profile or checkpoint, gather `--set`
overrides, start the ranks for --nproc/--ep, and report an error or a warning once per job.
Nothing here imports torch."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from ..report import render
from ..config import DEFAULT_PROFILE, profile_names
from ..config.fields import BOUNDS, check_option
from ..errors import UsageError


def _profile_list() -> str:
    names = profile_names()
    return ", ".join(f"{n} (default)" if n == DEFAULT_PROFILE else n for n in names)


PROFILES = _profile_list()
ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", "-p", metavar="NAME|FILE",
    help=f"Profile: {PROFILES}; or a YAML path. With --checkpoint, only its run and moe "
    "settings are used.")]
CheckpointOpt = Annotated[Optional[str], typer.Option(
    "--checkpoint", "-c", metavar="DIR",
    help="A Hugging Face-format checkpoint directory: the architecture comes from its "
    "config.json.")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="SECTION.FIELD=VALUE",
    help="Override a field, e.g. --set run.seq_len=2048 (repeatable).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
MkdirOpt = Annotated[bool, typer.Option(
    "--mkdir", help="Create missing parent directories of the output paths.")]
ScopesOpt = Annotated[Optional[str], typer.Option(
    "--scopes", metavar="attn,moe",
    help="Comma list of scopes to graph: attn, moe; or step (the whole training step, "
    "optimizer included, as one graph). Default: the profile's.")]
PoolOpt = Annotated[Optional[str], typer.Option(
    "--pool", metavar="NAME",
    help="Pool strategy: shared, per_scope or per_entry (default: the profile's).")]
MAX_NPROC = BOUNDS["--nproc"].high
NprocOpt = Annotated[Optional[int], typer.Option(
    "--nproc", metavar="N",
    help=f"Run on N local processes (1..{MAX_NPROC}), one per GPU, started by "
    "torch.distributed.run (run.batch is per rank). Also works under torchrun.")]
EpOpt = Annotated[int, typer.Option(
    "--ep", metavar="E",
    help="Expert-parallel degree: each of E ranks owns num_experts/E experts; E divides the "
    "world size and the number of experts.")]


def fail(message: str, code: int) -> None:
    """One line for the user; inside a launched rank, handed to the launcher instead."""
    from ..distributed.launch import report_error, worker_env

    if worker_env() is not None:
        report_error(message, code)
    else:
        render.error(message)


def warn(message: str) -> None:
    """One warning line on stderr, printed once per job (not again by each launched rank)."""
    from ..distributed.launch import launched_by_moegraph, worker_env

    env = worker_env()
    if env is None or (env.rank == 0 and not launched_by_moegraph()):
        render.warning(message)


def resolve_spec(profile: Optional[str], checkpoint: Optional[str], overrides: list[str]):
    """runspec.resolve, with its warnings (a profile that disagrees with the checkpoint's
    config.json) on stderr."""
    from ..train.runspec import resolve

    spec = resolve(profile, checkpoint, overrides)
    for message in spec.warnings:
        warn(message)
    return spec


def distribute(spec, nproc: Optional[int], ep: int) -> None:
    """In the launching process: check --nproc/--ep against the model, then start the ranks
    (this process waits and exits with the job's code). Inside a rank: nothing."""
    from ..distributed.launch import maybe_launch, worker_env
    from ..distributed.layout import check_parallelism

    if worker_env() is None:
        check_option("--nproc", nproc)
        check_option("--ep", ep)
        if ep != 1 and (nproc or 1) == 1:
            raise UsageError(f"--ep {ep} needs several processes: add --nproc N (or start the "
                             "command with torchrun)")
        check_parallelism(nproc or 1, ep, spec.profile.model.num_experts)
    code = maybe_launch(sys.argv[1:], nproc)
    if code is not None:
        raise typer.Exit(code)


def check_options(**values) -> None:
    """Numeric options against their bounds (config/fields.py BOUNDS), before any work:
    check_options(steps=0) refuses `--steps 0` as `--set run.steps=0` would be."""
    for name, value in values.items():
        check_option("--" + name.replace("_", "-"), value)


def collect_overrides(sets: Optional[list[str]], scopes: Optional[str] = None,
                      pool: Optional[str] = None) -> list[str]:
    out = list(sets or [])
    if scopes is not None:
        out.append(f"run.scopes={scopes}")
    if pool is not None:
        out.append(f"run.pool={pool}")
    return out
