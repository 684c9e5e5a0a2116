"""The safetensors format as moegraph reads it: dtype tables and a header reader that checks.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape, data_offsets relative to the data region; an optional `__metadata__` map of
strings), then the data region, which the tensors tile exactly. `read_safetensors_header`
reads only the header and makes every check safetensors makes, plus the file size, so a later
`safe_open` cannot fail on the format and a truncated file is named before any large read.

A checkpoint moegraph loads or saves holds one floating dtype (`LOADABLE_DTYPES`: F32, BF16
or F16); every other safetensors dtype is known here only to check byte spans (MXFP4's U8
blocks and scales, mxfp4.py, among them). No torch import: `torch_dtype` imports it when asked.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError, UsageError
from .documents import DuplicateKey, unique_pairs

if TYPE_CHECKING:
    import torch

# Safetensors dtype -> the torch dtype (by name) moegraph loads it as. Anything else is refused.
LOADABLE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
BYTES_OF = {"F32": 4, "BF16": 2, "F16": 2}  # bytes per element of each loadable dtype
# Bits per element of every safetensors dtype, to check each tensor's byte span.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def torch_dtype(safetensors_dtype: str) -> "torch.dtype":
    """The torch dtype of a loadable safetensors dtype name ("BF16" -> torch.bfloat16)."""
    import torch

    return getattr(torch, LOADABLE_DTYPES[safetensors_dtype])


def safetensors_dtype(dtype) -> str | None:
    """The safetensors name of a loadable torch dtype (torch.bfloat16 -> "BF16"), else None."""
    name = str(dtype).removeprefix("torch.")
    return next((k for k, v in LOADABLE_DTYPES.items() if v == name), None)


def check_float_dtype(dtype, what: str) -> None:
    """Refuse a load or save dtype that is not one of the loadable ones."""
    if safetensors_dtype(dtype) is None:
        raise UsageError(f"{what} {dtype} is not one of torch.float32, torch.bfloat16, "
                         "torch.float16")


def shape_str(shape) -> str:
    """A shape as messages write it: [768, 2048]."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass(frozen=True)
class HeaderEntry:
    dtype: str                  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    offsets: tuple[int, int]    # absolute byte range [begin, end) in the file


def read_safetensors_header(file: Path) -> dict[str, HeaderEntry]:
    """Tensor name -> HeaderEntry, reading only the header, with every check safetensors makes
    (so a later safe_open cannot fail on the format) plus a file-size check."""
    file = Path(file)
    name, size = file.name, file.stat().st_size

    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint: {name} has a corrupt header: {why}")

    if size < 8:
        raise CheckpointError(f"checkpoint: {name} is truncated: {size} bytes is too short for "
                              "a safetensors header")
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > size - 8 or header_len > _MAX_HEADER_BYTES:
            raise corrupt(f"header length {header_len} does not fit in the file's {size} bytes")
        raw = f.read(header_len)

    try:  # a name twice: safetensors' own reader would keep one of the two silently
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs)
    except DuplicateKey as e:
        raise corrupt(f"key {e.key} appears twice") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise corrupt(f"not valid JSON ({getattr(e, 'msg', type(e).__name__)})") from None
    if not isinstance(header, dict):
        raise corrupt("not a JSON object")
    meta = header.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise corrupt("__metadata__ is not a map of strings")

    data_start = 8 + header_len
    entries = {}
    for key, info in header.items():
        ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
              and isinstance(info.get("shape"), list) and isinstance(info.get("data_offsets"), list)
              and all(type(d) is int and d >= 0 for d in info["shape"])
              and len(info["data_offsets"]) == 2
              and all(type(o) is int and o >= 0 for o in info["data_offsets"]))
        if not ok:
            raise corrupt(f"tensor {key} needs dtype, shape and data_offsets")
        begin, end = info["data_offsets"]
        bits = _DTYPE_BITS.get(info["dtype"])
        if bits is None:
            raise corrupt(f"tensor {key} has unknown dtype {info['dtype']!r}")
        need_bits = math.prod(info["shape"]) * bits
        if end < begin or need_bits % 8 or end - begin != need_bits // 8:
            raise corrupt(f"tensor {key} spans bytes {begin}..{end} but {info['dtype']} "
                          f"{shape_str(info['shape'])} needs {need_bits // 8}")
        entries[key] = HeaderEntry(info["dtype"], tuple(info["shape"]),
                                   (data_start + begin, data_start + end))

    # Tensors must tile the data region exactly, in some order (safetensors' own rule).
    pos, prev = data_start, None
    for key, entry in sorted(entries.items(), key=lambda kv: kv[1].offsets):
        begin, end = entry.offsets
        if begin < pos:
            raise corrupt(f"tensors {prev} and {key} overlap")
        if begin > pos:
            raise corrupt(f"{begin - pos} unused bytes before tensor {key}")
        if end > size:
            raise CheckpointError(f"checkpoint: {name} is truncated: tensor {key} ends at byte "
                                  f"{end} but the file has {size} bytes")
        pos, prev = end, key
    if pos != size:
        raise corrupt(f"{size - pos} bytes after the last tensor")
    return entries

