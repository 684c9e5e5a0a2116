"""The architecture registry: `model_type` -> Family.

A family is one module in this package (every module here except this one) that defines
`FAMILY = Family(...)`: which config.json fields it reads and writes, its checkpoint key map,
its layers' parameter shapes and its decoder layer, the last two from the shared parts in
models/common/ (shapes.py and the modules it mirrors). Adding a family is adding its file.
This module and the families' config, key-map and shape halves import no torch (`inspect` and
`plan` run without it); a family builds its layers with lazy imports.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..io.documents import is_int, show
from ..errors import UsageError

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .common.keys import Slot


@dataclass(frozen=True)
class Family:
    model_type: str                 # config.json's model_type
    architecture: str               # config.json's architectures[0], transformers' class
    # config.json dict (a copy, the caller's source for messages) -> ModelConfig field values;
    # renames HF spellings and refuses settings the family cannot build.
    read_config: Callable[[dict, str], dict]
    write_config: Callable[["ModelConfig"], dict]   # ModelConfig -> config.json fields
    # (field, ok, message) checks beyond ModelConfig's generic ones; message without prefix.
    checks: Callable[["ModelConfig"], list[tuple[str, bool, str]]]
    # HF tensor name -> Slot, in save order; layers in the set use the fused expert spelling.
    key_map: Callable[["ModelConfig", set[int]], dict[str, "Slot"]]
    experts_prefix: str             # HF name of a layer's experts after model.layers.{i}.
    decoder_layer: Callable         # (cfg, moe, layer_idx, ep) -> common.decoder.DecoderLayer
    # (cfg, layer_idx) -> the layer's state-dict names (after layers.{i}.) and shapes, the
    # parameters decoder_layer builds (common/shapes.py, torch-free).
    layer_shapes: Callable[["ModelConfig", int], dict[str, tuple[int, ...]]]
    # The optional ModelConfig settings (FEATURES) this family has; any other must stay at its
    # default, or validation names it as not a setting of the family.
    features: frozenset[str] = frozenset()
    # quantization_config.quant_method values whose checkpoints load (dequantised, see
    # checkpoint.py); any other quantised checkpoint is refused by name.
    quant_methods: frozenset[str] = frozenset()


# Settings only some families have; each family lists those it has in `features`.
FEATURES = {
    "norm_topk_prob": True,                 # False: top-k weights not renormalised
    "decoder_sparse_step": 1,               # dense layers between MoE layers
    "mlp_only_layers": [],                  # dense layers by index
    "sliding_window": None,                 # windowed attention
    "clip_qkv": None,                       # q/k/v clamped
    "qkv_bias": False,                      # biases on q/k/v
    "attention_bias": False,                # biases on q/k/v and o
    "shared_expert_intermediate_size": 0,   # a gated shared expert
    "q_lora_rank": None,                    # multi-head latent attention (DeepSeek-V3) ...
    "kv_lora_rank": 0,
    "qk_nope_head_dim": 0,
    "qk_rope_head_dim": 0,
    "v_head_dim": 0,
    "rope_interleave": False,
    "rope_scaling": None,                   # yarn rope
    "n_group": 1,                           # group-limited sigmoid router ...
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "n_shared_experts": 0,                  # an ungated shared expert
    "first_k_dense_replace": 0,             # leading dense layers
    "layer_types": [],                      # sliding / full attention per layer (GPT-OSS) ...
    "swiglu_limit": None,                   # clamped SwiGLU experts
    "swiglu_alpha": None,
}


def feature_checks(family: Family, cfg) -> list[tuple[str, bool, str]]:
    """(field, ok, message) for each feature the family lacks, set away from its default."""
    return [(name, getattr(cfg, name) == default,
             f"{name} is not a {family.model_type} setting; leave it at {show(default)} (got "
             f"{show(getattr(cfg, name))})")
            for name, default in FEATURES.items() if name not in family.features]


_FAMILIES: dict[str, Family] | None = None


def require(d: dict, names: tuple[str, ...], source: str) -> None:
    """Refuse a config.json without one of `names` (its HF spellings): moegraph never falls
    back to a class default where transformers might use another."""
    missing = [n for n in names if d.get(n) is None]
    if missing:
        raise UsageError(f"{source}: missing required field {missing[0]!r}")


def one_spelling(d: dict, name: str, aliases: tuple[str, ...], source: str) -> None:
    """Set `d[name]` (an HF spelling) from the first of `aliases` given when it is absent or
    null; two spellings given with different values are refused (which one transformers reads
    depends on its version)."""
    given = [(k, d[k]) for k in (name, *aliases) if d.get(k) is not None]
    for key, value in given[1:]:
        if value != given[0][1]:
            raise UsageError(f"{source}: {given[0][0]} {show(given[0][1])} and {key} "
                             f"{show(value)} disagree; give one")
    if given:
        d[name] = given[0][1]


def require_ints(d: dict, names: tuple[str, ...], source: str) -> None:
    """Refuse a non-integer in one of `names` (HF spellings) before a family renames it or
    computes with it, so the message names config.json's field."""
    for name in names:
        if name in d and not is_int(d[name]):
            raise UsageError(f"{source}: {name}: expected int, got {show(d[name])}")


# The yarn rope's keys (DeepSeek-V3 and GPT-OSS read the same ones).
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate")


def yarn_scaling(rope: dict, source: str) -> dict | None:
    """A config.json rope (`rope_parameters` or `rope_scaling`) as moegraph's `rope_scaling`:
    None for the default rope, the yarn keys given for yarn; any other rope type is refused."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise UsageError(f"{source}: rope type {show(rope_type)} is not supported (only "
                         "'default' and 'yarn')")
    if rope_type == "default":
        return None
    return {"rope_type": "yarn", **{k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}}


def yarn_check(rope: dict | None) -> tuple[str, bool, str]:
    """A family check (see Family.checks): `rope_scaling` is null or yarn with known keys (the
    values are config.py's _yarn_problem)."""
    ok = rope is None or (rope.get("rope_type") == "yarn"
                          and is_int(rope.get("original_max_position_embeddings"))
                          and set(rope) <= {"rope_type", *YARN_KEYS})
    return ("rope_scaling", ok,
            f"rope_scaling must be null or yarn (rope_type 'yarn', an integer "
            f"original_max_position_embeddings, and only {', '.join(YARN_KEYS)}), got "
            f"{show(rope)}")


def families() -> dict[str, Family]:
    """Every family in this package, by model_type (imported once)."""
    global _FAMILIES
    if _FAMILIES is None:
        here = [str(Path(__file__).parent)]  # this package's folder, without importing it
        found = {}
        for info in sorted(pkgutil.iter_modules(here), key=lambda m: m.name):
            if info.ispkg or info.name == "registry":
                continue
            module = importlib.import_module(f"{__package__}.{info.name}")
            fam = getattr(module, "FAMILY", None)
            if not isinstance(fam, Family):
                raise RuntimeError(f"models/{info.name}.py defines no FAMILY")
            found[fam.model_type] = fam
        _FAMILIES = found
    return _FAMILIES


def supported_types() -> list[str]:
    return sorted(families())


def family_of(model_type, source: str = "model.model_type") -> Family:
    """The family of `model_type`; an unsupported one is a usage error naming the others."""
    fam = families().get(model_type) if isinstance(model_type, str) else None
    if fam is None:
        raise UsageError(f"{source} is {show(model_type)}; moegraph reads "
                         + ", ".join(repr(t) for t in supported_types()))
    return fam
