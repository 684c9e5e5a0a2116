"""Where the commands' output goes: stdout as it is when written to (a test runner swaps it).

A stdout that is closed (`>&-`), full (`> /dev/full`) or a pipe whose reader left (`| head -1`)
is one `OutputError` (exit 1) naming stdout and why, instead of a traceback; what is still
buffered for it is then dropped, so Python's flush at exit prints nothing more. A command
whose stdout is closed is refused before it starts (`check_stdout`).
"""

from __future__ import annotations

import os
import sys

from ..errors import MoegraphError


class OutputError(MoegraphError):
    """stdout cannot take the command's output."""


def _drop_stdout() -> None:
    """Point fd 1 at /dev/null: Python's flush of stdout at exit then succeeds silently."""
    try:
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (AttributeError, OSError, ValueError):
        pass


class _Stdout:
    """A file for rich and json: writes and flushes reach sys.stdout, failures come back as
    one OutputError."""

    def _stream(self):
        if sys.stdout is None:  # started with stdout closed (`>&-`)
            raise OutputError("stdout is closed; moegraph writes its results there (redirect "
                              "it to a file, or to /dev/null to drop them)")
        return sys.stdout

    def _failed(self, e: OSError) -> OutputError:
        _drop_stdout()
        if isinstance(e, BrokenPipeError):
            why = "the pipe was closed by its reader"
        else:
            why = e.strerror or type(e).__name__
        return OutputError(f"cannot write the output to stdout: {why}")

    def write(self, text: str) -> int:
        stream = self._stream()
        try:
            return stream.write(text)
        except OSError as e:
            raise self._failed(e) from None

    def flush(self) -> None:
        stream = self._stream()
        try:
            stream.flush()
        except OSError as e:
            raise self._failed(e) from None

    def isatty(self) -> bool:
        try:
            return bool(sys.stdout is not None and sys.stdout.isatty())
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self._stream().fileno()

    @property
    def encoding(self) -> str:
        return getattr(sys.stdout, "encoding", None) or "utf-8"


stdout = _Stdout()


def check_stdout() -> None:
    """Refuse to start a command whose output has nowhere to go (stdout closed)."""
    stdout._stream()
