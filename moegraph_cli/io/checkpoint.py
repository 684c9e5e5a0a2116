"""Checkpoint loading: HF safetensors on disk -> moegraph state dicts in memory.

The HF names, and where each tensor goes in moegraph's state dict, are the name table's
(hf_names.py); the shapes the model expects are the config's and the family's
(models/common/shapes.py `param_shapes`). Loading also accepts the fused expert spelling some
writers use, per layer (never mixed in a layer): `model.layers.{i}.{experts}.gate_up_proj`
[E, 2F, H] and `...{experts}.down_proj` [E, H, F]. Saving is checkpoint_save.py; loading only
this rank's part of each tensor, checkpoint_local.py.

Loading is two steps. `plan_load` reads only the safetensors headers (safetensors_format.py)
and checks everything a large read could trip on: names, shapes, dtypes, offsets, file sizes
and the shard index. `load_state_dict` then reads each file once, in offset order, through
`safetensors.safe_open`. Every problem is a one-line `CheckpointError` naming the tensor and
the file. The commands load with `check_finite`: a NaN or an infinity among the values read is
such an error too (`refuse_non_finite`: one scan, one host sync, after the read).

A checkpoint holds one floating dtype (F32, BF16 or F16) throughout, as HF writes them. A
slot with a `layout` (keys.py) is transposed / de-interleaved on load. Tensors quantised to
MXFP4 (`W_blocks` + `W_scales` uint8 in place of W, mxfp4.py; GPT-OSS's hub checkpoints,
`quantization_config.quant_method` "mxfp4") are dequantised to the load dtype while loading
(only in a family that lists mxfp4; a scale of 255, E8M0's NaN, is refused).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from safetensors import SafetensorError, safe_open  # the Rust reader alone: no torch import

from ..config import ModelConfig
from ..errors import EXIT_USAGE, CheckpointError, one_line
from .documents import DuplicateKey, duplicate_line, show, unique_pairs
from ..models.common.shapes import param_shapes
from .hf_names import (INDEX_FILE, SINGLE_FILE, and_more, config_summary, hf_to_moegraph_names,
                       to_moegraph_layout)
from .mxfp4 import BLOCKS, QUANT_METHOD, SCALES, packed_shapes
from .safetensors_format import (LOADABLE_DTYPES, HeaderEntry, check_float_dtype,
                                 read_safetensors_header, shape_str, torch_dtype)

if TYPE_CHECKING:  # torch is imported where tensors are made: reading headers needs none
    import torch


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
        text = (root / INDEX_FILE).read_text()
        index = json.loads(text, object_pairs_hook=unique_pairs)  # a key twice is refused
    except DuplicateKey as e:
        raise CheckpointError(f"checkpoint: {INDEX_FILE} is not valid JSON (duplicate key "
                              f"{show(e.key)}{duplicate_line(text)})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint: {INDEX_FILE} is not valid JSON ({e.msg} at line "
                              f"{e.lineno})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"checkpoint: {INDEX_FILE} is not UTF-8 text") from None
    except RecursionError:
        raise CheckpointError(f"checkpoint: {INDEX_FILE} is not valid JSON (nested too "
                              "deeply)") from None
    except ValueError as e:  # e.g. an integer with too many digits
        raise CheckpointError(f"checkpoint: {INDEX_FILE} is not valid JSON "
                              f"({one_line(str(e))})") from None
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
    table = hf_to_moegraph_names(cfg, fused)  # HF name -> slot and shape on disk
    shapes = param_shapes(cfg)  # what the model holds: the result's names and shapes

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
                              + and_more(missing, "missing"))
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in disk
    parts = {k + suffix: k for k in packed for suffix in (BLOCKS, SCALES)}
    unexpected = [k for k in disk if k not in table and k not in parts
                  and not (tied_head and k == "lm_head.weight")]
    if unexpected:
        key = unexpected[0]
        raise CheckpointError(f"checkpoint: tensor {key} in {disk[key][0]} is not a parameter of "
                              f"the config's model ({config_summary(cfg)})"
                              + and_more(unexpected, "unexpected"))
    expected = {k: s.shape for k, s in table.items()}
    if tied_head:  # accepted and ignored, but only in the shape of the embedding
        expected["lm_head.weight"] = shapes["embed_tokens.weight"]
    for key, shape in expected.items():
        if key in packed:
            want = packed_shapes(shape)
            for suffix, part_shape in zip((BLOCKS, SCALES), want or ()):
                file, entry = disk[key + suffix]
                if entry.shape != part_shape or entry.dtype != "U8":
                    raise CheckpointError(
                        f"checkpoint: tensor {key + suffix} in {file} is {entry.dtype} "
                        f"{shape_str(entry.shape)}, the mxfp4 {suffix[1:]} of {key} "
                        f"{shape_str(shape)} are U8 {shape_str(part_shape)}")
            if want is None:
                raise CheckpointError(f"checkpoint: tensor {key} {shape_str(shape)} cannot be "
                                      "stored as mxfp4 blocks and scales")
            continue
        file, entry = disk[key]
        if entry.shape != shape:
            raise CheckpointError(f"checkpoint: tensor {key} in {file} has shape "
                                  f"{shape_str(entry.shape)}, config says {shape_str(shape)}")

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
                    shapes=shapes, fused_layers=frozenset(fused))


# -- loading ------------------------------------------------------------------------------


def load_state_dict(path: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu",
                    check_finite: bool = False) -> dict[str, torch.Tensor]:
    """moegraph state dict (experts stacked) from an HF checkpoint directory or file.

    dtype None keeps the checkpoint's dtype; otherwise tensors are cast while loading. Each file
    is opened once and its tensors read in offset order. With `check_finite` (what the commands
    load with) a NaN or an infinity among the loaded values is an error naming the tensor
    (`refuse_non_finite`); without it, loading is lossless, NaN bits included."""
    import torch

    plan = plan_load(path, cfg)
    out_dtype = plan.dtype if dtype is None else dtype
    check_float_dtype(out_dtype, "load dtype")
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
    loaded = {name: state[name] for name in plan.shapes}
    if check_finite:
        refuse_non_finite(plan, loaded.items())
    return loaded


def refuse_non_finite(plan: LoadPlan, loaded) -> None:
    """A CheckpointError naming the HF tensor, its file and the place of the first NaN or
    infinity among the `loaded` (moegraph name, tensor as loaded) pairs, if there is one.

    Every tensor is scanned once, with one host sync (models/common/finite.py); only the
    tensors of a bad one are read from their files again, to name and place the value in the
    checkpoint's own terms: its HF name, its index on disk, and whether the value is bad on
    disk or only once cast to the load dtype (1e5 in float16) or dequantised (mxfp4)."""
    from ..models.common.finite import first_non_finite

    loaded = dict(loaded)
    bad = first_non_finite(loaded.items())
    if bad is None:
        return
    target, what = bad
    dtype = loaded[target].dtype
    reads = [r for r in plan.reads if r.target == target]
    pending: dict = {}
    try:
        for file in dict.fromkeys(r.file for r in reads):
            with safe_open(plan.root / file, framework="pt", device="cpu") as f:
                for r in (r for r in reads if r.file == file):
                    found = _non_finite_on_disk(r, f.get_tensor(r.hf_name), pending, dtype)
                    if found is not None:
                        raise CheckpointError(f"checkpoint: tensor {found[0]} in {file} is not "
                                              f"finite{found[1]}")
    except (SafetensorError, OSError):
        pass  # the file changed since it was read: say what the loaded tensor holds
    raise CheckpointError(f"checkpoint: tensor {target} as loaded from {plan.root} is not "
                          f"finite ({what})")


def _non_finite_on_disk(r: TensorRead, t: "torch.Tensor", pending: dict,
                        dtype: "torch.dtype") -> tuple[str, str] | None:
    """(HF name, " (nan at [2, 5])") where `r`'s tensor `t` as read from disk is not finite,
    or becomes so as `dtype` (or dequantised, for an MXFP4 pair); None when it is finite."""
    from ..models.common.finite import first_non_finite

    as_dtype = str(dtype).removeprefix("torch.")
    if r.part:
        value = read_tensor(r, t, pending, dtype)
        found = None if value is None else first_non_finite([(r.hf_name, value)])
        name = r.hf_name.removesuffix(r.part)
        return None if found is None else (name, f" once dequantised from mxfp4 to {as_dtype} "
                                                 f"({found[1]})")
    found = first_non_finite([(r.hf_name, t)])
    if found is not None:
        return r.hf_name, f" ({found[1]})"
    found = first_non_finite([(r.hf_name, t.to(dtype))]) if t.dtype != dtype else None
    return None if found is None else (r.hf_name, f" once cast to {as_dtype} ({found[1]})")


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
