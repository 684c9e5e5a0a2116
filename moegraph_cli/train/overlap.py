"""The optimizer update overlapped with the backward: a layer's AdamW update starts as soon as
the backward has written that layer's gradients, on a side stream, while the backward of the
layers before it runs.

AdamW reads and writes every parameter's four flat buffers (FlatAdamW), which is bandwidth
work; the backward is mostly GEMMs. Run at the step's end, the update is a separate phase of
the step; here it runs beside the GEMMs wherever the GPU has room for it. The update is
elementwise, so updating the flat buffers range by range gives the same bits as updating them
whole.

How a chunk (the parameters of one `grads.boundary`, `model.update_chunks()`: the final norm
and lm head, then each layer from the last) becomes ready:
- While `armed()` (the step's last micro-batch: its forward places the boundaries, its
  backward passes them) each boundary the backward passes checks which chunks have had every
  gradient written in this backward pass (`grads.written`: the write's kernel was launched,
  since each write op launches its kernel as it claims the gradient). Those are updated now,
  on the side stream after the work launched so far.
- A chunk that is not ready at a boundary (a norm weight's small deposit node that autograd
  ran later) waits for the next one; whatever is left, the embedding (its gradient comes
  last, and a tied lm head's with it) and any parameter in no chunk, is updated by `finish()`
  on the main stream, after the side stream joins it.
- A write to a parameter whose update already ran would be lost: `before_write` refuses it
  (RuntimeError), so a model whose parameter gets a second gradient write later in the
  backward cannot be overlapped silently wrong.

Nothing syncs with the host or allocates, so a whole-step graph captures the fork and join
(the side stream waits on the capturing stream, the capturing stream waits on it at the end).
On CPU the ready chunks are updated inline at the boundary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import grads


@dataclass
class _Chunk:
    ids: frozenset[int]
    params: list[torch.Tensor]
    ranges: list[tuple[int, int, int]]


class OverlappedUpdate:
    """The AdamW update of `optimizer` (train/optim.FlatAdamW) in chunks of parameters, each
    started by the backward once its gradients are written. `chunks`: lists of parameters in
    the order the backward finishes them; a chunk whose parameters are not consecutive in the
    flat buffers (or not all the optimizer's) is left to `finish()`."""

    def __init__(self, optimizer, chunks: list[list[torch.Tensor]]):
        self.optimizer = optimizer
        self.chunks: list[_Chunk] = []
        covered: set[int] = set()
        for params in chunks:
            ids = frozenset(id(p) for p in params)
            ranges = optimizer.ranges_of(params) if params and not ids & covered else None
            if ranges is not None:
                self.chunks.append(_Chunk(ids, list(params), ranges))
                covered |= ids
        self.rest = self._complement()
        device = optimizer.params[0].device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: list[_Chunk] = []
        self._updated: set[int] = set()
        self._forked = False
        self.early = 0  # chunks updated before `finish` in the last step

    def _complement(self) -> list[tuple[int, int, int]]:
        """The flat ranges no chunk holds, per group."""
        out = []
        for i, g in enumerate(self.optimizer.groups):
            taken = sorted((a, b) for c in self.chunks for j, a, b in c.ranges if j == i)
            at = 0
            for a, b in taken:
                if a > at:
                    out.append((i, at, a))
                at = b
            if at < g.param.numel():
                out.append((i, at, g.param.numel()))
        return out

    @contextlib.contextmanager
    def armed(self):
        """Around the step's last forward and backward: the step count and bias corrections
        first (main stream), then chunks update as the backward finishes them."""
        self.optimizer.begin_step()
        self._pending = list(self.chunks)
        self._updated = set()
        self._forked = False
        self.early = 0
        with grads.listening(self):
            yield

    def before_write(self, p: torch.Tensor) -> None:
        if id(p) in self._updated:
            raise RuntimeError(f"a gradient of the parameter {list(p.shape)} was written after "
                               "its optimizer update ran (overlapped update): this model "
                               "writes it twice in one backward; turn the overlap off")

    def boundary(self) -> None:
        ready = [c for c in self._pending if all(grads.written(p) for p in c.params)]
        if not ready:
            return
        self._pending = [c for c in self._pending if c not in ready]
        ranges = [r for c in ready for r in c.ranges]
        for c in ready:
            self._updated |= c.ids
        self.early += len(ready)
        if self.stream is None:
            self.optimizer.update(ranges)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self._forked = True
        with torch.cuda.stream(self.stream):
            self.optimizer.update(ranges)

    def finish(self) -> None:
        """After the backward: join the side stream, then update what is left."""
        if self._forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._forked = False
        self.optimizer.update([r for c in self._pending for r in c.ranges] + self.rest)
        self._pending = []
