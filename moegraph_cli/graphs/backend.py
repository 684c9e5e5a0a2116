"""How a graph is captured and replayed: CUDA graphs, or an emulation for CPU tests.

`CudaGraphs` is the real thing: `capture(body, pool)` records body's kernels into a
torch.cuda.CUDAGraph allocating from `pool`, and replay re-launches them on the same addresses.

`EmulatedGraphs` runs on any device: capture runs body once and keeps its results as the
static buffers; replay runs body again and copies the new results into those buffers. It
keeps the engine's observable contract (static buffers, in-place chaining, counters, pool
groups, fallback, ordering) so all of that logic is tested on the CPU; it does not emulate
memory pools or kernel launches.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


class CudaGraphs:
    """`capture_error_mode="thread_local"` lets other threads make CUDA calls that are unsafe
    during capture (a distributed run's NCCL watchdog thread queries its events)."""

    name = "cuda"

    def __init__(self, capture_error_mode: str = "global"):
        self.capture_error_mode = capture_error_mode

    def capture(self, body: Callable[[], tuple], pool, run: bool = True) -> tuple[object, tuple]:
        """`run` matters only to the emulation (a capture runs nothing on the GPU)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_error_mode):
            result = body()
        return graph, result

    def pool_handle(self):
        return torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def side_stream(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())

        @contextlib.contextmanager
        def ctx():
            with torch.cuda.stream(side):
                yield
            torch.cuda.current_stream().wait_stream(side)
        return ctx()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def clear_library_workspaces(self) -> None:
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()

    @staticmethod
    def pool_id(graph) -> tuple:
        return tuple(graph.pool())


class _EmulatedGraph:
    def __init__(self, body: Callable[[], tuple], result: tuple):
        self.body, self.result = body, result

    def replay(self) -> None:
        new = self.body()
        if self.result is None:  # captured without running: the first replay makes the buffers
            self.result = tuple(None if v is None else v.detach().clone() for v in new)
            return
        with torch.no_grad():
            for static, value in zip(self.result, new):
                if static is not None and value is not None:
                    static.detach().copy_(value.detach())

    def reset(self) -> None:
        self.body, self.result = None, None

    def pool(self):
        return (0, id(self))


class _LazyOutputs:
    """The static outputs of a graph captured without running: its buffers after replays."""

    def __init__(self, graph: _EmulatedGraph):
        self.graph = graph

    def __iter__(self):
        return iter(self.graph.result or ())


class EmulatedGraphs:
    name = "emulated"

    def capture(self, body: Callable[[], tuple], pool, run: bool = True) -> tuple[object, tuple]:
        """`run=False`: a body with side effects (a whole training step) is not run at capture,
        as on a GPU; its static outputs then exist from the first replay on."""
        if not run:
            graph = _EmulatedGraph(body, None)
            return graph, _LazyOutputs(graph)
        result = body()
        return _EmulatedGraph(body, result), result

    def pool_handle(self):
        return object()

    def synchronize(self) -> None:
        pass

    def side_stream(self):
        return contextlib.nullcontext()

    def empty_cache(self) -> None:
        pass

    def clear_library_workspaces(self) -> None:
        pass

    @staticmethod
    def pool_id(graph) -> tuple:
        return graph.pool()


def release(backend) -> None:
    """After a rollback: drop what Python still holds, wait for the device, return the freed
    pool memory to the driver. cuBLAS's per-stream workspaces go too: a capture stream's
    first matmul allocates its workspace inside the graph's private pool, and torch keeps
    that workspace (so the whole pool segment) for the life of the process; the next matmul
    on a stream allocates a fresh one from the default pool."""
    import gc

    gc.collect()
    backend.synchronize()
    backend.clear_library_workspaces()
    backend.empty_cache()


def default_backend():
    return CudaGraphs() if torch.cuda.is_available() else EmulatedGraphs()
