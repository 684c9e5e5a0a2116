"""The optimizer step under the backward: each parameter's AdamW update runs as soon as its
gradient is final, on a side stream, while the backward of the layers below goes on.

Why: AdamW reads and writes every parameter's state once (about 14 bytes a bf16 parameter), a
bandwidth-bound pass that otherwise runs alone after the backward (about 11 ms of a 118 ms
qwen3-30b-a3b-4layer step at 4 x 4096 tokens). The lm head's and the top layers' gradients
are final long before the backward ends; their updates can fill the SMs and the memory
bandwidth the backward's GEMMs leave idle.

When a gradient is final. Every trainable parameter is a gradient sink (grads.py): the op that
computes its gradient writes it, after taking its target through `grads.target`, which counts
the writes of the backward pass (`grads.write_counts`). A parameter whose count has reached
its count of a whole backward pass (`after_backward`, from the last complete pass: the warm-up before a
capture, or the step before) has had its last write launched. Fences decide: a tensor hook on
the input of each decoder layer and of the final norm runs when that input's gradient is
ready; autograd has then finished every node it ran before, so every write counted so far is
launched on the current stream. At a fence the parameters that became final are updated on
the side stream after an event of the current stream (so after their writes, and after every
read of the old value that the backward launched before it). `finish` updates the rest on
the current stream and joins the side stream: nothing of the next step starts before all of
the step is applied.

What it must not break, and how it holds:
- A parameter read again after its last gradient write (none in these models: a layer's
  weights are read by its own backward, before its weight gradient is final; a tied
  embedding gets its second write at the very end) would see the new value. The CPU tests
  run the updates inline at the fences, where such a read would change the next steps'
  losses, and compare bitwise with the plain step.
- A count above the learned one at `finish` means an update ran on a partial gradient:
  `finish` raises rather than train on.
- Values: AdamW is elementwise and `FlatAdamW.update` covers each element exactly once per
  step, so the parameters are bitwise those of `FlatAdamW.step()`.
Only for a single-process step whose parameters are all sinks of a FlatAdamW; the trainer
arms it for the last micro-batch of a step (earlier ones only accumulate), and not for scoped
graph sessions, whose replayed backward graphs write gradients without counting them.
"""

from __future__ import annotations

import torch

from .. import grads


class OptimizerOverlap:
    """Per-step use: `arm()` before the last micro-batch's forward, `after_backward(counts)`
    inside every complete backward pass (armed or not: the warm-up's teach the counts),
    `finish()` after the backward (it applies what is left)."""

    def __init__(self, model: torch.nn.Module, optimizer, side_stream: bool = True):
        self.model, self.optimizer = model, optimizer
        self.params = list(optimizer.params)
        self.expected: dict[int, int] | None = None
        self.pending: dict[int, torch.Tensor] = {}
        self.early = 0  # parameters updated at fences in the latest step
        self.fences = 0
        self._handles: list = []
        first = self.params[0] if self.params else None
        # Made here, never inside a capture.
        self._side = torch.cuda.Stream(device=first.device) \
            if side_stream and first is not None and first.is_cuda else None
        self.armed = False

    # -- per step ---------------------------------------------------------------------------
    def arm(self) -> None:
        """Begin the step (`FlatAdamW.begin_step`) and watch the coming forward's layer
        inputs; without a learned count nothing is updated early."""
        self.optimizer.begin_step()
        self.pending = {id(p): p for p in self.params}
        self.early = self.fences = 0
        self.armed = True
        modules = list(getattr(self.model, "layers", [])) + [getattr(self.model, "norm", None)]
        self._handles = [m.register_forward_pre_hook(self._watch) for m in modules
                         if m is not None]

    def after_backward(self, counts: dict[int, int]) -> None:
        """Inside a complete backward pass (`grads.write_counts()`): refuse a step whose early
        updates may have read a partial gradient, then learn the pass's counts."""
        if self.armed and self.early and self.expected is not None:
            if any(n > self.expected.get(i, n) for i, n in counts.items()):
                raise RuntimeError(
                    "optimizer overlap: a parameter got a gradient write after its update ran "
                    "(the backward's write pattern changed between steps); rerun with "
                    "run.optim_overlap=false")
        self.expected = {i: counts.get(i, 0) for i in (id(p) for p in self.params)}

    def finish(self) -> None:
        """Update every parameter not updated at a fence, then join the side stream."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.armed = False
        rest = list(self.pending.values())
        self.pending = {}
        if rest:
            self.optimizer.update(rest)
        if self._side is not None and self.early:
            torch.cuda.current_stream().wait_stream(self._side)

    # -- fences -----------------------------------------------------------------------------
    def _watch(self, _module, args):
        x = args[0] if args else None
        if self.armed and isinstance(x, torch.Tensor) and x.requires_grad \
                and torch.is_grad_enabled():
            x.register_hook(self._fence)

    def _fence(self, _grad):
        if not self.armed or self.expected is None or not self.pending:
            return None
        self.fences += 1
        counts = grads.write_counts()
        ready = [p for i, p in self.pending.items()
                 if self.expected[i] > 0 and counts.get(i, 0) >= self.expected[i]]
        if not ready:
            return None
        for p in ready:
            del self.pending[id(p)]
        self.early += len(ready)
        side = self._side
        if side is None:
            self.optimizer.update(ready)
            return None
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.optimizer.update(ready)
        return None
