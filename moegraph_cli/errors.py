"""The user-facing error type and the CLI's stable exit codes.

Every error a user can cause is a `MoegraphError` whose message is one sentence naming the
thing at fault. The CLI prints that sentence and exits with the error's code; only
MOEGRAPH_DEBUG=1 shows a traceback.
"""

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


class UsageError(MoegraphError):
    exit_code = EXIT_USAGE


class CheckpointError(MoegraphError):
    exit_code = EXIT_ERROR


class ParityError(MoegraphError):
    exit_code = EXIT_PARITY


class NotCapturableError(MoegraphError):
    exit_code = EXIT_NOT_CAPTURABLE
