"""The `moegraph` command line: parse arguments, call one library function, render.

Exit codes: 0 ok, 1 error, 2 usage, 3 parity failure, 4 no CUDA / not capturable.
Errors print one line on stderr, the argument parser's too; MOEGRAPH_DEBUG=1 shows the
traceback instead. Nothing here imports torch: commands import what they need when they run,
so `inspect` and `plan` start without it.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Annotated, Optional

import typer
from moegraph_kernels.env import KernelEnvError
from typer.core import TyperGroup

from .report import render
from .config import DEFAULT_PROFILE, profile_names
from .errors import EXIT_ERROR, EXIT_PARITY, EXIT_USAGE, MoegraphError, UsageError
from .units import SIZE_CONVENTION

try:  # typer >= 0.20 carries its own copy of click
    from typer._click.exceptions import ClickException, UsageError as ClickUsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException, UsageError as ClickUsageError


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class MoegraphGroup(TyperGroup):
    """The command group with click's own error rendering replaced: a usage error (unknown
    command or option, missing argument, bad value) is one line and exit 2, no box; what a
    test runner invokes (the app object) behaves exactly as the installed `moegraph`."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        prog_name = prog_name or "moegraph"
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickUsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `moegraph`: the help, exit 0
                render.out.print(e.format_message(), markup=False, highlight=False)
                sys.exit(0)
            message = _one_line(e.format_message()).removesuffix(".")
            message = message[:1].lower() + message[1:]
            where = e.ctx.command_path if e.ctx is not None else prog_name
            render.error(f"{message} (see {where} --help)")
            sys.exit(EXIT_USAGE)
        except ClickException as e:
            render.error(_one_line(e.format_message()))
            sys.exit(e.exit_code)
        except typer.Abort:
            render.error("aborted")
            sys.exit(EXIT_ERROR)
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


app = typer.Typer(
    name="moegraph", cls=MoegraphGroup, no_args_is_help=True, add_completion=False,
    pretty_exceptions_enable=False, rich_markup_mode=None,
    help="Plan, capture and verify CUDA-graph training of Mixture-of-Experts transformers.")


def _profile_list() -> str:
    names = profile_names()
    return ", ".join(f"{n} (default)" if n == DEFAULT_PROFILE else n for n in names)


def _profile_table() -> str:
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
NprocOpt = Annotated[Optional[int], typer.Option(
    "--nproc", metavar="N",
    help="Run on N local processes, one per GPU, started by torch.distributed.run (run.batch "
    "is per rank). Also works under torchrun.")]
EpOpt = Annotated[int, typer.Option(
    "--ep", metavar="E",
    help="Expert-parallel degree: each of E ranks owns num_experts/E experts; E divides the "
    "world size and the number of experts.")]


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moegraph")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def _print_version(value: bool) -> None:
    if value:
        render.out.print(f"moegraph {_package_version()}", markup=False)
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print the version and exit.")] = False) -> None:
    """Plan, capture and verify CUDA-graph training of Mixture-of-Experts transformers."""


def _fail(message: str, code: int) -> None:
    """One line for the user; inside a launched rank, handed to the launcher instead."""
    from .distributed.launch import report_error, worker_env

    if worker_env() is not None:
        report_error(message, code)
    else:
        render.error(message)


def _warn(message: str) -> None:
    """One warning line on stderr, printed once per job (not again by each launched rank)."""
    from .distributed.launch import launched_by_moegraph, worker_env

    env = worker_env()
    if env is None or (env.rank == 0 and not launched_by_moegraph()):
        render.warning(message)


def _resolve(profile: Optional[str], checkpoint: Optional[str], overrides: list[str]):
    """runspec.resolve, with its warnings (a profile that disagrees with the checkpoint's
    config.json) on stderr."""
    from .train.runspec import resolve

    spec = resolve(profile, checkpoint, overrides)
    for message in spec.warnings:
        _warn(message)
    return spec


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
        except KernelEnvError as e:  # a MOEGRAPH_* tile variable, read when a kernel loads
            if os.environ.get("MOEGRAPH_DEBUG") == "1":
                raise
            _fail(str(e), EXIT_USAGE)
            raise typer.Exit(EXIT_USAGE) from None
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
    from .distributed.launch import maybe_launch, worker_env
    from .distributed.layout import check_parallelism

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
    profile: Annotated[str, typer.Argument(
        metavar="PROFILE", help=f"Profile to instantiate: {PROFILES}; or a YAML path.")],
    directory: Annotated[str, typer.Argument(
        metavar="DIR", help="Output directory for the checkpoint (created; its parent must "
        "exist unless --mkdir).")],
    seed: Annotated[Optional[int], typer.Option(
        metavar="N", help="Weight seed (default: the profile's).")] = None,
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
    from .commands.create import create_checkpoint
    from .units import parse_bytes

    max_shard_bytes = parse_bytes(max_shard_size, "--max-shard-size")
    spec = _resolve(profile, None, _overrides(set_))
    result = create_checkpoint(spec, directory, seed=seed, force=force, mkdir=mkdir,
                               max_shard_bytes=max_shard_bytes, progress=not json_out)
    render.init_result(result, json_out)


@app.command(epilog=_profile_table())
@command
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
    from .report.summary import summarize

    if checkpoint_dir and checkpoint and checkpoint_dir != checkpoint:
        raise UsageError(f"give the checkpoint once: DIR {checkpoint_dir} and --checkpoint "
                         f"{checkpoint} differ")
    spec = _resolve(profile, checkpoint or checkpoint_dir, _overrides(set_))
    if spec.checkpoint is not None:
        from .io.checkpoint import plan_load
        plan_load(spec.checkpoint, spec.profile.model)  # headers checked, nothing large read
    render.inspect_result(summarize(spec.profile, spec.source), json_out)


@app.command()
@command
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
        help="Plan one rank of a run on N processes (run.batch is per rank; the budget is one "
        "GPU's). Nothing is launched.")] = None,
    ep: Annotated[int, typer.Option(
        "--ep", metavar="E",
        help="Expert-parallel degree of that run: each rank holds num_experts/E experts; E "
        "divides N and the number of experts.")] = 1,
    mkdir: MkdirOpt = False,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Choose, per layer, which scopes to capture and which graphs share a pool, under a budget."""
    from .io.outputs import check_output_file
    from .plan.planner import plan_command

    check_output_file(out, "--out", mkdir)
    spec = _resolve(profile, checkpoint, _overrides(set_, scopes))
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
    steps: Annotated[Optional[int], typer.Option(
        metavar="N", help="Timed steps, eager and graph each.")] = None,
    warmup: Annotated[Optional[int], typer.Option(metavar="N", help="Eager warm-up steps.")] = None,
    plan_file: Annotated[Optional[str], typer.Option(
        "--plan", metavar="FILE", help="Follow a plan YAML written by `moegraph plan`.")] = None,
    memory_limit: Annotated[Optional[str], typer.Option(
        metavar="SIZE",
        help=f"Cap each process's GPU memory, e.g. 80GiB ({SIZE_CONVENTION}), to emulate a "
        "smaller GPU.")] = None,
    nproc: NprocOpt = None,
    ep: EpOpt = 1,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Eager warm-up, capture attn/moe fwd+bwd graphs, replay; eager vs graph table."""
    from .commands.capture import capture_command
    from .distributed.context import command_runtime

    spec = _resolve(profile, checkpoint, _overrides(set_, scopes, pool))
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
    steps: Annotated[int, typer.Option(metavar="N", help="Timed steps per mode.")] = 5,
    plot: Annotated[Optional[str], typer.Option(
        metavar="FILE", help="Write a PNG plot here.")] = None,
    out: Annotated[Optional[str], typer.Option(
        metavar="FILE",
        help="Write the per-scope savings file (read by `moegraph plan`) here.")] = None,
    calibrate: Annotated[Optional[str], typer.Option(
        metavar="FILE", help="Also capture one layer per scope and write pool sizes to this "
        "calibration file.")] = None,
    nproc: NprocOpt = None,
    ep: EpOpt = 1,
    mkdir: MkdirOpt = False,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Per-scope eager vs replay ms, kernels per step, MFU and an NVML memory timeline."""
    from .distributed.context import command_runtime
    from .io.outputs import check_output_file
    from .commands.profile import profile_command

    for flag, path in (("--out", out), ("--plot", plot), ("--calibrate", calibrate)):
        check_output_file(path, flag, mkdir)
    spec = _resolve(profile, checkpoint, _overrides(set_, scopes))
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
    steps: Annotated[int, typer.Option(metavar="N", help="Steps to compare.")] = 6,
    scopes: ScopesOpt = None,
    pool: PoolOpt = None,
    tolerance: Annotated[float, typer.Option(
        metavar="X", help="Relative loss tolerance when lr > 0.")] = 2e-2,
    reference: Annotated[Optional[str], typer.Option(
        metavar="transformers|single",
        help="Also check against `transformers` (logits; needs it installed) or `single` (with "
        "--nproc: the same global batches in one process, per-step losses).")] = None,
    nproc: NprocOpt = None,
    ep: EpOpt = 1,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
):
    """Same batches, eager vs graph: losses bitwise equal at lr 0; gradients compared."""
    from .distributed.context import command_runtime
    from .commands.verify import verify_command

    spec = _resolve(profile, checkpoint, _overrides(set_, scopes, pool))
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
