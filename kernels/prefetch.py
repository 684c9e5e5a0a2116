"""L2 prefetch of rows a kernel reads only after its K loop (`prefetch_rows_l2`).

A GEMM whose epilogue loads tiles (dact_swiglu.py: the Y1 gate and up tiles) stalls on those
loads once the K loop ends: with one CTA an SM nothing else runs meanwhile. Issued before the
loop, `prefetch.global.L2` moves those lines into L2 while the MMAs run, and holds no
register (a load issued early would hold the tile through the loop, which spills at the
dA tile: ptxas -v, 128 x 128 x 64, 8 warps). A prefetch changes no value. GPU only: the
interpreter runs no inline assembly, so callers pass their PREFETCH constexpr as False there.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Bytes of one L2 line: one prefetch per line.
LINE_BYTES = tl.constexpr(128)


@triton.jit
def prefetch_rows_l2(row_ptrs, width, WIDTH: tl.constexpr, ELEM_BYTES: tl.constexpr):
    """Prefetch into L2 the first min(WIDTH, width) elements from each of row_ptrs [BM]
    (pointers to a row's first element), one instruction per 128-byte line."""
    STEP: tl.constexpr = LINE_BYTES // ELEM_BYTES
    LINES: tl.constexpr = (WIDTH + STEP - 1) // STEP
    cols = tl.minimum(tl.arange(0, LINES) * STEP, width - 1)
    ptrs = row_ptrs[:, None] + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
