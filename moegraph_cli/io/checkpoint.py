"""Checkpoint I/O: HF safetensors on disk <-> moegraph state dicts in memory.

The HF tensor names are the family's (torchtitan's `from_hf_map` idea): `hf_to_moegraph_names`
returns the family's key map (models/<family>.py), which maps each HF tensor to a moegraph name
and to where in that tensor it goes. Experts are stacked in memory and stored one tensor per
expert on disk, e.g. for Qwen3-MoE:

    model.layers.{i}.mlp.experts.{e}.gate_proj.weight [F, H] -> layers.{i}.moe.w_gate_up[e, :F]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight   [F, H] -> layers.{i}.moe.w_gate_up[e, F:]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight [H, F] -> layers.{i}.moe.w_down[e]

Loading also accepts the fused spelling some writers use, per layer (never mixed in a layer):
`model.layers.{i}.{experts}.gate_up_proj` [E, 2F, H] and `...{experts}.down_proj` [E, H, F].
Saving always writes the per-expert spelling (what transformers 4.x and 5.x write), one file
at a time and within a file one tensor at a time (`write_checkpoint`: the caller hands each
tensor over as it is written, so neither a state dict nor `moegraph init`'s generator needs a
whole shard in memory), byte for byte what `safetensors.save_file` writes for the same tensors,
each file atomically (outputs.py) and with the permissions of a plain open().

Loading is two steps. `plan_load` reads only the safetensors headers (8-byte little-endian
length, then JSON) and checks everything a large read could trip on: names, shapes, dtypes,
offsets, file sizes and the shard index. `load_state_dict` then reads each file once, in offset
order, through `safetensors.safe_open`. Every problem is a one-line `CheckpointError` naming the
tensor and the file.

A checkpoint holds one floating dtype (F32, BF16 or F16) throughout, as HF writes them. A
slot with a `layout` (keys.py) is transposed / de-interleaved on load and put back on save.
Tensors quantised to MXFP4 (`W_blocks` + `W_scales` uint8 in place of W, mxfp4.py; GPT-OSS's
hub checkpoints, `quantization_config.quant_method` "mxfp4") are dequantised to the load dtype
while loading (only in a family that lists mxfp4; a scale of 255, E8M0's NaN, is refused);
saving always writes unquantised tensors.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from safetensors import SafetensorError, safe_open  # the Rust reader alone: no torch import

from ..config import ModelConfig
from ..models.common.keys import Slot
from ..errors import EXIT_USAGE, CheckpointError, UsageError
from .mxfp4 import BLOCKS, QUANT_METHOD, SCALES, packed_shapes
from .outputs import write_atomically

if TYPE_CHECKING:  # torch is imported where tensors are made: reading headers needs none
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# Safetensors dtype -> the torch dtype (by name) moegraph loads it as. Anything else is refused.
LOADABLE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_BYTES_OF = {"F32": 4, "BF16": 2, "F16": 2}


def torch_dtype(safetensors_dtype: str) -> "torch.dtype":
    """The torch dtype of a loadable safetensors dtype name ("BF16" -> torch.bfloat16)."""
    import torch

    return getattr(torch, LOADABLE_DTYPES[safetensors_dtype])


def safetensors_dtype(dtype) -> str | None:
    """The safetensors name of a loadable torch dtype (torch.bfloat16 -> "BF16"), else None."""
    name = str(dtype).removeprefix("torch.")
    return next((k for k, v in LOADABLE_DTYPES.items() if v == name), None)
# Bits per element of every safetensors dtype, to check each tensor's byte span.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


# -- the name table ------------------------------------------------------------------------


def hf_to_moegraph_names(cfg: ModelConfig, fused_layers: Iterable[int] = ()) -> dict[str, Slot]:
    """HF tensor name -> Slot, in save order (layer by layer): the family's key map. Layers in
    `fused_layers` use the fused expert spelling; the others one tensor per expert."""
    return cfg.family.key_map(cfg, set(fused_layers))


def moegraph_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """moegraph state-dict name -> shape. The fused spelling maps one to one, so it is this."""
    every_layer = range(cfg.num_hidden_layers)
    return {s.name: s.target_shape
            for s in hf_to_moegraph_names(cfg, fused_layers=every_layer).values()}


def to_moegraph_layout(t: "torch.Tensor", layout: tuple[str, ...]) -> "torch.Tensor":
    """A disk tensor in moegraph's layout: `layout`'s steps in order (keys.py)."""
    for step in layout:
        if step == "transpose":
            t = t.transpose(-1, -2)
        elif step == "deinterleave":
            t = t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        else:
            raise ValueError(f"unknown layout step {step!r}")
    return t.contiguous() if layout else t


def to_hf_layout(t: "torch.Tensor", layout: tuple[str, ...]) -> "torch.Tensor":
    """A moegraph tensor in its disk layout: `layout`'s steps undone in reverse order."""
    for step in reversed(layout):
        if step == "transpose":
            t = t.transpose(-1, -2)
        elif step == "deinterleave":
            t = t.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        else:
            raise ValueError(f"unknown layout step {step!r}")
    return t.contiguous() if layout else t


def _config_summary(cfg: ModelConfig) -> str:
    return (f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts, mlp_only_layers "
            f"{list(cfg.mlp_only_layers)}, decoder_sparse_step {cfg.decoder_sparse_step}, "
            f"tie_word_embeddings {str(cfg.tie_word_embeddings).lower()}")


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _and_more(items: list, what: str) -> str:
    return f" (and {len(items) - 1} more {what})" if len(items) > 1 else ""


# -- safetensors headers -------------------------------------------------------------------


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

    def no_duplicate_keys(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise corrupt(f"key {dup} appears twice")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
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
                          f"{_shape_str(info['shape'])} needs {need_bits // 8}")
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


# -- planning a load ----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRead:
    """One HF tensor to read and where it goes."""

    hf_name: str
    file: str                   # file name inside the checkpoint directory
    offsets: tuple[int, int]    # absolute byte range [begin, end) in the file
    dtype: str                  # safetensors dtype name
    shape: tuple[int, ...]      # shape on disk
    target: str                 # moegraph name
    index: tuple                # where in the target (see Slot)
    layout: tuple[str, ...] = ()  # disk -> moegraph steps (see Slot)
    part: str = ""              # MXFP4: "_blocks" or "_scales" of `target` (mxfp4.py)

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


@dataclass(frozen=True)
class LoadPlan:
    """A validated checkpoint: what to read from which file, in read order."""

    root: Path
    files: tuple[str, ...]              # read order
    reads: tuple[TensorRead, ...]       # by file, then by offset
    st_dtype: str                       # the checkpoint's one dtype, safetensors name ("BF16")
    shapes: dict[str, tuple[int, ...]]  # moegraph name -> shape, the result's order
    fused_layers: frozenset[int]        # layers stored with the fused expert spelling

    @property
    def dtype(self) -> "torch.dtype":
        return torch_dtype(self.st_dtype)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.reads)

    def reads_of(self, file: str) -> list[TensorRead]:
        return [r for r in self.reads if r.file == file]


def _find_layout(path: Path) -> tuple[Path, str | None]:
    """(checkpoint dir, the single file's name or None when sharded by the index)."""
    if not path.exists():  # a missing file is exit 2 whichever file it is
        raise CheckpointError(f"checkpoint {path} does not exist", EXIT_USAGE)
    if path.is_file():
        if path.name == INDEX_FILE or path.suffix == ".safetensors":
            return path.parent, (None if path.name == INDEX_FILE else path.name)
        raise CheckpointError(f"checkpoint {path} is neither a .safetensors file nor {INDEX_FILE}")
    single, index = (path / SINGLE_FILE).is_file(), (path / INDEX_FILE).is_file()
    if single and index:
        raise CheckpointError(f"checkpoint {path} has both {SINGLE_FILE} and {INDEX_FILE}; "
                              "remove the stale one")
    if not (single or index):
        raise CheckpointError(f"checkpoint {path} has no {SINGLE_FILE} or {INDEX_FILE}",
                              EXIT_USAGE)
    return path, (SINGLE_FILE if single else None)


def _read_index(root: Path) -> dict[str, str]:
    """weight_map of the shard index: tensor -> file, each file checked to exist."""
    try:
        index = json.loads((root / INDEX_FILE).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint: {INDEX_FILE} is not valid JSON ({e.msg} at line "
                              f"{e.lineno})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"checkpoint: {INDEX_FILE} is not UTF-8 text") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not (isinstance(weight_map, dict)
            and all(isinstance(v, str) for v in weight_map.values())):
        raise CheckpointError(f"checkpoint: {INDEX_FILE} has no weight_map of tensor -> file")
    checked = set()
    for tensor, file in weight_map.items():
        if file in checked:
            continue
        if file in ("", ".", "..") or Path(file).name != file:
            raise CheckpointError(f"checkpoint: {INDEX_FILE} names file {file!r} for tensor "
                                  f"{tensor}, which is not a file in the checkpoint directory")
        if not (root / file).is_file():
            raise CheckpointError(f"checkpoint: {INDEX_FILE} names {file} for tensor {tensor}, "
                                  f"but {root / file} does not exist", EXIT_USAGE)
        checked.add(file)
    return weight_map


def _disk_tensors(root: Path, single: str | None) -> tuple[dict[str, tuple[str, HeaderEntry]], str]:
    """HF name -> (file, header entry) over the whole checkpoint, and the name of the file that
    lists the tensors (for 'missing' messages)."""
    if single is not None:
        return {k: (single, e) for k, e in read_safetensors_header(root / single).items()}, single
    weight_map = _read_index(root)
    disk = {}
    for file in sorted(set(weight_map.values())):
        for key, entry in read_safetensors_header(root / file).items():
            listed = weight_map.get(key)
            if listed is None:
                raise CheckpointError(f"checkpoint: tensor {key} in {file} is not listed in "
                                      f"{INDEX_FILE}")
            if listed != file:
                raise CheckpointError(f"checkpoint: tensor {key} is in {file} but {INDEX_FILE} "
                                      f"says {listed}")
            disk[key] = (file, entry)
    for key, file in weight_map.items():
        if key not in disk:
            raise CheckpointError(f"checkpoint: tensor {key} is not in {file}, where "
                                  f"{INDEX_FILE} says it is")
    return disk, INDEX_FILE


def _fused_layers(disk: Mapping[str, tuple[str, HeaderEntry]], cfg: ModelConfig) -> set[int]:
    """MoE layers stored with the fused expert spelling; a layer mixing both is an error."""
    experts = cfg.family.experts_prefix
    per_expert_key = re.compile(r"model\.layers\.(\d+)\." + re.escape(experts) + r"\d+\.")
    per_expert = {}
    for key in disk:
        m = per_expert_key.match(key)
        if m:
            per_expert.setdefault(int(m.group(1)), key)
    fused = set()
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        prefix = f"model.layers.{i}.{experts}"
        found = [k for k in (prefix + "gate_up_proj", prefix + "down_proj") if k in disk]
        if not found:
            continue
        if i in per_expert:
            other = per_expert[i]
            raise CheckpointError(
                f"checkpoint: tensor {found[0]} in {disk[found[0]][0]} is the fused expert "
                f"spelling but layer {i} also has {other} in {disk[other][0]}; a layer must use "
                "one spelling")
        fused.add(i)
    return fused


def plan_load(path: str | os.PathLike, cfg: ModelConfig) -> LoadPlan:
    """Check a checkpoint against `cfg` from its headers alone; see the module docstring."""
    root, single = _find_layout(Path(path))
    disk, listing = _disk_tensors(root, single)
    fused = _fused_layers(disk, cfg)
    table = hf_to_moegraph_names(cfg, fused)

    # MXFP4: a tensor stored as its blocks and scales (mxfp4.py) in place of itself.
    packed = {k for k in table if k not in disk and k + BLOCKS in disk and k + SCALES in disk}
    for key in sorted(k for k in table if k not in disk):
        parts = [key + suffix for suffix in (BLOCKS, SCALES) if key + suffix in disk]
        if len(parts) == 1:
            other = key + (SCALES if parts[0].endswith(BLOCKS) else BLOCKS)
            raise CheckpointError(f"checkpoint: tensor {other} is missing from {listing}; "
                                  f"{parts[0]} in {disk[parts[0]][0]} needs it (mxfp4 stores "
                                  f"{key} as both)")
        if parts and QUANT_METHOD not in cfg.family.quant_methods:
            raise CheckpointError(f"checkpoint: tensor {key} is stored as mxfp4 ({parts[0]} in "
                                  f"{disk[parts[0]][0]}), which {cfg.model_type} checkpoints do "
                                  "not use")
    missing = [k for k in table if k not in disk and k not in packed]
    if missing:
        raise CheckpointError(f"checkpoint: tensor {missing[0]} is missing from {listing}"
                              + _and_more(missing, "missing"))
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in disk
    parts = {k + suffix: k for k in packed for suffix in (BLOCKS, SCALES)}
    unexpected = [k for k in disk if k not in table and k not in parts
                  and not (tied_head and k == "lm_head.weight")]
    if unexpected:
        key = unexpected[0]
        raise CheckpointError(f"checkpoint: tensor {key} in {disk[key][0]} is not a parameter of "
                              f"the config's model ({_config_summary(cfg)})"
                              + _and_more(unexpected, "unexpected"))
    expected = {k: s.shape for k, s in table.items()}
    if tied_head:  # accepted and ignored, but only in the shape of the embedding
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for key, shape in expected.items():
        if key in packed:
            want = packed_shapes(shape)
            for suffix, part_shape in zip((BLOCKS, SCALES), want or ()):
                file, entry = disk[key + suffix]
                if entry.shape != part_shape or entry.dtype != "U8":
                    raise CheckpointError(
                        f"checkpoint: tensor {key + suffix} in {file} is {entry.dtype} "
                        f"{_shape_str(entry.shape)}, the mxfp4 {suffix[1:]} of {key} "
                        f"{_shape_str(shape)} are U8 {_shape_str(part_shape)}")
            if want is None:
                raise CheckpointError(f"checkpoint: tensor {key} {_shape_str(shape)} cannot be "
                                      "stored as mxfp4 blocks and scales")
            continue
        file, entry = disk[key]
        if entry.shape != shape:
            raise CheckpointError(f"checkpoint: tensor {key} in {file} has shape "
                                  f"{_shape_str(entry.shape)}, config says {_shape_str(shape)}")

    first = next(k for k in table if k not in packed)
    ref_file, ref = disk[first]
    for key in table:
        if key in packed:
            continue
        file, entry = disk[key]
        if entry.dtype not in LOADABLE_DTYPES:
            raise CheckpointError(f"checkpoint: tensor {key} in {file} has dtype {entry.dtype}; "
                                  f"moegraph loads {', '.join(LOADABLE_DTYPES)}")
        if entry.dtype != ref.dtype:
            raise CheckpointError(f"checkpoint: tensor {key} in {file} has dtype {entry.dtype} "
                                  f"but {first} in {ref_file} has {ref.dtype}; a checkpoint "
                                  "holds one dtype")

    unsorted = []
    for key, slot in table.items():
        for name, part in ((key + BLOCKS, BLOCKS), (key + SCALES, SCALES)) if key in packed \
                else ((key, ""),):
            file, entry = disk[name]
            unsorted.append(TensorRead(name, file, entry.offsets, entry.dtype, entry.shape,
                                       slot.name, slot.index, slot.layout, part))
    reads = sorted(unsorted, key=lambda r: (r.file, r.offsets))
    return LoadPlan(root=root, files=tuple(dict.fromkeys(r.file for r in reads)),
                    reads=tuple(reads), st_dtype=ref.dtype,
                    shapes=moegraph_shapes(cfg), fused_layers=frozenset(fused))


# -- loading ------------------------------------------------------------------------------


def _check_float_dtype(dtype, what: str) -> None:
    if safetensors_dtype(dtype) is None:
        raise UsageError(f"{what} {dtype} is not one of torch.float32, torch.bfloat16, "
                         "torch.float16")


def load_state_dict(path: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """moegraph state dict (experts stacked) from an HF checkpoint directory or file.

    dtype None keeps the checkpoint's dtype; otherwise tensors are cast while loading. Each file
    is opened once and its tensors read in offset order."""
    import torch

    plan = plan_load(path, cfg)
    out_dtype = plan.dtype if dtype is None else dtype
    _check_float_dtype(out_dtype, "load dtype")
    stacked = {r.target for r in plan.reads if r.index != ()}
    state = {name: torch.empty(plan.shapes[name], dtype=out_dtype, device=device)
             for name in stacked}
    pending: dict = {}
    for file in plan.files:
        try:
            with safe_open(plan.root / file, framework="pt", device="cpu") as f:
                for r in plan.reads_of(file):
                    t = read_tensor(r, f.get_tensor(r.hf_name), pending, out_dtype)
                    if t is None:  # the first of an MXFP4 pair
                        continue
                    if r.index == ():
                        state[r.target] = t.to(device=device, dtype=out_dtype)
                    else:
                        state[r.target][r.index].copy_(t)
        except (SafetensorError, OSError) as e:  # the file changed since plan_load read it
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"checkpoint: reading {file} failed: {first_line}") from None
    return {name: state[name] for name in plan.shapes}


def read_tensor(r: TensorRead, t: "torch.Tensor", pending: dict,
                dtype: "torch.dtype") -> "torch.Tensor | None":
    """Read `r`'s tensor `t` (or rows of it) in moegraph's layout. An MXFP4 part waits in
    `pending` for its other part (None); with both, the tensor dequantised to `dtype`."""
    if r.part:
        from .mxfp4 import NAN_SCALE, dequantize

        if r.part == SCALES and bool((t == NAN_SCALE).any()):  # it would load as inf / NaN
            raise CheckpointError(f"checkpoint: tensor {r.hf_name} in {r.file} holds the E8M0 "
                                  f"NaN scale {NAN_SCALE}; mxfp4 scales are 0..254")
        parts = pending.setdefault(r.target + str(r.index), {})
        parts[r.part] = t
        if len(parts) < 2:
            return None
        del pending[r.target + str(r.index)]
        t = dequantize(parts[BLOCKS], parts[SCALES], dtype)
    return to_moegraph_layout(t, r.layout)


# -- saving -------------------------------------------------------------------------------


def _check_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig,
                      shapes: Mapping[str, tuple[int, ...]]) -> None:
    missing = [k for k in shapes if k not in state_dict]
    if missing:
        raise CheckpointError(f"checkpoint: state dict is missing {missing[0]}"
                              + _and_more(missing, "missing"))
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in state_dict
    unexpected = [k for k in state_dict if k not in shapes
                  and not (tied_head and k == "lm_head.weight")]
    if unexpected:
        raise CheckpointError(f"checkpoint: state dict tensor {unexpected[0]} is not a parameter "
                              f"of the config's model ({_config_summary(cfg)})"
                              + _and_more(unexpected, "unexpected"))
    for name, shape in shapes.items():
        got = tuple(state_dict[name].shape)
        if got != shape:
            raise CheckpointError(f"checkpoint: state dict tensor {name} has shape "
                                  f"{_shape_str(got)}, config says {_shape_str(shape)}")
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
        return sum(math.prod(s) for s in self.shapes.values()) * _BYTES_OF[self.st_dtype]

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
    sizes = [(key, math.prod(slot.shape) * _BYTES_OF[st_dtype]) for key, slot in table.items()]
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
    itemsize = _BYTES_OF[st_dtype]
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
                                      f"{t.dtype} {_shape_str(t.shape)} on {t.device}, "
                                      f"expected {want_dtype} {_shape_str(shape)} on cpu")
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
    Weight files of an earlier save that this one does not overwrite are removed at the end."""
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
        stale_layout = old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.fullmatch(old.name)
        if stale_layout and old not in done:
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
    shapes = moegraph_shapes(cfg)
    _check_state_dict(state_dict, cfg, shapes)
    save_dtype = _common_dtype(state_dict, shapes) if dtype is None else dtype
    _check_float_dtype(save_dtype, "save dtype")
    layout = save_layout(cfg, save_dtype, max_shard_bytes)
    table = hf_to_moegraph_names(cfg)

    def hf_tensor(hf_name: str) -> "torch.Tensor":
        slot = table[hf_name]
        t = state_dict[slot.name].detach()[slot.index]
        return to_hf_layout(t.to(device="cpu", dtype=save_dtype), slot.layout).contiguous()

    return write_checkpoint(cfg, path, layout, hf_tensor)
