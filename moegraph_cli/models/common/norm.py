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


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, skip: bool = False):
        """rms_norm(x); with `skip`, (rms_norm(x), x) for a skip connection (rms_norm_skip).
        Through the module call either way, so forward hooks see the norm (its output a
        tuple with `skip`)."""
        if skip:
            return rms_norm_skip(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
