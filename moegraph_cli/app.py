"""The `moegraph` command line: parse arguments, call one library function, render.

Exit codes: 0 ok, 1 error, 2 usage, 3 parity failure, 4 no CUDA / not capturable.
Errors print one line on stderr; MOEGRAPH_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Annotated, Optional

import typer

from . import render
from .errors import EXIT_ERROR, EXIT_PARITY, MoegraphError, UsageError

app = typer.Typer(
    name="moegraph", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Plan, capture and verify CUDA-graph training of Mixture-of-Experts transformers.")

ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", "-p", help="Profile name (see `moegraph inspect --help`) or a YAML path. "
    "Default: tiny-qwen3-moe.")]
CheckpointOpt = Annotated[Optional[str], typer.Option(
    "--checkpoint", "-c", help="A Hugging Face-format checkpoint directory.")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", help="Override a field, e.g. --set run.seq_len=2048 (repeatable).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
ScopesOpt = Annotated[Optional[str], typer.Option(
    "--scopes", help="Comma list of scopes to graph: attn, moe (default: the profile's).")]
PoolOpt = Annotated[Optional[str], typer.Option(
    "--pool", help="Pool strategy: shared, per_scope or per_entry (default: the profile's).")]
NprocOpt = Annotated[Optional[int], typer.Option(
    "--nproc", help="Run on N local processes, one per GPU, started by torch.distributed.run "
    "(run.batch is per rank). Also works under torchrun.")]
EpOpt = Annotated[int, typer.Option(
    "--ep", help="Expert-parallel degree: each of E ranks owns num_experts/E experts; E divides "
    "the world size and the number of experts.")]


def _fail(message: str, code: int) -> None:
    """One line for the user; inside a launched rank, handed to the launcher instead."""
    from .dist.launch import report_error, worker_env

    if worker_env() is not None:
        report_error(message, code)
    else:
        render.error(message)


def command(fn):
    """Turn library errors into one line on stderr and the error's exit code."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except MoegraphError as e:
            if os.environ.get("MOEGRAPH_DEBUG") == "1":
                raise
            _fail(str(e), e.exit_code)
            raise typer.Exit(e.exit_code) from None
        except Exception as e:  # noqa: BLE001 - the CLI promises no raw tracebacks
            if os.environ.get("MOEGRAPH_DEBUG") == "1":
                raise
            _fail(f"internal error: {type(e).__name__}: {e} (MOEGRAPH_DEBUG=1 shows more)",
                  EXIT_ERROR)
            raise typer.Exit(EXIT_ERROR) from None
    return wrapper


def _distribute(spec, nproc: Optional[int], ep: int) -> None:
    """In the launching process: check --nproc/--ep against the model, then start the ranks
    (this process waits and exits with the job's code). Inside a rank: nothing."""
    from .dist.launch import maybe_launch, worker_env
    from .dist.runtime import check_parallelism

    if worker_env() is None:
        if nproc is not None and nproc < 1:
            raise UsageError(f"--nproc must be at least 1, got {nproc}")
        if ep != 1 and (nproc or 1) == 1:
            raise UsageError(f"--ep {ep} needs several processes: add --nproc N (or start the "
                             "command with torchrun)")
        check_parallelism(nproc or 1, ep, spec.profile.model.num_experts)
    code = maybe_launch(sys.argv[1:], nproc)
    if code is not None:
        raise typer.Exit(code)


def _overrides(sets: Optional[list[str]], scopes: Optional[str] = None,
               pool: Optional[str] = None) -> list[str]:
    out = list(sets or [])
    if scopes is not None:
        out.append(f"run.scopes={scopes}")
    if pool is not None:
        out.append(f"run.pool={pool}")
    return out


@app.command()
@command
def init(
    profile: Annotated[str, typer.Argument(help="Profile to instantiate, e.g. tiny-qwen3-moe.")],
    directory: Annotated[str, typer.Argument(help="Output directory for the checkpoint.")],
    seed: Annotated[Optional[int], typer.Option(help="Weight seed (default: the profile's).")] = None,
    max_shard_size: Annotated[str, typer.Option(
        help="Shard above this size, e.g. 5GiB.")] = "5GiB",
    force: Annotated[bool, typer.Option(help="Write into a non-empty directory.")] = False,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Write a Hugging Face-format checkpoint (config.json + safetensors) of seeded weights."""
    from .create import create_checkpoint
    from .runspec import resolve
    from .units import parse_bytes

    spec = resolve(profile=profile, overrides=_overrides(set_))
    result = create_checkpoint(spec, directory, seed=seed, force=force,
                               max_shard_bytes=parse_bytes(max_shard_size, "--max-shard-size"))
    render.init_result(result, json_out)


@app.command()
@command
def inspect(
    checkpoint: Annotated[Optional[str], typer.Argument(
        help="Checkpoint directory (omit to inspect a profile).")] = None,
    profile: ProfileOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Architecture, parameter counts, per-layer shapes and static memory."""
    from .runspec import resolve
    from .summary import summarize

    spec = resolve(profile=profile, checkpoint=checkpoint, overrides=_overrides(set_))
    if spec.checkpoint is not None:
        from .checkpoint import plan_load
        plan_load(spec.checkpoint, spec.profile.model)  # headers checked, nothing large read
    render.inspect_result(summarize(spec.profile, spec.source), json_out)


@app.command()
@command
def plan(
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    scopes: ScopesOpt = None,
    budget: Annotated[str, typer.Option(
        help="Memory budget: bytes (80GiB) or auto (a fraction of the device).")] = "auto",
    pool: Annotated[str, typer.Option(
        help="Pool grouping: auto, shared, per_scope or per_entry.")] = "auto",
    out: Annotated[Optional[str], typer.Option(help="Write the plan YAML here.")] = None,
    savings: Annotated[Optional[str], typer.Option(
        help="Per-scope savings file written by `moegraph profile`.")] = None,
    calibration: Annotated[Optional[str], typer.Option(
        help="Pool-size calibration file (from `moegraph profile --calibrate`).")] = None,
    nproc: Annotated[Optional[int], typer.Option(
        "--nproc", help="Plan one rank of a run on N processes (run.batch is per rank; the "
        "budget is one GPU's). Nothing is launched.")] = None,
    ep: Annotated[int, typer.Option(
        "--ep", help="Expert-parallel degree of that run: each rank holds num_experts/E "
        "experts; E divides N and the number of experts.")] = 1,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Choose, per layer, which scopes to capture and which graphs share a pool, under a budget."""
    from .plan.planner import plan_command
    from .runspec import resolve

    spec = resolve(profile, checkpoint, _overrides(set_, scopes))
    result = plan_command(spec, budget=budget, pool=pool, out=out, savings=savings,
                          calibration=calibration, nproc=nproc, ep=ep)
    render.plan_result(result, json_out)


@app.command()
@command
def capture(
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    scopes: ScopesOpt = None,
    pool: PoolOpt = None,
    steps: Annotated[Optional[int], typer.Option(help="Timed steps, eager and graph each.")] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Eager warm-up steps.")] = None,
    plan_file: Annotated[Optional[str], typer.Option(
        "--plan", help="Follow a plan YAML written by `moegraph plan`.")] = None,
    memory_limit: Annotated[Optional[str], typer.Option(
        help="Cap each process's GPU memory, e.g. 80GiB, to emulate a smaller GPU.")] = None,
    nproc: NprocOpt = None,
    ep: EpOpt = 1,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Eager warm-up, capture attn/moe fwd+bwd graphs, replay; eager vs graph table."""
    from .capture import capture_command
    from .dist.context import command_runtime
    from .runspec import resolve

    spec = resolve(profile, checkpoint, _overrides(set_, scopes, pool))
    _distribute(spec, nproc, ep)
    with command_runtime(spec, ep) as rt:
        result = capture_command(spec, steps=steps, warmup=warmup, plan_file=plan_file,
                                 memory_limit=memory_limit, progress=not json_out, rt=rt)
    if result is not None:
        render.capture_result(result, json_out)


@app.command()
@command
def profile(
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    scopes: ScopesOpt = None,
    steps: Annotated[int, typer.Option(help="Timed steps per mode.")] = 5,
    plot: Annotated[Optional[str], typer.Option(help="Write a PNG plot here.")] = None,
    out: Annotated[Optional[str], typer.Option(
        help="Write the per-scope savings file (read by `moegraph plan`) here.")] = None,
    calibrate: Annotated[Optional[str], typer.Option(
        help="Also capture one layer per scope and write pool sizes to this calibration file.")] = None,
    nproc: NprocOpt = None,
    ep: EpOpt = 1,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Per-scope eager vs replay ms, kernels per step, MFU and an NVML memory timeline."""
    from .dist.context import command_runtime
    from .profile import profile_command
    from .runspec import resolve

    spec = resolve(profile, checkpoint, _overrides(set_, scopes))
    _distribute(spec, nproc, ep)
    with command_runtime(spec, ep) as rt:
        result = profile_command(spec, steps=steps, plot=plot, out=out, calibrate=calibrate,
                                 progress=not json_out, rt=rt)
    if result is not None:
        render.profile_result(result, json_out)


@app.command()
@command
def verify(
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    lr0: Annotated[bool, typer.Option(
        "--lr0/--no-lr0", help="lr = 0: per-step losses must be bitwise equal.")] = True,
    steps: Annotated[int, typer.Option(help="Steps to compare.")] = 6,
    scopes: ScopesOpt = None,
    pool: PoolOpt = None,
    tolerance: Annotated[float, typer.Option(
        help="Relative loss tolerance when lr > 0.")] = 2e-2,
    reference: Annotated[Optional[str], typer.Option(
        help="Also check against `transformers` (logits; needs it installed) or `single` "
        "(with --nproc: the same global batches in one process, per-step losses).")] = None,
    nproc: NprocOpt = None,
    ep: EpOpt = 1,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Same batches, eager vs graph: losses bitwise equal at lr 0; gradients compared."""
    from .dist.context import command_runtime
    from .runspec import resolve
    from .verify import verify_command

    spec = resolve(profile, checkpoint, _overrides(set_, scopes, pool))
    _distribute(spec, nproc, ep)
    with command_runtime(spec, ep) as rt:
        result = verify_command(spec, lr0=lr0, steps=steps, tolerance=tolerance,
                                reference=reference, progress=not json_out, rt=rt)
    if result is None:
        return
    render.verify_result(result, json_out)
    if not result["passed"]:
        if rt is not None:
            _fail(f"verify failed: {result['verdict']}", EXIT_PARITY)
        raise typer.Exit(EXIT_PARITY)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
