"""Hopper features the slot GEMMs can use, and the checks that decide when they cannot.

- TMA (the bulk tensor copy engine) through *host-side* tensor descriptors
  (`triton.tools.tensor_descriptor.TensorDescriptor`, Triton >= 3.4), passed to the kernel by
  value. Not the device-side `tl.make_tensor_descriptor`: that one needs a global scratch
  allocator (`triton.set_allocator`), which Triton keeps in a ContextVar -- unset in the
  autograd engine's backward thread -- and it writes a descriptor per tile.
  A descriptor needs: base 16-byte aligned, every stride but the last a multiple of 16 bytes,
  the last stride 1; block dims powers of two, at most 256, the inner one at least 16 bytes.
  Out-of-bounds elements of a box read as zeros.
- Persistent loops: `tl.range(..., flatten=...)` (Triton >= 3.3) fuses the tile loop with the
  K loop so the pipeliner overlaps one tile's epilogue with the next tile's loads;
  `warp_specialize=` (Triton >= 3.4) splits loads and MMAs into separate warp groups; on
  Hopper only for unflattened loops whose loads are all TMA (see gemm_config.py).
Every check answers False where a feature is missing (older Triton, a pre-Hopper GPU), and the
callers then take the pointer-based path. The interpreter runs descriptors and `tl.range`
(ignoring its scheduling hints), so CPU tests exercise the same index arithmetic.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton < 3.4
    TensorDescriptor = None

# Programs of a persistent launch in the interpreter: a few, so each loops over several tiles.
INTERPRETER_PROGRAMS = 3


@functools.lru_cache(maxsize=None)
def range_supports(keyword: str) -> bool:
    """Whether the installed Triton's `tl.range` takes `keyword` (flatten, warp_specialize)."""
    try:
        return keyword in inspect.signature(tl.range.__init__).parameters
    except (TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tma_available(device: torch.device) -> bool:
    """Host tensor descriptors work here: the interpreter (CPU tensors) or an sm_90+ GPU."""
    if TensorDescriptor is None or not hasattr(tl, "tensor_descriptor"):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else
                       torch.cuda.current_device())[0] >= 9


def is_hopper(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else
                       torch.cuda.current_device())[0] == 9


def persistent_available() -> bool:
    return range_supports("flatten")


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device) -> int:
    """Grid size of a persistent launch: one program per SM (the GEMM tiles fill an SM's shared
    memory), or a few in the interpreter."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def matrix_fits(t: torch.Tensor, block_shape: tuple[int, int]) -> bool:
    """Whether the 2-D tensor `t` can back a descriptor with this block shape."""
    if t.dim() != 2 or t.stride(1) != 1 or t.data_ptr() % 16:
        return False
    if (t.stride(0) * t.element_size()) % 16 or min(t.shape) <= 0:
        return False
    if not all(_pow2(b) and b <= 256 for b in block_shape):
        return False
    return block_shape[1] * t.element_size() >= 16


def expert_rows(w_E: torch.Tensor) -> torch.Tensor | None:
    """w [E, R, C] as one [E*R, C] matrix (a view), or None when its strides do not allow it."""
    E, R, C = w_E.shape
    if w_E.stride(2) != 1 or (E > 1 and w_E.stride(0) != R * w_E.stride(1)):
        return None
    if E * R >= 2**31:  # descriptor coordinates are int32
        return None
    return w_E.as_strided((E * R, C), (w_E.stride(1), 1))


def descriptor(t: torch.Tensor, block_shape: tuple[int, ...]):
    """A host descriptor over t (any rank) with boxes of block_shape."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block_shape))


def weight_desc(w_E: torch.Tensor, block_shape: tuple[int, int]):
    """Descriptor over w [E, R, C] seen as [E*R, C], or None where TMA cannot read it."""
    rows = expert_rows(w_E)
    if rows is None or not matrix_fits(rows, block_shape):
        return None
    return descriptor(rows, block_shape)


def gate_up_pair_desc(w_EFH: torch.Tensor, block_n: int, block_k: int):
    """Descriptor over w_gate_up [E, 2F, H] seen as [2E, F, H] (gate of e at 2e, up at 2e + 1)
    with [2, BN, BK] boxes, or None where TMA cannot read it or one dot cannot take 2 BN."""
    E, two_f, H = w_EFH.shape
    f, row = two_f // 2, w_EFH.stride(1)
    if 2 * block_n > 256 or w_EFH.stride(2) != 1 or (E > 1 and w_EFH.stride(0) != two_f * row):
        return None
    pairs = w_EFH.as_strided((2 * E, f, H), (f * row, row, 1))
    # Alignment, row stride and box checks: those of the same rows as one 2-D matrix.
    if not matrix_fits(pairs.as_strided((2 * E * f, H), (row, 1)), (block_n, block_k)):
        return None
    return descriptor(pairs, (2, block_n, block_k))
