"""Checkpoint saving: moegraph state dicts (or tensors made one at a time) -> HF safetensors.

Saving always writes the per-expert spelling (what transformers 4.x and 5.x write; the name
table is hf_names.py), one file at a time and within a file one tensor at a time
(`write_checkpoint`: the caller hands each tensor over as it is written, so neither a state
dict nor `moegraph init`'s generator needs a whole shard in memory), byte for byte what
`safetensors.save_file` writes for the same tensors, each file atomically (outputs.py) and
with the permissions of a plain open(). `save_layout` says beforehand which tensors go to
which file and how many bytes that is. A slot with a `layout` (keys.py) is put back in its disk
layout; saving always writes unquantised tensors, in one floating dtype. A state dict is
checked against the model's names and shapes (models/common/shapes.py `param_shapes`) first.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from ..config import ModelConfig
from ..errors import CheckpointError, UsageError
from ..models.common.shapes import param_shapes
from .hf_names import (INDEX_FILE, SHARD_FILE, SINGLE_FILE, and_more, config_summary,
                       hf_to_moegraph_names, to_hf_layout)
from .outputs import leftover_target, write_atomically
from .safetensors_format import (BYTES_OF, LOADABLE_DTYPES, check_float_dtype, safetensors_dtype,
                                 shape_str, torch_dtype)

if TYPE_CHECKING:  # torch is imported where tensors are written
    import torch


def _check_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig,
                      shapes: Mapping[str, tuple[int, ...]]) -> None:
    missing = [k for k in shapes if k not in state_dict]
    if missing:
        raise CheckpointError(f"checkpoint: state dict is missing {missing[0]}"
                              + and_more(missing, "missing"))
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in state_dict
    unexpected = [k for k in state_dict if k not in shapes
                  and not (tied_head and k == "lm_head.weight")]
    if unexpected:
        raise CheckpointError(f"checkpoint: state dict tensor {unexpected[0]} is not a parameter "
                              f"of the config's model ({config_summary(cfg)})"
                              + and_more(unexpected, "unexpected"))
    for name, shape in shapes.items():
        got = tuple(state_dict[name].shape)
        if got != shape:
            raise CheckpointError(f"checkpoint: state dict tensor {name} has shape "
                                  f"{shape_str(got)}, config says {shape_str(shape)}")
    if tied_head and not _same_bits(state_dict["lm_head.weight"],
                                    state_dict["embed_tokens.weight"]):
        raise CheckpointError("checkpoint: state dict has an lm_head.weight that differs from "
                              "embed_tokens.weight, but the config ties them")
    for name in shapes:
        if not state_dict[name].is_floating_point():
            raise CheckpointError(f"checkpoint: state dict tensor {name} has dtype "
                                  f"{state_dict[name].dtype}; weights must be floating point")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, unlike torch.equal)."""
    import torch

    if a.dtype != b.dtype:
        return False
    as_bytes = lambda t: t.detach().cpu().contiguous().view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(a), as_bytes(b))


def _common_dtype(state_dict: Mapping[str, torch.Tensor], names: Iterable[str]) -> torch.dtype:
    names = list(names)
    first = names[0]
    for name in names:
        if state_dict[name].dtype != state_dict[first].dtype:
            raise CheckpointError(
                f"checkpoint: state dict mixes {state_dict[first].dtype} ({first}) and "
                f"{state_dict[name].dtype} ({name}); pass dtype= to save in one dtype")
    return state_dict[first].dtype


def _shards(sizes: list[tuple[str, int]], max_bytes: int | None) -> list[list[str]]:
    """Greedy, in table order so a layer's tensors sit in neighbouring files; a tensor larger
    than max_bytes gets a file of its own."""
    if max_bytes is None or sum(n for _, n in sizes) <= max_bytes:
        return [[k for k, _ in sizes]]
    shards, current, used = [], [], 0
    for key, n in sizes:
        if current and used + n > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(key)
        used += n
    return shards + [current] if current else shards


@dataclass(frozen=True)
class SaveLayout:
    """Which HF tensors go to which file, for one config, dtype and shard size."""

    files: tuple[str, ...]
    shards: tuple[tuple[str, ...], ...]     # HF names per file, in table order
    shapes: dict[str, tuple[int, ...]]      # HF name -> shape on disk
    st_dtype: str                           # safetensors dtype name, e.g. "BF16"

    @property
    def tensor_bytes(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values()) * BYTES_OF[self.st_dtype]

    @property
    def total_bytes(self) -> int:
        """Bytes on disk, headers and index included (config.json aside)."""
        headers = sum(len(_safetensors_header([(k, self.shapes[k]) for k in keys],
                                              self.st_dtype)) for keys in self.shards)
        index = 0 if len(self.files) == 1 else 120 * len(self.shapes) + 1024
        return self.tensor_bytes + headers + index


def save_layout(cfg: ModelConfig, dtype, max_shard_bytes: int | None = 5 * 2**30) -> SaveLayout:
    """The files `save_checkpoint` writes for `cfg` in `dtype` (a torch dtype or its name)."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise UsageError(f"max_shard_bytes must be positive or None, got {max_shard_bytes}")
    st_dtype = safetensors_dtype(dtype)
    if st_dtype is None:
        raise UsageError(f"save dtype {dtype} is not one of float32, bfloat16, float16")
    table = hf_to_moegraph_names(cfg)
    sizes = [(key, math.prod(slot.shape) * BYTES_OF[st_dtype]) for key, slot in table.items()]
    shards = _shards(sizes, max_shard_bytes)
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors"
                                          for k in range(1, n + 1)]
    return SaveLayout(tuple(files), tuple(tuple(k) for k in shards),
                      {key: slot.shape for key, slot in table.items()}, st_dtype)


def _safetensors_header(entries: list[tuple[str, tuple[int, ...]]], st_dtype: str) -> bytes:
    """The 8-byte length and JSON header of a one-dtype safetensors file holding `entries`, laid
    out as safetensors.save_file lays it out: tensors sorted by name, compact JSON, padded with
    spaces so the data starts 8-byte aligned."""
    itemsize = BYTES_OF[st_dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in sorted(entries):
        n = math.prod(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset,
                                                                                 offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _tensor_bytes(t: "torch.Tensor") -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (and without numpy)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr()))


def _write_safetensors(tmp: Path, entries: list[tuple[str, tuple[int, ...]]], st_dtype: str,
                       tensor_of: Callable[[str], "torch.Tensor"],
                       on_tensor: Callable[[str, int], None] | None) -> None:
    """Stream one safetensors file: the header, then each tensor as `tensor_of(name)` makes it,
    so only one tensor is in memory at a time."""
    import torch

    if sys.byteorder != "little":
        raise CheckpointError("checkpoint: safetensors is little-endian; writing on a "
                              "big-endian host is not supported")
    want_dtype = torch_dtype(st_dtype)
    with open(tmp, "wb") as f:
        f.write(_safetensors_header(entries, st_dtype))
        for name, shape in sorted(entries):
            t = tensor_of(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != want_dtype or t.device.type != "cpu":
                raise CheckpointError(f"checkpoint: tensor {name} to write is "
                                      f"{t.dtype} {shape_str(t.shape)} on {t.device}, "
                                      f"expected {want_dtype} {shape_str(shape)} on cpu")
            t = t.contiguous()
            f.write(_tensor_bytes(t))
            if on_tensor is not None:
                on_tensor(name, t.nbytes)
            del t


def write_checkpoint(cfg: ModelConfig, path: str | os.PathLike, layout: SaveLayout,
                     tensor_of: Callable[[str], "torch.Tensor"],
                     on_tensor: Callable[[str, int], None] | None = None,
                     written: list[Path] | None = None) -> list[Path]:
    """Write the checkpoint of `layout`, one file at a time and within a file one tensor at a
    time: `tensor_of(hf_name)` returns that tensor (CPU, the layout's dtype, the disk shape).
    Each file is written atomically. `on_tensor(hf_name, nbytes)` follows progress; `written`
    (when given) lists each finished file as soon as it is in place, for a caller's cleanup.
    Weight files of an earlier save that this one does not overwrite are removed at the end,
    and so are the temporary files of an earlier save's checkpoint files that never finished
    (outputs.py `leftover_temporaries`: a killed process's)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    done = [] if written is None else written
    for file, keys in zip(layout.files, layout.shards):
        entries = [(key, layout.shapes[key]) for key in keys]
        write_atomically(root / file, lambda tmp: _write_safetensors(
            tmp, entries, layout.st_dtype, tensor_of, on_tensor))
        done.append(root / file)
    if len(layout.files) > 1:
        index = {"metadata": {"total_size": layout.tensor_bytes},
                 "weight_map": {key: file for file, keys in zip(layout.files, layout.shards)
                                for key in keys}}
        write_atomically(root / INDEX_FILE,
                         lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n"))
        done.append(root / INDEX_FILE)

    dtype_name = LOADABLE_DTYPES[layout.st_dtype]
    config = {**cfg.to_hf_dict(), "torch_dtype": dtype_name, "dtype": dtype_name}
    write_atomically(root / "config.json",
                     lambda tmp: tmp.write_text(json.dumps(config, indent=2, sort_keys=True)
                                                + "\n"))
    done.append(root / "config.json")

    for old in root.iterdir():
        target = leftover_target(old.name)  # None: not an unfinished write's temporary file
        if target is None:
            stale = old.name in (SINGLE_FILE, INDEX_FILE) or SHARD_FILE.fullmatch(old.name)
        else:
            stale = target in (SINGLE_FILE, INDEX_FILE, "config.json") \
                or SHARD_FILE.fullmatch(target)
        if stale and old not in done:
            old.unlink()
    return list(done)


def save_checkpoint(state_dict: Mapping[str, "torch.Tensor"], cfg: ModelConfig,
                    path: str | os.PathLike, max_shard_bytes: int | None = 5 * 2**30,
                    dtype: "torch.dtype | None" = None) -> list[Path]:
    """Write an HF checkpoint: config.json, and model.safetensors or shards plus index.

    Experts are written one tensor per expert. dtype None keeps the state dict's dtype (which
    must then be one dtype throughout). Shard sizes count tensor bytes, as HF does. Weight files
    of an earlier save in `path` that this save does not overwrite are removed, so the directory
    never holds two layouts. Every file is written atomically with the permissions of a plain
    open(). Returns the files written."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise UsageError(f"max_shard_bytes must be positive or None, got {max_shard_bytes}")
    shapes = param_shapes(cfg)
    _check_state_dict(state_dict, cfg, shapes)
    save_dtype = _common_dtype(state_dict, shapes) if dtype is None else dtype
    check_float_dtype(save_dtype, "save dtype")
    layout = save_layout(cfg, save_dtype, max_shard_bytes)
    table = hf_to_moegraph_names(cfg)

    def hf_tensor(hf_name: str) -> "torch.Tensor":
        slot = table[hf_name]
        t = state_dict[slot.name].detach()[slot.index]
        return to_hf_layout(t.to(device="cpu", dtype=save_dtype), slot.layout).contiguous()

    return write_checkpoint(cfg, path, layout, hf_tensor)
