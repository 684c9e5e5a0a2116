"""`prefetch_l2`: ask the L2 to fetch the 128-byte lines at a tensor of addresses, ahead of the
loads that will read them (PTX `prefetch.global.L2::evict_last`, sm_80 and newer).

A hint only: no value changes, nothing waits on it, and an evict_last line is the one the L2
keeps longest, so a line fetched at a tile's start is still there for its epilogue. Every
address must lie inside an allocation the kernel may read. CUDA only: Triton's interpreter
runs no inline assembly, so callers gate it with a constexpr that the launcher sets on a GPU
alone (`on_gpu`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs):
    """One L2 prefetch per element of `ptrs` (any shape); returns nothing worth reading."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
        dtype=tl.int32, is_pure=False, pack=1)


def on_gpu(tensor) -> bool:
    """Whether a kernel reading `tensor` may issue prefetch_l2: a CUDA tensor, not the
    interpreter."""
    import os
    return tensor.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"
