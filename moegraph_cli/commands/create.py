"""`moegraph init`: write a Hugging Face-format checkpoint of seeded random weights.

Streams: each tensor is generated (models/common/init.py `seeded_value`: a generator of its own per
parameter and per expert) just before its bytes are written, so host memory holds one tensor
(one expert's fp32 draw for expert weights, the whole fp32 draw for a dense one), never the
model. The values are those of `MoeCausalLM.from_config` with the same seed, bit for bit.

Before writing: the output directory is checked (not a file, its parent exists or --mkdir, empty
or --force) and so is the free space of its file system. On any failure, running out of host
memory, Ctrl-C, SIGTERM and SIGHUP included (commands/cli_signals.py), the files this run
wrote, and the directories it created, are removed. The result lists and counts only the files
this run wrote, not what else a --force directory holds.

A directory that holds nothing but the hidden temporary files of unfinished writes
(`.model.safetensors.XXXXXXXX.tmp`, left by a process killed with kill -9 or by the OOM
killer) is refused with a message naming them, not "not empty" about a directory `ls` shows
empty. They are not removed unasked: moegraph cannot tell a dead writer's file from that of an
`init` still running into the same directory. With --force the write goes ahead, and
checkpoint_save.py `write_checkpoint` removes the leftovers of checkpoint files at the end.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..io.checkpoint_save import SaveLayout, save_layout, write_checkpoint
from ..io.hf_names import hf_to_moegraph_names, to_hf_layout
from ..config import ModelConfig
from ..config.fields import check_option
from ..errors import MoegraphError, UsageError
from ..io.outputs import check_output_dir, leftover_temporaries
from ..units import fmt_bytes

if TYPE_CHECKING:
    import torch

    from ..train.runspec import RunSpec

_CONFIG_ALLOWANCE = 64 * 1024  # config.json and filesystem slack beyond the layout's bytes


def seeded_tensors(cfg: ModelConfig, seed: int, dtype: str) -> Callable[[str], "torch.Tensor"]:
    """HF tensor name -> its seeded value in `dtype`, generated on demand (CPU)."""
    import torch

    from ..models.common.init import is_expert_stack, seeded_value

    torch_dtype = getattr(torch, dtype)
    table = hf_to_moegraph_names(cfg)
    std = cfg.initializer_range
    last: dict[tuple[str, int], torch.Tensor] = {}  # gate and up rows of one expert draw

    def tensor_of(hf_name: str) -> torch.Tensor:
        slot = table[hf_name]
        if not is_expert_stack(slot.name):
            t = seeded_value(slot.name, slot.target_shape, seed, std)
            return to_hf_layout(t.to(torch_dtype), slot.layout)
        if slot.index == ():  # a fused stack (GPT-OSS): every expert's draw, in its layout
            shape = slot.target_shape
            t = torch.stack([seeded_value(slot.name, shape[1:], seed, std, e).to(torch_dtype)
                             for e in range(shape[0])])
            return to_hf_layout(t, slot.layout)
        expert = slot.index[0]
        if (slot.name, expert) not in last:
            last.clear()
            shape = (2 * cfg.moe_intermediate_size, cfg.hidden_size) \
                if slot.name.endswith("w_gate_up") else slot.shape
            last[(slot.name, expert)] = seeded_value(slot.name, shape, seed, std, expert)
        return last[(slot.name, expert)][slot.index[1:]].to(torch_dtype)

    return tensor_of


def _check_free_space(out: Path, layout: SaveLayout) -> None:
    where = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(where).free
    need = layout.total_bytes + _CONFIG_ALLOWANCE
    if free < need:
        raise MoegraphError(f"init: the checkpoint needs {fmt_bytes(need)} but the file system "
                            f"of {where} has {fmt_bytes(free)} free")


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def create_checkpoint(spec: "RunSpec", out_dir: str | Path, seed: int | None = None,
                      max_shard_bytes: int | None = None, force: bool = False,
                      mkdir: bool = False, progress: bool = False) -> dict:
    """Write `spec`'s model, seeded, to `out_dir`; see the module docstring."""
    check_option("--seed", seed)  # the rule of run.seed
    out = Path(out_dir)
    check_output_dir(out, "init:", mkdir)
    if out.is_dir() and not force:
        _check_empty(out)
    prof = spec.profile
    cfg = prof.model.validate()
    seed = prof.run.seed if seed is None else seed
    layout = save_layout(cfg, prof.run.dtype,
                         5 * 2**30 if max_shard_bytes is None else max_shard_bytes)
    _check_free_space(out, layout)

    from ..report.render import Progress

    created = [p for p in (out, *out.parents) if not p.exists()]
    written: list[Path] = []
    current = [""]
    with Progress(progress, layout.tensor_bytes, f"init {out.name}", in_bytes=True) as bar:
        def on_tensor(name: str, nbytes: int) -> None:
            bar.advance(amount=nbytes)

        tensor_of = seeded_tensors(cfg, seed, prof.run.dtype)

        def traced(name: str):
            current[0] = name
            return tensor_of(name)

        try:
            out.mkdir(parents=True, exist_ok=True)
            write_checkpoint(cfg, out, layout, traced, on_tensor, written)
        except BaseException as e:
            _remove(written, created)
            removed = f"removed what it wrote in {out}"
            if _out_of_memory(e):
                raise MoegraphError(f"init: out of host memory while generating tensor "
                                    f"{current[0]}; {removed}") from None
            if isinstance(e, OSError):
                raise MoegraphError(f"init: writing {out} failed: "
                                    f"{e.strerror or type(e).__name__}; {removed}") from None
            raise
    return {"dir": str(out), "profile": prof.name, "dtype": prof.run.dtype, "seed": seed,
            "params": sum(math.prod(shape) for shape in layout.shapes.values()),
            "bytes": sum(p.stat().st_size for p in written),
            "files": sorted(p.name for p in written)}


def _check_empty(out: Path) -> None:
    entries = list(out.iterdir())
    if not entries:
        return
    leftovers = leftover_temporaries(out)
    if len(leftovers) == len(entries):
        more = f" and {len(leftovers) - 1} more" if len(leftovers) > 1 else ""
        raise UsageError(f"init: {out} holds only {leftovers[0].name}{more}, hidden temporary "
                         "files of writes that did not finish (a killed moegraph's, or one "
                         "still running); remove them, or use --force to write over them")
    raise UsageError(f"init: {out} exists and is not empty (use --force to overwrite)")


def _remove(written: list[Path], created: list[Path]) -> None:
    for path in written:
        path.unlink(missing_ok=True)
    for directory in created:  # deepest first; only if nothing else appeared in it
        try:
            directory.rmdir()
        except OSError:
            pass
