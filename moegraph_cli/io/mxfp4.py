"""MXFP4 (OCP microscaling FP4) dequantisation of checkpoint tensors, pure torch.

A quantised tensor W (HF layout [E, A, B], e.g. GPT-OSS's `gate_up_proj` [E, H, 2F]) is
stored as `W_blocks` uint8 [E, B, A / 32, 16] and `W_scales` uint8 [E, B, A / 32]: each row of
W^T in groups of 32 values, two FP4 (E2M1) codes a byte (the low nibble the even element, the
high nibble the odd one), and one E8M0 exponent per group (stored + 127). The value is
FP4[code] * 2^(scale - 127), computed in the target dtype and transposed back to [E, A, B]:
exactly transformers' `convert_moe_packed_tensors` (integrations/mxfp4.py), the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor is dequantised: `inspect` and `plan`
    import torch   # read checkpoint headers through checkpoint.py without it

QUANT_METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"  # suffixes of the two stored parts of a tensor
GROUP = 32  # values per scale
NAN_SCALE = 255  # E8M0's NaN: no valid tensor has it (checkpoint.py refuses it)
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(blocks shape, scales shape) storing an HF tensor of `shape` [E, A, B]; None when the
    tensor cannot be stored so (not 3-D, or A not a multiple of 32)."""
    if len(shape) != 3 or shape[1] % GROUP:
        return None
    e, a, b = shape
    return (e, b, a // GROUP, GROUP // 2), (e, b, a // GROUP)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [E, A, B] tensor of `blocks` [E, B, G, 16] and `scales` [E, B, G] in `dtype`."""
    import torch

    blocks = blocks.to(torch.uint8)
    exponents = scales.to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    *prefix, groups, width = blocks.shape
    rows = blocks.reshape(-1, width)
    out = torch.empty(rows.shape[0], width * 2, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(rows & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(rows >> 4).to(torch.int)]
    torch.ldexp(out, exponents.reshape(-1, 1), out=out)  # as transformers: the same rounding
    return out.view(*prefix, groups * width * 2).transpose(1, 2).contiguous()
