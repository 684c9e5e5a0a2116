"""Row chunks of a [T, ...] pass, and the side stream that runs a bandwidth-bound kernel of one
chunk beside the compute-bound GEMM of the next (models/common/loss.py's lm head + loss).

The pattern, on CUDA: the main stream runs the GEMMs; before each side-stream kernel the side
stream waits for what the main stream has queued (`side.wait_stream(main)`), and the main
stream waits for the side stream (`main.wait_stream(side)`) before it reads what the side
stream wrote. Every buffer either stream touches is allocated on the main stream before the
fork and outlives the join, so the caching allocator never hands a block in use on one stream
to the other. Both waits are events, which a CUDA graph captures as edges between the two
streams' nodes: the same code runs eager and under capture.
"""

from __future__ import annotations

import contextlib

import torch

_SIDE: dict[int, torch.cuda.Stream] = {}


def row_bounds(num_rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[(start, stop), ...] covering [0, num_rows) in chunks of `chunk_rows` rows (the last
    shorter); one chunk when chunk_rows <= 0 or num_rows <= chunk_rows."""
    if chunk_rows <= 0 or num_rows <= chunk_rows:
        return [(0, num_rows)]
    return [(a, min(a + chunk_rows, num_rows)) for a in range(0, num_rows, chunk_rows)]


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A high-priority stream of `device` (one per device, made once), so that the side
    kernels' blocks are scheduled ahead of the GEMM's as SMs free; None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        low, high = torch.cuda.Stream.priority_range()
        _SIDE[index] = torch.cuda.Stream(device=index, priority=high)
    return _SIDE[index]


@contextlib.contextmanager
def on_side(side: torch.cuda.Stream | None):
    """Run the block on `side` after everything the current stream has queued (a no-op
    without a side stream)."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield


def join(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for everything queued on `side`."""
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
