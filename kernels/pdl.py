"""Programmatic dependent launch (PDL) between the expert path's kernels on Hopper.

Between two kernels of one stream (or one CUDA graph) the GPU drains the first grid, then
launches the second: its programs start, set up their barriers and descriptors and issue their
first loads only after the last program of the first has exited. Launched with PDL
(`launch_pdl=True`, sm_90+), the second grid may be launched as soon as every program of the
first has called `griddepcontrol.launch_dependents`, so its programs take the SMs that the
first grid's tail leaves idle and wait there.

The rule that keeps this exact: a kernel launched with PDL executes `gdc_wait` (wait for the
prior grid to complete and its writes to be visible) before it reads or writes any global
memory, and only then signals its own dependents (`wait_prior`, the first statement of every
kernel that takes `PDL`). A grid that never signals (a torch kernel, a copy) releases its
dependent at its end, as without PDL. Nothing moves across the wait, so outputs are bitwise
those of plain launches; what PDL can save is the launch and ramp between grids.

Off unless MOEGRAPH_PDL=1 (a measured A/B decides the default: benchmarks/results/NOTES.md);
never in Triton's interpreter or below sm_90, and not on a Triton without the GDC builtins.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

from .env import flag_from_env

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    AVAILABLE = True
except ImportError:  # pragma: no cover - an older Triton
    AVAILABLE = False

REQUESTED = flag_from_env("MOEGRAPH_PDL", False)
# Where a PDL grid releases its dependents: EARLY right after its wait (its dependents may
# take SMs its tail leaves idle), LATE at its programs' exits (only the launch overlaps).
EARLY, LATE = 1, 2
TRIGGER = EARLY


def mode(device) -> int:
    """The `PDL` constexpr of launches on `device`: 0 (plain launch) unless PDL is asked for,
    the device is CUDA sm_90+, the code compiled (not the interpreter) and the Triton has the
    GDC builtins; else TRIGGER."""
    if not (REQUESTED and AVAILABLE and getattr(device, "type", None) == "cuda"):
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return TRIGGER if _major(device.index) else 0


@functools.lru_cache(maxsize=None)
def _major(index) -> bool:
    import torch
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(pdl_mode: int) -> dict:
    """The launch keywords of a kernel launched with PDL (a non-zero mode), else none."""
    return {"launch_pdl": True} if pdl_mode else {}


if AVAILABLE:

    @triton.jit
    def wait_prior(PDL: tl.constexpr):
        """A PDL launch's first statement: the prior grid done and visible, then (EARLY) this
        grid's dependents released. Nothing when PDL is 0."""
        if PDL:
            gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()

else:  # pragma: no cover - an older Triton: PDL is never on

    @triton.jit
    def wait_prior(PDL: tl.constexpr):
        pass
