"""The whole training step as one graph: forward, backward and the optimizer, replayed per step.

`StepGraph(step, warm_up)` captures `step(static_input) -> outputs` (any callable: the trainer's
forward, backward and optimizer update over a batch of token ids) into one graph with its own
memory pool, after `warm_up(static_input)` ran eagerly on a side stream (compiling kernels and
creating library handles without changing training state). Each call then copies the batch
into the static input, replays, and returns fresh copies of the outputs (the static outputs are
overwritten by the next replay).

What makes a step capturable is the caller's job, and the graph only holds it to it: no host
sync anywhere in the step (sync-free routing, the loss on the device, an optimizer whose
learning rate and step count live on the device), gradients written rather than added (so
the warm-up's gradients are simply overwritten), and every persistent buffer (parameters,
flat gradients, optimizer states) allocated before capture. Capture is transactional: on any
failure the graph and its pool are dropped, the reason is kept, and the step runs eagerly.

Contract per call: the batch's shape, dtype and device must equal the captured one, else the
call runs `step` eagerly and counts a fallback with the reason. The counters and `stats()` /
`pools()` have GraphSession's shapes, so reports treat the two alike (one scope, `step`).
"""

from __future__ import annotations

from typing import Callable

import torch

from .backend import default_backend, release
from .pools import pool_bytes
from .scope import Counters


class StepGraph:
    whole_step = True
    strategy = "step"

    def __init__(self, step: Callable[[torch.Tensor], tuple], warm_up: Callable[[torch.Tensor], None],
                 backend=None, warmup_iters: int = 2):
        self.step, self.warm_up = step, warm_up
        self.backend = backend if backend is not None else default_backend()
        self.warmup_iters = warmup_iters
        self.counters = Counters()
        self.graph = None
        self.pool = None
        self.static_input: torch.Tensor | None = None
        self.static_outputs: tuple = ()
        self.captured = False
        self.installed = False
        self.failure: str | None = None
        self.scopes: list = []  # no per-scope graphs (reports iterate these)

    def capture(self, sample: torch.Tensor) -> bool:
        self.static_input = sample.detach().clone()
        phase = "warm-up"
        try:
            self.backend.synchronize()
            with self.backend.side_stream():
                for _ in range(self.warmup_iters):
                    self.warm_up(self.static_input)
            self.backend.synchronize()
            phase = "capture"
            self.pool = self.backend.pool_handle()
            self.graph, outs = self.backend.capture(lambda: tuple(self.step(self.static_input)),
                                                    self.pool, run=False)
            self.static_outputs = outs
            self.backend.synchronize()
        except Exception as e:  # noqa: BLE001 - any failure rolls the capture back
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            reason = f"{type(e).__name__} during {phase} of the whole step: {first}"[:400]
        else:
            reason = None
        if reason is not None:  # outside the handler, so the exception's frames are gone
            self.rollback(reason)
            return False
        self.counters.captured += 1
        self.captured = self.installed = True
        self.failure = None
        return True

    def check(self, batch: torch.Tensor) -> str | None:
        s = self.static_input
        if batch.shape != s.shape or batch.dtype != s.dtype or batch.device != s.device:
            return (f"batch {tuple(batch.shape)} {batch.dtype} on {batch.device} differs from "
                    f"the captured {tuple(s.shape)} {s.dtype} on {s.device}")
        return None

    def __call__(self, batch: torch.Tensor) -> tuple:
        reason = "not captured" if self.graph is None else self.check(batch)
        if reason is not None:
            self.counters.fall_back(reason)
            return tuple(self.step(batch))
        if batch.data_ptr() != self.static_input.data_ptr():
            self.static_input.copy_(batch)
            self.counters.input_copies += 1
        self.graph.replay()
        self.counters.replayed += 1
        self.counters.backward_replayed += 1
        return tuple(o.clone() for o in self.static_outputs)

    def new_step(self) -> None:
        """Per-step re-arming: nothing to do (one replay is the whole step)."""

    def rollback(self, reason: str) -> None:
        self.uninstall()
        self.failure = reason
        release(self.backend)

    def install(self) -> None:
        if self.graph is None:
            raise RuntimeError("nothing captured to install")
        self.installed = True

    def uninstall(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.pool, self.static_outputs = None, None, ()
        self.static_input = None
        self.captured = self.installed = False

    def graphs(self) -> list:
        return [self.graph] if self.graph is not None else []

    def stats(self) -> dict:
        c = self.counters
        row = {"name": "step", "layer": -1, "kind": "step", "pool": "step",
               "captured": c.captured, "replayed": c.replayed,
               "backward_replayed": c.backward_replayed, "fallback": c.fallback,
               "fallback_reason": c.fallback_reason, "input_copies": c.input_copies,
               "grad_copies": 0, "param_copies": 0}
        totals = {k: row[k] for k in ("captured", "replayed", "backward_replayed", "fallback",
                                      "input_copies", "grad_copies", "param_copies")}
        return {"totals": totals, "scopes": [row], "failure": self.failure,
                "strategy": self.strategy}

    def pools(self) -> list[dict]:
        if self.graph is None:
            return []
        if self.backend.name != "cuda":
            return [{"name": "step", "graphs": 1, "bytes": None, "allocated": None,
                     "pool_ids": []}]
        pid = self.backend.pool_id(self.graph)
        size = pool_bytes({pid})[pid]
        return [{"name": "step", "graphs": 1, "bytes": size["reserved"],
                 "allocated": size["allocated"], "pool_ids": [pid]}]
