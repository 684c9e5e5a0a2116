"""Activation recompute of a scope: keep its inputs, re-run its forward inside its backward.

Every graphable scope (attention, MLA, MoE, dense MLP) derives from `Scope` and writes its
computation as `body`. `Scope.forward` runs the body directly, or, with `recompute == "full"`
while autograd records, through `_Recompute`:
- forward: the body runs with autograd on, exactly as without recompute (the same kernels:
  some ops, SDPA for one, pick their kernel by whether a graph is being recorded), and the
  graph it built is dropped at once; only the scope's inputs are saved, so the activations
  inside the scope are freed before the next scope runs.
- backward: the body runs again from the saved inputs, with the parameters it read in the
  forward (`swapped_parameters`: a graphed scope's forward reads static parameter copies,
  and its backward graph must read the same addresses), then `autograd.grad` of its outputs.

Numbers do not change: the body is deterministic, so the re-run computes the same tensors bit
for bit, and its backward is the backward the scope would have run. Parameter gradients follow
grads.py's contract unchanged (a sink's gradient is written by its op inside the inner
backward; any other is returned to autograd). Side effects of a body (the MoE scope's drop and
load counters) happen once: a re-run sees `recomputing()` and skips them. Outputs that carry
statistics (the MoE scope's router statistics) are outputs like any other, so the aux loss
counts them once and its gradient reaches the router through the re-run.

Under a CUDA graph the re-run is part of the scope's backward graph (one replay, no eager
work); under the whole-step graph it is part of the step graph.

`recompute == "fc1"` (MoE scopes only) is selective: the scope runs directly, and the experts
drop FC1's output Y1 [S, 2F], their largest saved tensor, re-running FC1 in their backward.
`recompute == "keep"` (MoE scopes only) goes the other way: the experts keep FC1's activation
[S, F] beside Y1, so their backward recomputes nothing (moe/experts.PermuteFreeMoE). All three
give the same bits.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from ...config.run import SCOPE_MODES
from ...graphs.params import swapped_parameters

_STATE = threading.local()


def recomputing() -> bool:
    """True while a scope's forward is being re-run inside its backward."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def _rerun():
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scope: "Scope", names: tuple, num_inputs: int, *tensors):
        inputs, params = tensors[:num_inputs], tensors[num_inputs:]
        with torch.enable_grad():
            outs = _as_tuple(scope.body(*[t.detach().requires_grad_(t.requires_grad)
                                          for t in inputs]))
        ctx.scope, ctx.names, ctx.num_inputs, ctx.params = scope, names, num_inputs, params
        ctx.single = len(outs) == 1
        ctx.save_for_backward(*inputs)
        outs = tuple(o.detach() for o in outs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs[0] if ctx.single else outs

    @staticmethod
    def backward(ctx, *grad_outputs):
        scope, n = ctx.scope, ctx.num_inputs
        need = ctx.needs_input_grad[3:]
        inputs = [t.detach().requires_grad_(need[i]) for i, t in enumerate(ctx.saved_tensors)]
        with torch.enable_grad(), _rerun(), \
                swapped_parameters(scope, dict(zip(ctx.names, ctx.params))):
            outs = _as_tuple(scope.body(*inputs))
        pairs = [(o, g) for o, g in zip(outs, grad_outputs)
                 if g is not None and o.requires_grad]
        wrt = [t for t in inputs if t.requires_grad] + \
            [p for p, needed in zip(ctx.params, need[n:]) if needed]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                       allow_unused=True) if pairs and wrt else ())
        input_grads = [next(got, None) if t.requires_grad else None for t in inputs]
        param_grads = [next(got, None) if needed else None for needed in need[n:]]
        return (None, None, None, *input_grads, *param_grads)


class Scope(nn.Module):
    """A graphable scope: tensors in, tensors out, its computation in `body`."""

    kind = "attn"  # the key of SCOPE_MODES; subclasses set theirs
    recompute = "none"  # set per layer by set_recompute

    def body(self, *inputs):
        raise NotImplementedError

    def forward(self, *inputs):
        if self.recompute == "full" and torch.is_grad_enabled() and not recomputing():
            named = [(name, p) for name, p in self.named_parameters() if p.requires_grad]
            return _Recompute.apply(self, tuple(name for name, _ in named), len(inputs),
                                    *inputs, *(p for _, p in named))
        return self.body(*inputs)


def layer_modes(layer) -> dict[str, str]:
    """{scope kind: recompute mode} of one decoder layer."""
    return {layer.attn.kind: layer.attn.recompute, layer.ffn.kind: layer.ffn.recompute}


def set_recompute(model: nn.Module, per_layer: dict[int, dict[str, str]]) -> None:
    """Set each listed layer's scopes' recompute modes ({layer: {"attn": "full", "moe": "fc1"}});
    a kind a layer does not have (a dense layer's "moe") is skipped, an unknown mode refused."""
    for idx, modes in per_layer.items():
        layer = model.layers[idx]
        for scope in (layer.attn, layer.ffn):
            mode = modes.get(scope.kind)
            if mode is None:
                continue
            if mode not in SCOPE_MODES[scope.kind]:
                raise ValueError(f"layer {idx}: recompute {mode!r} is not one of "
                                 f"{SCOPE_MODES[scope.kind]} for a {scope.kind} scope")
            scope.recompute = mode
