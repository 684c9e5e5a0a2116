"""Start N local ranks of a moegraph command; report the first rank's failure in one line.

The ranks are started by torch's own elastic launcher, used as a library (the code behind
`torchrun`): it does the rendezvous, gives each rank RANK / WORLD_SIZE / LOCAL_RANK exactly as
`torchrun` would, and stops every other rank as soon as one exits non-zero, so no rank is
left waiting on a peer that is gone. Nothing here spawns processes or rendezvouses itself.

The launcher and its ranks share three environment variables:
  MOEGRAPH_LAUNCHED=1             the rank was started by `launch`, not by a bare torchrun
  MOEGRAPH_ERROR_DIR              where a failing rank writes rank{R}.json (`report_error`)
  MOEGRAPH_COLLECTIVE_TIMEOUT_S   how long a collective may take (the Watchdog's default)
When a run fails, several ranks usually report: the first one is the cause and the rest
failed because of it (a peer vanished, a collective broke), so `launch` prints the report
with the earliest time and returns that rank's exit code. A rank killed by a signal (kill -9,
the OOM killer) reports nothing; its peers report a closed connection. Then the killed rank is
named, with its signal, and not its peers' symptom.

Only rank 0's stdout/stderr reach the terminal, so one process renders the tables, progress
and JSON. The other ranks write to log files in the launch's temp dir, which is removed at
the end. MOEGRAPH_DEBUG=1 lets every rank print and keeps torch elastic's own log lines.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from ..config.fields import check_option
from ..errors import EXIT_ERROR, UsageError, one_line

ENV_LAUNCHED = "MOEGRAPH_LAUNCHED"
ENV_ERROR_DIR = "MOEGRAPH_ERROR_DIR"
ENV_COLLECTIVE_TIMEOUT = "MOEGRAPH_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
EXIT_INTERRUPTED = 130
_STD_ALL = 3  # torch elastic's Std.ALL: redirect both stdout and stderr to a file

# ---------------------------------------------------------------------------- in the ranks


@dataclass(frozen=True)
class WorkerEnv:
    """Where this process sits in the launched job (set by torchrun or by `launch`)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def worker_env() -> WorkerEnv | None:
    """This rank's place in the job, or None when not started by a torch elastic launcher."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        return None
    world_size = int(env["WORLD_SIZE"])
    return WorkerEnv(rank=int(env.get("RANK", "0")), world_size=world_size,
                     local_rank=int(env.get("LOCAL_RANK", "0")),
                     local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))))


def launched_by_moegraph() -> bool:
    """True in a rank started by `launch` (its errors go to the launcher, not the terminal)."""
    return os.environ.get(ENV_LAUNCHED) == "1" and worker_env() is not None


def is_rank0() -> bool:
    """True on the rank that renders output: rank 0, or the only process when not launched."""
    env = worker_env()
    return env is None or env.rank == 0


def collective_timeout_s() -> float:
    """Seconds a collective may take before the rank is declared stuck (env, default 600)."""
    raw = os.environ.get(ENV_COLLECTIVE_TIMEOUT)
    if raw is None or raw == "":
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"{ENV_COLLECTIVE_TIMEOUT}={raw!r} is not a positive number of seconds")
    return value


def _one_line(message: str) -> str:
    return one_line(message) or "(no message)"


def report_error(message: str, exit_code: int, *, rank: int | None = None) -> None:
    """Hand this rank's one-line error to whoever reports it.

    Under `launch` the rank writes MOEGRAPH_ERROR_DIR/rank{R}.json and prints nothing: the
    launcher prints one line for the whole job. The first report of a rank is kept, since a
    later one (a watchdog firing after the main thread failed) is a consequence. Under a bare
    torchrun, or not distributed at all, the line goes straight to stderr.
    """
    if rank is None:
        env = worker_env()
        rank = env.rank if env is not None else None
    text = _one_line(message)
    error_dir = os.environ.get(ENV_ERROR_DIR)
    if error_dir and rank is not None:
        path = os.path.join(error_dir, f"rank{rank}.json")
        record = {"rank": rank, "message": text, "exit_code": int(exit_code), "time": time.time()}
        try:
            if not os.path.exists(path):
                fd, tmp = tempfile.mkstemp(dir=error_dir, prefix=f".rank{rank}.", suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f)
                os.replace(tmp, path)  # the launcher never reads a half-written report
            return
        except OSError:
            pass  # the launcher's dir is gone; stderr is the last resort
    prefix = f"rank {rank}: " if rank is not None else ""
    print(f"moegraph: error: {prefix}{text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- in the launcher


def argv_without_nproc(argv: list[str]) -> list[str]:
    """`argv` minus `--nproc N` / `--nproc=N`, which only the launching process acts on."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        if arg == "--nproc":
            i += 2
            continue
        if not arg.startswith("--nproc="):
            out.append(arg)
        i += 1
    return out


def maybe_launch(argv: list[str], nproc: int | None) -> int | None:
    """Run the command on `nproc` local ranks and return the job's exit code.

    `argv` is the command line after the program name (e.g. `["capture", "--nproc", "2"]`).
    Returns None when the caller should just continue in this process: no `--nproc`, one
    process, or this process already is a launched rank.
    """
    if nproc is None or worker_env() is not None:
        return None
    check_option("--nproc", nproc)
    if nproc == 1:
        return None
    import torch

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise UsageError(f"--nproc {nproc}: this machine has {count} CUDA "
                         f"device{'' if count == 1 else 's'}")
    return launch(argv_without_nproc(argv), nproc, timeout_s=collective_timeout_s())


def launch(argv: list[str], nproc: int, *, module: str = "moegraph_cli.app",
           timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> int:
    """Run `python -m <module> *argv` on `nproc` local ranks; 0, or the first failure's code.

    On failure prints exactly one line on stderr, `moegraph: error: rank R: <message>`.
    Ctrl-C stops every rank and returns 130.
    """
    check_option("--nproc", nproc)
    debug = os.environ.get("MOEGRAPH_DEBUG") == "1"
    # Imported here: the ranks import this module too and need none of the launcher.
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    workdir = tempfile.mkdtemp(prefix="moegraph-launch-")
    error_dir = os.path.join(workdir, "errors")
    log_dir = os.path.join(workdir, "logs")  # else torch leaves a /tmp/torchelastic_* per run
    os.mkdir(error_dir)
    redirects = "0" if debug or nproc == 1 else ",".join(
        f"{r}:{_STD_ALL}" for r in range(1, nproc))
    args = torchrun.parse_args([
        "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
        f"--log-dir={log_dir}", f"--redirects={redirects}", "--module", module, *argv])
    env = {ENV_LAUNCHED: "1", ENV_ERROR_DIR: error_dir, ENV_COLLECTIVE_TIMEOUT: f"{timeout_s:g}"}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun would set, without its banner
    try:
        with _environ(env), _restored_signal_handlers(), \
                (contextlib.nullcontext() if debug else _quiet_elastic_logs()):
            try:
                torchrun.run(args)
            except ChildFailedError as failed:
                return _report_failure(failed, error_dir, log_dir)
        return 0
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except SignalException as e:  # torch elastic turns SIGINT/SIGTERM into this
        if e.sigval == signal.SIGINT:
            return EXIT_INTERRUPTED
        _print_error(f"launcher got {e.sigval.name}; every rank was stopped")
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 - the CLI promises no raw tracebacks
        if debug:
            raise
        _print_error(f"launcher: {type(e).__name__}: {_one_line(str(e))}")
        return EXIT_ERROR
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# What a rank reports when a peer vanished under it (its symptom, not the job's cause).
_PEER_LOST = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|"
                        r"remote process exited|communicator was aborted|ncclRemoteError",
                        re.IGNORECASE)


def _report_failure(failed, error_dir: str, log_dir: str) -> int:
    """Print the cause of the failure in one line and return its exit code.

    The cause, in this order: the earliest report that is not a lost peer; else a rank that
    ended without reporting (killed by a signal, or crashed past the CLI's error handling):
    its peers' "connection closed" reports are what its death did to them; else the
    earliest report."""
    reports = _read_reports(error_dir)
    own = [r for r in reports if not _PEER_LOST.search(r["message"])]
    if own:
        first = min(own, key=lambda r: r["time"])
        _print_error(f"rank {first['rank']}: {first['message']}")
        return _exit_code(first["exit_code"])
    reported = {r["rank"] for r in reports}
    silent = [(rank, f) for rank, f in failed.failures.items() if rank not in reported]
    if not silent and reports:
        first = min(reports, key=lambda r: r["time"])
        _print_error(f"rank {first['rank']}: {first['message']}")
        return _exit_code(first["exit_code"])
    if not silent:
        silent = [failed.get_first_failure()]
    # The launcher ends the other ranks with SIGTERM once one failed: those are not the cause.
    rank, failure = min(enumerate(silent), key=lambda i_f: (
        i_f[1][1].exitcode == -signal.SIGTERM, i_f[1][1].timestamp, i_f[0]))[1]
    _print_error(_ended(rank, failure, log_dir))
    return _exit_code(failure.exitcode)


def _ended(rank: int, failure, log_dir: str) -> str:
    """How a rank that did not report ended: its signal or its exit code, and its last
    stderr line where that says more."""
    if failure.exitcode < 0:
        number = -failure.exitcode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        why = "; the kernel's OOM killer sends it too" if number == signal.SIGKILL else ""
        what = (f"rank {rank} was killed by signal {number} ({name}{why}); the other ranks "
                "were stopped")
        if number in (signal.SIGKILL, signal.SIGTERM):
            return what  # it wrote nothing about it: an older stderr line would mislead
    else:
        what = f"rank {rank} exited with code {failure.exitcode}"
    last_line = _last_stderr_line(log_dir, failure.local_rank)
    if last_line:
        what += f"; its last stderr line: {last_line}"
    elif failure.local_rank != 0 and failure.exitcode >= 0:  # rank 0's is on the terminal
        what += " (MOEGRAPH_DEBUG=1 shows every rank's output)"
    return what


def _read_reports(error_dir: str) -> list[dict]:
    reports = []
    for path in glob.glob(os.path.join(error_dir, "rank*.json")):
        try:
            with open(path) as f:
                record = json.load(f)
            reports.append({"rank": int(record["rank"]), "message": str(record["message"]),
                            "exit_code": record.get("exit_code"),
                            "time": float(record["time"])})
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a report we cannot read is no better than none
    return reports


def _last_stderr_line(log_dir: str, local_rank: int) -> str:
    """The last non-empty line a redirected rank wrote to stderr (e.g. an exception)."""
    pattern = os.path.join(log_dir, "*", "attempt_*", str(local_rank), "stderr.log")
    for path in glob.glob(pattern):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 4096))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            if line.strip():  # torch prefixes a rank's traceback lines with "[rankN]: "
                return _one_line(re.sub(r"^\[rank\d+\]:\s*", "", line))[:300]
    return ""


def _exit_code(code) -> int:
    if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 256:
        return code
    return EXIT_ERROR


def _print_error(message: str) -> None:
    print(f"moegraph: error: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set variables for the ranks to inherit, then put this process's environment back."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def _restored_signal_handlers():
    """torch elastic installs SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers and leaves them behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    saved = {sig: signal.getsignal(sig) for sig in
             (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


_ELASTIC_LOGGERS = ("torch.distributed.run", "torch.distributed.launcher",
                    "torch.distributed.elastic")


@contextlib.contextmanager
def _quiet_elastic_logs():
    """Silence torch elastic's loggers while it runs, then restore them.

    CRITICAL, not ERROR: on a rank failure the agent logs an ERROR line of its own ("failed
    (exitcode: 2) local_rank: 1 (pid: ...) of binary: ...") before `launch` prints its one.
    Each of its modules sets its own logger's level at import (`get_logger`), so raising a
    parent logger does nothing; the modules the launch imports lazily (the c10d rendezvous)
    are imported first so that their loggers exist to be raised.
    """
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401
    import torch.distributed.elastic.rendezvous.registry  # noqa: F401

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith(_ELASTIC_LOGGERS)]
    saved = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)
