"""The `moegraph` command line: parse arguments, call one library function, render.

Exit codes: 0 ok, 1 error, 2 usage, 3 parity failure, 4 no CUDA / not capturable; 128 + N
for a command ended by signal N (Ctrl-C, SIGTERM, SIGHUP).
Errors print one line on stderr, the argument parser's too; MOEGRAPH_DEBUG=1 shows the
traceback instead. Nothing here imports torch: commands import what they need when they run,
so `inspect` and `plan` start without it.

This file holds the app, its error handling and the list of commands; the commands
themselves are in commands/cli_setup.py (init, inspect, plan) and commands/cli_run.py
(capture, profile, verify), their shared options in commands/cli_options.py.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from typing import Annotated

import typer
from moegraph_kernels.env import KernelEnvError
from typer.core import TyperGroup

from .report import render
from .report.stdout import check_stdout, stdout
from .commands import cli_run, cli_setup
from .commands.cli_options import fail
from .commands.cli_signals import signals_interrupt
from .errors import EXIT_ERROR, EXIT_USAGE, MoegraphError, os_error
from .io.outputs import removed_on_interrupt

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


def command(fn):
    """Turn library errors into one line on stderr and the error's exit code.

    An OSError no check caught first (a path too long, a read-only file system, a full disk)
    is one line naming its path (errors.os_error); stdout closed, full or a broken pipe is
    one line too (report/stdout.py), and a closed stdout is refused before any work. Ctrl-C,
    SIGTERM and SIGHUP (commands/cli_signals.py) are one line and 128 + the signal's number,
    once the command's cleanup has run: an interrupted command leaves none of the output files
    it created (io/outputs.py `removed_on_interrupt`)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with signals_interrupt(), removed_on_interrupt():
                check_stdout()
                result = fn(*args, **kwargs)
                stdout.flush()  # a full stdout fails here, not at exit
            return result
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except KeyboardInterrupt as e:  # Ctrl-C, or errors.Interrupted
            if os.environ.get("MOEGRAPH_DEBUG") == "1":
                raise
            signum = getattr(e, "signum", signal.SIGINT)
            fail(f"interrupted by {signal.Signals(signum).name}", 128 + signum)
            raise typer.Exit(128 + signum) from None
        except MoegraphError as e:
            if os.environ.get("MOEGRAPH_DEBUG") == "1":
                raise
            fail(str(e), e.exit_code)
            raise typer.Exit(e.exit_code) from None
        except KernelEnvError as e:  # a MOEGRAPH_* tile variable, read when a kernel loads
            if os.environ.get("MOEGRAPH_DEBUG") == "1":
                raise
            fail(str(e), EXIT_USAGE)
            raise typer.Exit(EXIT_USAGE) from None
        except OSError as e:
            if os.environ.get("MOEGRAPH_DEBUG") == "1":
                raise
            error = os_error(e)
            fail(str(error), error.exit_code)
            raise typer.Exit(error.exit_code) from None
        except Exception as e:  # noqa: BLE001 - the CLI promises no raw tracebacks
            if os.environ.get("MOEGRAPH_DEBUG") == "1":
                raise
            fail(f"internal error: {type(e).__name__}: {e} (MOEGRAPH_DEBUG=1 shows more)",
                 EXIT_ERROR)
            raise typer.Exit(EXIT_ERROR) from None
    return wrapper


# The commands, in the order `moegraph --help` lists them.
app.command()(command(cli_setup.init))
app.command(epilog=cli_setup.profile_table())(command(cli_setup.inspect))
app.command()(command(cli_setup.plan))
app.command()(command(cli_run.capture))
app.command()(command(cli_run.profile))
app.command()(command(cli_run.verify))


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
