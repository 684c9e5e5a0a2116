"""The user-facing error type and the CLI's stable exit codes.

Every error a user can cause is a `MoegraphError` whose message is one sentence naming the
thing at fault. The CLI prints that sentence and exits with the error's code; only
MOEGRAPH_DEBUG=1 shows a traceback. An operating system's error that no check caught first
(`os_error`) is one line too, naming its path: usage (2) where the path is at fault (too long,
missing, not writable, on a read-only file system), else a runtime error (1: a full disk, an
I/O error).

A termination signal (SIGINT, SIGTERM, SIGHUP) while a command runs is an `Interrupted`
(commands/cli_signals.py): the command's cleanup runs, then the CLI prints one line and exits
128 + the signal's number, the shell's convention (130 for Ctrl-C).
"""

import errno
import signal

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PARITY = 3
EXIT_NOT_CAPTURABLE = 4


def one_line(text) -> str:
    """`text` with every run of whitespace (newlines included) as one space: a message the
    CLI prints is always a single line."""
    return " ".join(str(text).split())


class MoegraphError(Exception):
    """An error with a one-line message and the exit code the CLI should return."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class Interrupted(KeyboardInterrupt):
    """A termination signal raised in the main thread as an exception, so that every cleanup
    Ctrl-C takes (`finally`, `except BaseException`, `except KeyboardInterrupt`) runs for
    SIGTERM and SIGHUP too."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class UsageError(MoegraphError):
    exit_code = EXIT_USAGE


class CheckpointError(MoegraphError):
    exit_code = EXIT_ERROR


class ParityError(MoegraphError):
    exit_code = EXIT_PARITY


class NotCapturableError(MoegraphError):
    exit_code = EXIT_NOT_CAPTURABLE


# The OS errors that say the path given is wrong (another path would do): exit 2.
_PATH_ERRNOS = {errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP,
                errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENXIO,
                errno.ENODEV, errno.ETXTBSY}
_SHOW_PATH = 160


def show_path(path) -> str:
    """A path for a message: whole, or its start and end around "..." when very long."""
    text = str(path)
    return text if len(text) <= _SHOW_PATH else f"{text[:100]}...{text[-50:]}"


def os_error(e: OSError) -> MoegraphError:
    """`e` as one line naming the path it is about (`path: File name too long`) with the
    exit code of the problem: 2 for a path at fault, 1 for everything else."""
    reason = e.strerror or type(e).__name__
    where = ""
    if e.filename is not None:
        where = show_path(e.filename)
        if getattr(e, "filename2", None) is not None:
            where += f" -> {show_path(e.filename2)}"
        where += ": "
    code = EXIT_USAGE if e.errno in _PATH_ERRNOS and e.filename is not None else EXIT_ERROR
    return MoegraphError(one_line(f"{where}{reason}"), code)
