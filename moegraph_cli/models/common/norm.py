"""RMSNorm with transformers' numerics: fp32 math, cast back, then scale by the weight.

The weight's gradient goes through `grads.through` (deposited into a sink's `.grad`). On CUDA
the same math runs as one Triton kernel each way (fused.py, kernels/rmsnorm.py); with
`skip=True` the module also hands back its input for a skip connection, whose gradient that
kernel then adds."""

import torch

from ... import grads
from . import fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if fused.active(x):
        return fused.rms_norm(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return grads.through(weight) * x32.to(x.dtype)


def rms_norm_skip(x: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x), x) for `x + f(rms_norm(x))`: use the second as the skip's operand. On
    the kernels (fused.NORM_SKIP) the skip's gradient is added inside the norm's backward;
    otherwise autograd adds the two gradients. The same values either way."""
    if fused.NORM_SKIP and fused.active(x):
        return fused.rms_norm_skip(x, weight, eps)
    return rms_norm(x, weight, eps), x


def rms_norm_fork(x: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, y, x) with y = rms_norm(x), for two consumers of y and a skip connection
    (`x + f(y) + g(y)`). On the kernels (fused.NORM_FORK, fused.NORM_SKIP) each consumer gets
    its own output and the three gradients are summed inside the norm's backward; otherwise
    autograd sums them. The same values either way."""
    if fused.NORM_FORK and fused.NORM_SKIP and fused.active(x):
        return fused.rms_norm_fork(x, weight, eps)
    y, skip = rms_norm_skip(x, weight, eps)
    return y, y, skip


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, skip: bool = False, fork: bool = False):
        """rms_norm(x); with `skip`, (rms_norm(x), x) for a skip connection (rms_norm_skip);
        with `fork` too, (rms_norm(x), rms_norm(x), x) for two consumers (rms_norm_fork).
        Through the module call either way, so forward hooks see the norm (its output a
        tuple with `skip`)."""
        if fork:
            if not skip:
                raise ValueError("RMSNorm: fork=True needs skip=True")
            return rms_norm_fork(x, self.weight, self.eps)
        if skip:
            return rms_norm_skip(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
