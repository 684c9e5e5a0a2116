"""Parameters a graph must not read in place: 'moving' parameters.

A parameter whose storage can be freed and re-allocated between calls (FSDP2 re-materialises
its unsharded parameters every step with `untyped_storage().resize_`) must never have its
address baked into a graph. Such a parameter is a graph *input* instead: the graph reads a
static copy, refreshed before every replay, and its gradient leaves through autograd (so the
owner of the parameter, e.g. FSDP2's post-backward reduce-scatter, sees it as `.grad`),
instead of being added into a `.grad` buffer inside the graph.

The static copies and gradient buffers are shared by every scope of a session that has a
parameter of the same role (same kind, same relative name, shape and dtype): scopes replay
one at a time on one stream, and each replay, forward or backward, first copies its own
layer's values in, so one set serves all layers (an attention layer's weights once, not once
per layer).
"""

from __future__ import annotations

import contextlib

import torch


class ParamBuffers:
    """Static value and gradient buffers of moving parameters, shared by role."""

    def __init__(self):
        self._values: dict[tuple, torch.nn.Parameter] = {}
        self._grads: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def key(kind: str, name: str, p: torch.Tensor) -> tuple:
        return (kind, name, tuple(p.shape), p.dtype, str(p.device))

    def value(self, key: tuple) -> torch.nn.Parameter:
        if key not in self._values:
            _, _, shape, dtype, device = key
            self._values[key] = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        return self._values[key]

    def grad(self, key: tuple) -> torch.Tensor:
        if key not in self._grads:
            _, _, shape, dtype, device = key
            self._grads[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self._grads[key]

    def clear(self) -> None:
        self._values.clear()
        self._grads.clear()


@contextlib.contextmanager
def swapped_parameters(module: torch.nn.Module, replacement: dict[str, torch.nn.Parameter]):
    """Temporarily register other Parameter objects under these (dotted) names."""
    saved = []
    try:
        for name, new in replacement.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            saved.append((owner, leaf, owner._parameters[leaf]))
            owner._parameters[leaf] = new
        yield
    finally:
        for owner, leaf, old in reversed(saved):
            owner._parameters[leaf] = old
