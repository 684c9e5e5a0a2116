"""RMSNorm with transformers' numerics: fp32 math, cast back, then scale by the weight.

The weight's gradient goes through `grads.through` (deposited into a sink's `.grad`). On CUDA
the same math runs as one Triton kernel each way (fused.py, kernels/rmsnorm.py)."""

import torch

from ... import grads
from . import fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if fused.active(x):
        return fused.rms_norm(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return grads.through(weight) * x32.to(x.dtype)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
