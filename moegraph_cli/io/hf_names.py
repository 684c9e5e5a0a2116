"""The checkpoint boundary's names: HF tensor name -> moegraph slot, and HF's file names.

The HF tensor names are the family's (torchtitan's `from_hf_map` idea): `hf_to_moegraph_names`
returns the family's key map (models/<family>.py, over models/common/keys.py), which maps each
HF tensor to a moegraph name and to where in that tensor it goes. Experts are stacked in memory
and stored one tensor per expert on disk, e.g. for Qwen3-MoE:

    model.layers.{i}.mlp.experts.{e}.gate_proj.weight [F, H] -> layers.{i}.moe.w_gate_up[e, :F]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight   [F, H] -> layers.{i}.moe.w_gate_up[e, F:]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight [H, F] -> layers.{i}.moe.w_down[e]

A slot with a `layout` (keys.py) is transposed / de-interleaved on load (`to_moegraph_layout`)
and put back on save (`to_hf_layout`). Only checkpoint I/O and `moegraph init` read this table;
the shapes of the model's parameters come from the config and the family
(models/common/shapes.py `param_shapes`), which the table's targets match.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

from ..config import ModelConfig
from ..models.common.keys import Slot

if TYPE_CHECKING:  # torch is imported where tensors are made: the table needs none
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def hf_to_moegraph_names(cfg: ModelConfig, fused_layers: Iterable[int] = ()) -> dict[str, Slot]:
    """HF tensor name -> Slot, in save order (layer by layer): the family's key map. Layers in
    `fused_layers` use the fused expert spelling; the others one tensor per expert."""
    return cfg.family.key_map(cfg, set(fused_layers))


def moegraph_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """moegraph state-dict name -> shape as the name table fills it (the fused spelling maps
    one to one, so it is this). The model's own is `param_shapes`; the tests hold them equal."""
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


def config_summary(cfg: ModelConfig) -> str:
    """The config's model in a few words, for messages about tensors it has no slot for."""
    return (f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts, mlp_only_layers "
            f"{list(cfg.mlp_only_layers)}, decoder_sparse_step {cfg.decoder_sparse_step}, "
            f"tie_word_embeddings {str(cfg.tie_word_embeddings).lower()}")


def and_more(items: list, what: str) -> str:
    """What follows a message naming items[0]: " (and 3 more missing)", or "" for one."""
    return f" (and {len(items) - 1} more {what})" if len(items) > 1 else ""
