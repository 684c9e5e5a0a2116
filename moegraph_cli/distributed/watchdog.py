"""End a rank that stops making progress, because a captured collective never times out.

NCCL's own timeout covers eager collectives only: work replayed from a CUDA graph waits
forever when a peer is gone, and the host thread waits with it inside C. A daemon thread that
sees no heartbeat for `timeout_s` reports the phase it was stuck in (`report_error`, so the
launcher can name it) and hard-exits the process: `os._exit`, since the stuck main thread
would never run Python cleanup. The launcher then stops the other ranks.

    with Watchdog() as wd:
        for step in range(steps):
            wd.phase(f"step {step} replay")   # a heartbeat that also names where we are
            ...
"""

from __future__ import annotations

import os
import threading
import time

from .launch import collective_timeout_s, report_error, worker_env


class Watchdog:
    """A heartbeat deadline, checked by a daemon thread while the context is open."""

    def __init__(self, timeout_s: float | None = None, rank: int | None = None):
        self.timeout_s = float(timeout_s) if timeout_s is not None else collective_timeout_s()
        if not self.timeout_s > 0:
            raise ValueError(f"Watchdog timeout must be positive, got {timeout_s}")
        if rank is None:
            env = worker_env()
            rank = env.rank if env is not None else 0
        self.rank = rank
        self._phase = "start-up"
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def phase(self, name: str) -> None:
        """Name what the rank is doing now; counts as a heartbeat."""
        self._phase = name
        self.beat()

    def beat(self) -> None:
        """Progress was made: restart the deadline."""
        self._last_beat = time.monotonic()

    def __enter__(self) -> Watchdog:
        self.beat()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="moegraph-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return False

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(period):
            if time.monotonic() - self._last_beat > self.timeout_s:
                self._expire()

    def _expire(self) -> None:
        try:
            report_error(f"no progress for {self.timeout_s:g} s during {self._phase}: a "
                         "collective did not complete (another rank failed or hung)", 1,
                         rank=self.rank)
        finally:
            os._exit(1)
