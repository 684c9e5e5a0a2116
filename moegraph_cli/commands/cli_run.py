"""The commands that run training steps: `capture` (eager vs graph timings), `profile`
(per-scope savings, MFU, memory timeline) and `verify` (eager vs graph parity). Each may start
ranks (--nproc, --ep) and runs inside the job's runtime. app.py registers them; each imports
torch only when it runs."""

from __future__ import annotations

import warnings
from typing import Annotated, Optional

import typer

from ..report import render
from ..errors import EXIT_PARITY
from ..units import SIZE_CONVENTION
from .cli_options import (CheckpointOpt, EpOpt, JsonOpt, MkdirOpt, NprocOpt, PoolOpt,
                          ProfileOpt, ScopesOpt, SetOpt, check_options, collect_overrides,
                          distribute, fail, resolve_spec)


# What torch prints during a GPU run that says nothing about the user's run: a command's
# stderr holds its own messages only. Each filter is one message, from the module it comes
# from (a Python frame of torch's, or moegraph's own linear that called into cuBLAS).
TORCH_NOISE = (
    # cuBLAS first used in autograd's device thread, which has no current CUDA context: torch
    # makes the primary context current itself and goes on (CublasHandlePool.cpp).
    (r"Attempting to run cuBLAS, but there was no current CUDA context",
     r"(torch|moegraph_cli)\."),
    # capture_end of a graph that recorded no kernel: the session's own checks and counters
    # (fallback, replayed, parity in verify) say whether capture worked.
    (r"The CUDA Graph is empty", r"torch\.cuda\.graphs"),
    # torch.profiler's note on cycles (a schedule's), shown by some releases on every use.
    (r"Warning: Profiler clears events at the end of each cycle", r"torch\.profiler"),
)


def quiet_torch() -> None:
    """Filter TORCH_NOISE (and nothing else) for the rest of this process."""
    for message, module in TORCH_NOISE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning,
                                module=module)


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
    from .capture import capture_command
    from ..distributed.context import command_runtime

    quiet_torch()
    check_options(steps=steps, warmup=warmup)
    spec = resolve_spec(profile, checkpoint, collect_overrides(set_, scopes, pool))
    distribute(spec, nproc, ep)
    with command_runtime(spec, ep) as rt:
        result = capture_command(spec, steps=steps, warmup=warmup, plan_file=plan_file,
                                 memory_limit=memory_limit, progress=not json_out, rt=rt)
    if result is not None:
        render.capture_result(result, json_out)


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
    from ..distributed.context import command_runtime
    from ..io.outputs import check_output_file
    from .profile import profile_command

    quiet_torch()
    check_options(steps=steps)
    for flag, path in (("--out", out), ("--plot", plot), ("--calibrate", calibrate)):
        check_output_file(path, flag, mkdir)
    spec = resolve_spec(profile, checkpoint, collect_overrides(set_, scopes))
    distribute(spec, nproc, ep)
    with command_runtime(spec, ep) as rt:
        result = profile_command(spec, steps=steps, plot=plot, out=out, calibrate=calibrate,
                                 progress=not json_out, rt=rt)
    if result is not None:
        render.profile_result(result, json_out)


def verify(
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    lr0: Annotated[bool, typer.Option(
        "--lr0/--no-lr0", help="lr = 0: per-step losses must be bitwise equal.")] = True,
    steps: Annotated[int, typer.Option(metavar="N", help="Steps to compare.")] = 6,
    scopes: ScopesOpt = None,
    pool: PoolOpt = None,
    tolerance: Annotated[float, typer.Option(
        metavar="X", help="Relative loss tolerance when lr > 0 (a finite number >= 0).")
        ] = 2e-2,
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
    from ..distributed.context import command_runtime
    from .verify import verify_command

    quiet_torch()
    check_options(steps=steps, tolerance=tolerance)
    spec = resolve_spec(profile, checkpoint, collect_overrides(set_, scopes, pool))
    distribute(spec, nproc, ep)
    with command_runtime(spec, ep) as rt:
        result = verify_command(spec, lr0=lr0, steps=steps, tolerance=tolerance,
                                reference=reference, progress=not json_out, rt=rt)
    if result is None:
        return
    render.verify_result(result, json_out)
    if not result["passed"]:
        if rt is not None:
            fail(f"verify failed: {result['verdict']}", EXIT_PARITY)
        raise typer.Exit(EXIT_PARITY)
