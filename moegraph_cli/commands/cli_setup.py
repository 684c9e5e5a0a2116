"""The commands that prepare a run and run without a GPU: `init` (a seeded checkpoint), `inspect`
(shapes, parameter counts, static memory) and `plan` (which scopes to capture under a
budget). app.py registers them; each imports what it needs when it runs."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..report import render
from ..config import DEFAULT_PROFILE, profile_names
from ..config.fields import BOUNDS, check_option
from ..errors import UsageError
from ..units import SIZE_CONVENTION
from .cli_options import (MAX_NPROC, PROFILES, CheckpointOpt, JsonOpt, MkdirOpt, ProfileOpt,
                          ScopesOpt, SetOpt, collect_overrides, resolve_spec)

_SEED = BOUNDS["run.seed"]
SEED_RANGE = f"{_SEED.low}..{_SEED.high}"


def profile_table() -> str:
    """The shipped profiles with their descriptions, for `moegraph inspect --help`."""
    import textwrap
    from importlib import resources

    import yaml

    lines = ["\b", "Profiles (--profile NAME; `moegraph inspect -p NAME` shows one):"]
    for name in profile_names():
        text = (resources.files("moegraph_cli.profiles") / f"{name}.yaml").read_text()
        try:
            about = (yaml.safe_load(text) or {}).get("description") or ""
        except (yaml.YAMLError, AttributeError):
            about = ""
        label = f"{name} (default)" if name == DEFAULT_PROFILE else name
        lines += textwrap.wrap(f"{label}: {about}", 76, initial_indent="  ",
                               subsequent_indent="      ")
    return "\n".join(lines)


def init(
    profile: Annotated[str, typer.Argument(
        metavar="PROFILE", help=f"Profile to instantiate: {PROFILES}; or a YAML path.")],
    directory: Annotated[str, typer.Argument(
        metavar="DIR", help="Output directory for the checkpoint (created; its parent must "
        "exist unless --mkdir).")],
    seed: Annotated[Optional[int], typer.Option(
        metavar="N", help=f"Weight seed, {SEED_RANGE} (default: the profile's run.seed).")
        ] = None,
    max_shard_size: Annotated[str, typer.Option(
        metavar="SIZE", help=f"Shard above this size, e.g. 5GiB ({SIZE_CONVENTION}).")] = "5GiB",
    force: Annotated[bool, typer.Option(
        "--force", help="Write into a non-empty directory.")] = False,
    mkdir: MkdirOpt = False,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Write a Hugging Face-format checkpoint (config.json + safetensors) of seeded weights.

    Tensors are generated and written one at a time (a progress bar on stderr), after a check
    of free disk space; on failure the files written are removed.
    """
    from .create import create_checkpoint
    from ..units import parse_bytes

    max_shard_bytes = parse_bytes(max_shard_size, "--max-shard-size")
    spec = resolve_spec(profile, None, collect_overrides(set_))
    result = create_checkpoint(spec, directory, seed=seed, force=force, mkdir=mkdir,
                               max_shard_bytes=max_shard_bytes, progress=not json_out)
    render.init_result(result, json_out)


def inspect(
    checkpoint_dir: Annotated[Optional[str], typer.Argument(
        metavar="DIR", help="Checkpoint directory, the same as --checkpoint DIR (omit both "
        "to inspect a profile).")] = None,
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Architecture, parameter counts, per-layer shapes and static memory."""
    from ..report.summary import summarize

    if checkpoint_dir and checkpoint and checkpoint_dir != checkpoint:
        raise UsageError(f"give the checkpoint once: DIR {checkpoint_dir} and --checkpoint "
                         f"{checkpoint} differ")
    spec = resolve_spec(profile, checkpoint or checkpoint_dir, collect_overrides(set_))
    if spec.checkpoint is not None:
        from ..io.checkpoint import plan_load
        plan_load(spec.checkpoint, spec.profile.model)  # headers checked, nothing large read
    render.inspect_result(summarize(spec.profile, spec.source), json_out)


def plan(
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    scopes: ScopesOpt = None,
    budget: Annotated[str, typer.Option(
        metavar="SIZE|auto",
        help=f"Memory budget: a size, e.g. 80GiB ({SIZE_CONVENTION}), or auto (a fraction of "
        "this machine's GPU).")] = "auto",
    pool: Annotated[str, typer.Option(
        metavar="NAME", help="Pool grouping: auto, shared, per_scope or per_entry.")] = "auto",
    out: Annotated[Optional[str], typer.Option(
        metavar="FILE", help="Write the plan YAML here (its directory must exist unless "
        "--mkdir).")] = None,
    savings: Annotated[Optional[str], typer.Option(
        metavar="FILE", help="Per-scope savings file written by `moegraph profile`.")] = None,
    calibration: Annotated[Optional[str], typer.Option(
        metavar="FILE",
        help="Pool-size calibration file (from `moegraph profile --calibrate`).")] = None,
    nproc: Annotated[Optional[int], typer.Option(
        "--nproc", metavar="N",
        help=f"Plan one rank of a run on N processes (1..{MAX_NPROC}; run.batch is per rank; "
        "the budget is one GPU's). Nothing is launched.")] = None,
    ep: Annotated[int, typer.Option(
        "--ep", metavar="E",
        help="Expert-parallel degree of that run: each rank holds num_experts/E experts; E "
        "divides N and the number of experts.")] = 1,
    mkdir: MkdirOpt = False,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Choose, per layer, which scopes to capture and which graphs share a pool, under a budget."""
    from ..io.outputs import check_output_file
    from ..plan.planner import plan_command

    check_option("--nproc", nproc)
    check_option("--ep", ep)
    check_output_file(out, "--out", mkdir)
    spec = resolve_spec(profile, checkpoint, collect_overrides(set_, scopes))
    result = plan_command(spec, budget=budget, pool=pool, out=out, savings=savings,
                          calibration=calibration, nproc=nproc, ep=ep)
    render.plan_result(result, json_out)
