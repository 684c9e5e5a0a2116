"""One graphed scope: a forward graph, a backward graph, static buffers, contract, counters.

The scope is any module whose forward takes tensors and returns a tensor or a tuple of
tensors. Its parameters are read in place by the graphs (explicit inputs at fixed
addresses); if a parameter's storage moves, the new values are copied into the captured
storage before replay. The backward graph computes `autograd.grad` of the static outputs;
the parameter gradients land in their `.grad` buffers inside the graph, as in an eager step
(grads.py: a sink's gradient is written there by the op that computes it, any other is added
by the graph), so no second copy of the gradients is kept in the pool. A backward graph bakes
the write-or-accumulate mode it was captured in: with `accumulate_too` (gradient
accumulation) a second backward graph is captured in accumulate mode, and each backward
replay picks the graph of the mode in force (`grads.accumulating_now()`).

Moving parameters (see params.py; `moving(name, param)` picks them) are the exception: the
graphs read shared static copies, refreshed before each forward and backward replay from the
parameter objects the call passed, and their gradients are returned through autograd (a fresh
tensor each, so the parameter's owner may keep or free it).

Returned outputs alias graph-owned storage: they are valid until this scope's forward graph
replays again (the next step). Gradients handed back for inputs alias the backward graph's
static buffers likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import grads
from .backend import default_backend
from .contract import Contract
from .params import ParamBuffers, swapped_parameters
from .pools import PoolGroup


@dataclass
class Counters:
    captured: int = 0
    replayed: int = 0
    backward_replayed: int = 0
    fallback: int = 0
    fallback_reason: str | None = None
    input_copies: int = 0  # forward inputs (and moved parameters) copied into static buffers
    grad_copies: int = 0  # backward grad-outputs copied into static buffers
    param_copies: int = 0  # moving parameters copied in (forward and backward replays)

    def fall_back(self, reason: str) -> None:
        self.fallback += 1
        if self.fallback_reason is None:
            self.fallback_reason = reason


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scope: "GraphedScope", leaf_inputs: tuple, num_inputs: int, *tensors):
        inputs, moving = tensors[:num_inputs], tensors[num_inputs:]
        scope.load_inputs(inputs)
        scope.load_moving(moving)
        scope.fwd_graph.replay()
        # The moving parameters themselves (not their values now): the backward copies in
        # whatever storage their owner gives them by then (FSDP2 gathers them again).
        ctx.scope, ctx.leaf_inputs, ctx.moving = scope, leaf_inputs, moving
        outs = tuple(o.detach() for o in scope.static_outputs)
        ctx.mark_non_differentiable(*[o for o, s in zip(outs, scope.static_outputs)
                                      if not s.requires_grad])
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grad_outputs):
        scope = ctx.scope
        scope.load_grad_outputs(grad_outputs)
        scope.load_moving(ctx.moving)
        scope.backward_graph(grads.accumulating_now()).replay()
        scope.counters.backward_replayed += 1
        scope.group.pending_backward -= 1
        scope.pending = False
        moving_grads = [g.clone() for g in scope.moving_grads]
        return (None, None, None, *scope.input_grads(ctx.leaf_inputs), *moving_grads)


class GraphedScope:
    def __init__(self, name: str, layer: int, kind: str, module: torch.nn.Module,
                 group: PoolGroup | None, backend=None, moving=None,
                 buffers: ParamBuffers | None = None):
        self.name, self.layer, self.kind, self.module = name, layer, kind, module
        self.backend = backend if backend is not None else default_backend()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.moving_names = [n for n, p in named if moving is not None and moving(n, p)]
        # Baked parameters keep one object and one address for the run: read in place.
        self.params = [p for n, p in named if n not in self.moving_names]
        self.buffers = buffers if buffers is not None else ParamBuffers()
        self.group = group if group is not None else PoolGroup(name, pooled=False)
        self.counters = Counters()
        self.pending = False
        self.reset()

    # -- capture ----------------------------------------------------------------------
    def reset(self) -> None:
        """Drop graphs and every static buffer (used by rollback and uninstall)."""
        for g in ("fwd_graph", "bwd_graph", "bwd_graph_acc"):
            graph = getattr(self, g, None)
            if graph is not None:
                graph.reset()
        self.fwd_graph = self.bwd_graph = self.bwd_graph_acc = None
        self._autograd_outputs: tuple = ()
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: list[torch.Tensor] = []
        self.static_grad_outputs: list[torch.Tensor | None] = []
        self.static_input_grads: list[torch.Tensor | None] = []
        self.static_params: list[torch.Tensor] = []
        self.moving_values: list[torch.nn.Parameter] = []
        self.moving_grads: list[torch.Tensor] = []
        self.contract: Contract | None = None
        self.pending = False
        self.forced_reason: str | None = None  # a fallback agreed for this step (distributed)

    # -- moving parameters ------------------------------------------------------------
    def current_moving(self) -> list[torch.Tensor]:
        """The moving parameters as the module holds them now (inside an FSDP2 forward: the
        unsharded ones)."""
        if not self.moving_names:  # every call asks: skip the module walk when there are none
            return []
        named = dict(self.module.named_parameters())
        return [named[n] for n in self.moving_names]

    def _bind_moving(self) -> None:
        """Static value and gradient buffers of the moving parameters, shared by role."""
        if self.moving_values or not self.moving_names:
            return
        for name, p in zip(self.moving_names, self.current_moving()):
            key = ParamBuffers.key(self.kind, name, p)
            self.moving_values.append(self.buffers.value(key))
            self.moving_grads.append(self.buffers.grad(key))

    def swapped(self):
        return swapped_parameters(self.module, dict(zip(self.moving_names, self.moving_values)))

    def load_moving(self, moving) -> None:
        # `.data`: the shared buffers are rewritten between a scope's forward and its backward
        # by design (each replay first copies its own values back in), so autograd's version
        # counter, which the emulated backend's replays run under, must not see the copies.
        with torch.no_grad():
            for static, p in zip(self.moving_values, moving):
                static.data.copy_(p.detach())
        self.counters.param_copies += len(self.moving_values)

    def warm_up(self, inputs: list[torch.Tensor], iters: int) -> None:
        """Eager fwd+bwd on the current (side) stream: compile, autotune libraries, init."""
        self._bind_moving()
        for _ in range(iters):
            ins = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
            with self.swapped():
                outs = _as_tuple(self.eager(*ins))
            diff = [o for o in outs if o.requires_grad]
            wrt = [t for t in ins if t.requires_grad] + self.params + self.moving_values
            torch.autograd.grad(diff, wrt, grad_outputs=[torch.ones_like(o) for o in diff],
                                allow_unused=True)
            del ins, outs, diff, wrt

    def capture_forward(self, inputs: list[torch.Tensor], pool) -> None:
        """`inputs` become the static inputs (kept by reference: chained scopes pass the
        previous scope's static output, detached, so the replay reads it in place)."""
        self.static_inputs = list(inputs)
        self.static_params = [p.detach() for p in self.params]
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._bind_moving()
        self.contract = Contract.capture(self.module, self.static_inputs, self.params,
                                         self.moving_values)

        def forward_body():
            with torch.enable_grad(), self.swapped():
                outs = _as_tuple(self.eager(*self.static_inputs))
            self._autograd_outputs = outs
            return outs

        self.fwd_graph, outs = self.backend.capture(forward_body, pool)
        self.static_outputs = list(outs)

    def capture_backward(self, pool, grad_output_buffers: list | None = None,
                         accumulate_too: bool = False) -> None:
        """`grad_output_buffers[i]`, when given, is the static grad buffer of output i (the
        next scope's input-grad buffer, so chained backward replays need no copy).
        `accumulate_too`: also capture the accumulate-mode backward graph, which hands its
        input gradients over in the write-mode graph's buffers."""
        self.static_grad_outputs = []
        for i, o in enumerate(self.static_outputs):
            given = grad_output_buffers[i] if grad_output_buffers else None
            if not o.requires_grad:
                self.static_grad_outputs.append(None)
            elif given is not None and given.shape == o.shape and given.dtype == o.dtype:
                self.static_grad_outputs.append(given)
            else:
                self.static_grad_outputs.append(torch.zeros_like(o))
        self.bwd_graph, input_grads = self.backend.capture(
            self._backward_body(False, retain=accumulate_too), pool)
        self.static_input_grads = list(input_grads)
        if accumulate_too:
            self.bwd_graph_acc, _ = self.backend.capture(self._backward_body(True), pool)
        self.counters.captured += 1

    def _backward_body(self, accumulate: bool, retain: bool = False):
        grads_for = [g for g in self.static_grad_outputs if g is not None]
        wrt_inputs = [t for t in self.static_inputs if t.requires_grad]

        def body():
            with grads.backward_pass(accumulate):
                diff = [o for o in self._autograd_outputs if o.requires_grad]
                got = torch.autograd.grad(diff, wrt_inputs + self.params + self.moving_values,
                                          grad_outputs=grads_for, allow_unused=True,
                                          retain_graph=retain)
                n_in, n_baked = len(wrt_inputs), len(self.params)
                for p, g in zip(self.params, got[n_in:n_in + n_baked]):
                    if g is not None and grads.deposit(p, g) is not None:
                        p.grad.add_(g)  # not a sink: autograd's contract, `.grad += g`
                for buf, g in zip(self.moving_grads, got[n_in + n_baked:]):
                    if g is None:
                        buf.zero_()
                    else:
                        buf.copy_(g)
                it = iter(got[:len(wrt_inputs)])
                ins = tuple(next(it) if t.requires_grad else None for t in self.static_inputs)
            if not accumulate or not self.static_input_grads:
                return ins
            for buf, g in zip(self.static_input_grads, ins):
                if buf is not None and g is not None:
                    buf.copy_(g)
            return ()
        return body

    def backward_graph(self, accumulate: bool):
        if not accumulate:
            return self.bwd_graph
        if self.bwd_graph_acc is None:
            raise RuntimeError(f"{self.name}: a backward in accumulate mode, but the session "
                               "was captured without accumulate_too")
        return self.bwd_graph_acc

    # -- replay -----------------------------------------------------------------------
    def precheck(self) -> str | None:
        """Every contract check that does not need the call's inputs (run before a step)."""
        if self.fwd_graph is None or self.bwd_graph is None:
            return "not captured"
        return self.contract.check_state(self.module, self.params, self.current_moving())

    def __call__(self, *inputs):
        reason = None
        moving = self.current_moving()
        if self.fwd_graph is None or self.bwd_graph is None:
            reason = "not captured"
        elif self.forced_reason is not None:
            reason = self.forced_reason
        elif self.group.eager_this_step is not None:
            reason = f"pool group {self.group.name} is eager this step " \
                     f"({self.group.eager_this_step})"
        elif self.pending:
            reason = "called again before its backward ran"
        else:
            reason = self.contract.check(self.module, inputs, self.params, moving)
            if reason is not None and self.group.agreed:
                # The ranks agreed before this step that this scope replays; deciding
                # otherwise here, on one rank only, would leave a collective unmatched.
                raise RuntimeError(f"{self.name}: contract broke after the ranks agreed to "
                                   f"replay ({reason}); stopping instead of deadlocking")
        if reason is not None:
            self.counters.fall_back(reason)
            if self.group.pooled and self.group.eager_this_step is None:
                self.group.eager_this_step = f"{self.name}: {reason}"
            return self.eager(*inputs)
        self.pending = True
        self.group.pending_backward += 1
        self.counters.replayed += 1
        leaf = tuple(isinstance(t, torch.Tensor) and t.is_leaf for t in inputs)
        return _Replay.apply(self, leaf, len(inputs), *inputs, *moving)

    def eager(self, *inputs):
        return type(self.module).forward(self.module, *inputs)

    def load_inputs(self, inputs) -> None:
        for static, t in zip(self.static_inputs, inputs):
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
                self.counters.input_copies += 1
        for static, p in zip(self.static_params, self.params):
            if static.data_ptr() != p.data_ptr():
                static.copy_(p.detach())
                self.counters.input_copies += 1

    def load_grad_outputs(self, grad_outputs) -> None:
        for static, g in zip(self.static_grad_outputs, grad_outputs):
            if static is None:
                continue
            if g is None:
                static.zero_()
            elif static.data_ptr() != g.data_ptr():
                static.copy_(g)
                self.counters.grad_copies += 1

    def input_grads(self, leaf_inputs: tuple) -> list:
        out = []
        for leaf, g in zip(leaf_inputs, self.static_input_grads):
            if g is None:
                out.append(None)
            else:
                # A leaf input's AccumulateGrad could keep the alias as its .grad: hand a copy.
                out.append(g.clone() if leaf else g.detach())
        return out

    def graphs(self) -> list:
        return [g for g in (self.fwd_graph, self.bwd_graph, self.bwd_graph_acc) if g is not None]


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
