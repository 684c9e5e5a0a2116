"""RMSNorm with transformers' numerics: fp32 math, cast back, then scale by the weight.

The weight's gradient goes through `grads.through` (deposited into a sink's `.grad`). On CUDA
the same math runs as one Triton kernel each way (fused.py, kernels/rmsnorm.py); `with_skip`
also hands back the input for a skip connection, whose gradient that kernel then adds."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def with_skip(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x), x): see rms_norm_skip."""
        return rms_norm_skip(x, self.weight, self.eps)
