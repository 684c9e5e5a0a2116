"""Termination signals while a command runs: raised as `errors.Interrupted`, so cleanup runs.

Python turns SIGINT into KeyboardInterrupt, which the writers' cleanup already handles (the
temporary file of io/outputs.py `write_atomically`, the outputs a failed command created, the
files and directories of `init`); SIGTERM (kill, a job scheduler) and SIGHUP (a closed
terminal) would end the process on the spot, leaving a hidden temporary file behind. Inside
`signals_interrupt()` all three raise `Interrupted` (a KeyboardInterrupt) in the main thread;
app.py then prints one line and exits 128 + the signal's number.

A second signal while the first one unwinds ends the process at once, by that signal's
default action (press Ctrl-C twice to force an exit). Nothing is installed:
- for a signal the process was started ignoring (nohup's SIGHUP, a background job's SIGINT):
  it stays ignored;
- off the main thread, where Python lets no handler be set;
- in a rank of a launched job (`--nproc`, torchrun): the launcher ends the other ranks with
  SIGTERM once one failed and names a rank by the signal that ended it
  (distributed/launch.py), and a rank waiting inside a collective never gets back to Python
  to run a handler, so a rank dies of SIGTERM as before. (The launching process itself is
  covered: torch's launcher swaps in handlers of its own while the ranks run, and
  distributed/launch.py puts these back.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from ..errors import Interrupted

_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@contextlib.contextmanager
def signals_interrupt():
    """While the block runs, SIGINT, SIGTERM and SIGHUP raise `Interrupted`; see the module
    docstring for when they do not. The previous handlers are restored on the way out."""
    from ..distributed.launch import worker_env

    if threading.current_thread() is not threading.main_thread() or worker_env() is not None:
        yield
        return
    received: list[int] = []

    def interrupt(signum, frame):
        if received:  # a second one: no more waiting for cleanup
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        received.append(signum)
        raise Interrupted(signum)

    saved = {}
    for name in _SIGNALS:
        number = getattr(signal, name, None)
        if number is None:
            continue
        previous = signal.getsignal(number)
        if previous in (signal.SIG_IGN, None):  # ignored, or set outside Python: left so
            continue
        saved[number] = previous
        signal.signal(number, interrupt)
    try:
        yield
    finally:
        for number, previous in saved.items():
            signal.signal(number, previous)
