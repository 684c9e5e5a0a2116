"""`embedding(ids, w)`: F.embedding whose weight gradient is written into `w.grad` by a kernel.

The forward is F.embedding. For a sink weight (grads.py) on CUDA the backward writes the
gradient straight into `w.grad` (kernels/embedding_backward.py: in write mode one zero fill
of `.grad` and one store per used row; accumulating, or after a tied lm head already wrote
`.grad` in this pass, the used rows are added to), instead of torch's dense [V, H] gradient
followed by a [V, H] copy. A plain parameter gets torch's dense gradient returned, as
autograd's. Elsewhere (the CPU) the path is F.embedding through `grads.through`, unchanged;
`impl="triton"` (or the module's `IMPL`, which tests set) forces the kernel, which on the CPU
runs only under TRITON_INTERPRET=1 and only in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ... import grads

IMPLS = ("auto", "triton", "reference")
IMPL = "auto"  # the default of `embedding(impl=None)`


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, w):
        ctx.save_for_backward(ids)
        ctx.w = w  # the parameter: a sink gets its gradient written
        return F.embedding(ids, w)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        w = ctx.w
        from moegraph_kernels.embedding_backward import (embedding_backward_into,
                                                         embedding_backward_ref)
        ids_T = ids.reshape(-1)
        dy_TH = dy.reshape(-1, dy.shape[-1])
        where = grads.target(w)
        if where is None:
            return None, embedding_backward_ref(dy_TH, ids_T, w.shape[0])
        grad, accumulate = where
        embedding_backward_into(dy_TH, ids_T, grad, accumulate)
        return None, None


def embedding(ids: torch.Tensor, w: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """F.embedding(ids, w); a sink weight (see grads.py) gets its gradient written by the
    kernel on CUDA. `impl`: auto | triton | reference (default `IMPL`; module docstring)."""
    impl = IMPL if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"embedding: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    use_kernel = impl == "triton" or (impl == "auto" and w.is_cuda)
    if not use_kernel or not torch.is_grad_enabled() or not grads.marked(w) \
            or not w.requires_grad:
        return F.embedding(ids, grads.through(w))
    return _Embedding.apply(ids, w)


class Embedding(torch.nn.Embedding):
    """nn.Embedding through `embedding` (same parameter, same state-dict key). Called as a
    module, so FSDP2 can shard it as a unit of its own (distributed/model.py)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight)
