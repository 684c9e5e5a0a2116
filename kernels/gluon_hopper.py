"""What the warp-specialized Gluon kernels (wgrad_ws.py, slot_gemm_ws.py, fc1_swiglu_ws.py)
share: Gluon's Hopper modules under the names of whichever Triton is installed, whether a
device can run them, and the shared-memory layouts and dtypes of their TMA boxes.

Gluon runs on NVIDIA GPUs only (no interpreter); `GLUON` is False on a Triton without it.
"""

from __future__ import annotations

import torch

try:  # Gluon: Triton >= 3.5 (the names used here are in 3.6 and 3.9)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # Triton 3.9 renamed the TMA copies (the 3.6 names raise there).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    GLUON = True
except ImportError:  # pragma: no cover - an older Triton
    GLUON = False

if GLUON:

    @gluon.jit
    def await_gathered_stage(ready_tma, ready_cp, stage, phase):
        """Wait for a stage filled partly by TMA (`ready_tma`) and partly by the producer's
        cp.async copies (`ready_cp`), then fence: the cp.async rows were written through the
        generic proxy, and wgmma reads through the async one."""
        mbarrier.wait(ready_tma.index(stage), phase)
        mbarrier.wait(ready_cp.index(stage), phase)
        fence_async_shared()


GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16} if GLUON else {}


def available(device: torch.device) -> bool:
    """Whether the warp-specialized kernels can run on `device`: a Hopper GPU and Gluon."""
    return (GLUON and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9)


def nvmma(block_shape, dtype: torch.dtype):
    """The default NVMMA shared layout of a [block_shape] box of `dtype` (2-byte types)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, box) -> TensorDescriptor:
    """A host TMA descriptor over the 2-D tensor `t` with [box] boxes in the NVMMA layout."""
    return TensorDescriptor.from_tensor(t, list(box), nvmma(box, t.dtype))


def rows_aligned(*tensors: torch.Tensor) -> bool:
    """Every 2-D tensor has unit column stride and 16-byte aligned rows and start, as TMA
    descriptors need."""
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in tensors)
