"""Configs: the model (HF config.json fields), the run, the MoE settings, and profiles.

A profile is a YAML file in profiles/ with three sections: `model` (HF config.json field
names), `run` (batch, seq_len, steps, dtype, seed, ...), and `moe` (dispatch mode and backend).
`--set section.field=value` overrides any field with type checking.

config.json comes in two spellings and both are read here (nowhere else):
transformers 4.x (`num_experts`, `rope_theta`) and 5.x (`num_local_experts`, `rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from .errors import UsageError

DEFAULT_PROFILE = "tiny-qwen3-moe"


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1024  # dense MLP width (layers in mlp_only_layers)
    moe_intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02

    def is_moe_layer(self, layer_idx: int) -> bool:
        """HF rule: MoE unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def validate(self) -> "ModelConfig":
        c = self
        checks = [
            (c.hidden_act == "silu", f"model.hidden_act is {c.hidden_act!r}; only 'silu' is supported"),
            (c.num_attention_heads % c.num_key_value_heads == 0,
             f"model.num_attention_heads {c.num_attention_heads} is not a multiple of "
             f"num_key_value_heads {c.num_key_value_heads}"),
            (c.head_dim % 2 == 0, f"model.head_dim {c.head_dim} must be even for RoPE"),
            (0 < c.num_experts_per_tok <= max(c.num_experts, 1),
             f"model.num_experts_per_tok {c.num_experts_per_tok} must be in 1..num_experts "
             f"({c.num_experts})"),
            (c.decoder_sparse_step >= 1, "model.decoder_sparse_step must be >= 1"),
            (not c.attention_bias, "model.attention_bias=true is not supported (Qwen3 has none)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise UsageError(msg)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "moe_intermediate_size"):
            if getattr(c, name) <= 0:
                raise UsageError(f"model.{name} must be positive, got {getattr(c, name)}")
        return self

    # -- HF config.json ---------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        if d.get("model_type", "qwen3_moe") != "qwen3_moe":
            raise UsageError(f"{source}: model_type is {d.get('model_type')!r}; moegraph reads "
                             "'qwen3_moe' checkpoints")
        d = dict(d)
        if "num_experts" not in d and "num_local_experts" in d:
            d["num_experts"] = d["num_local_experts"]
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if isinstance(rope, dict):
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise UsageError(f"{source}: rope type {rope_type!r} is not supported (only 'default')")
            if "rope_theta" not in d and "rope_theta" in rope:
                d["rope_theta"] = rope["rope_theta"]
        if d.get("use_sliding_window"):
            raise UsageError(f"{source}: use_sliding_window=true is not supported")
        if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if d.get("mlp_only_layers") is None:
            d["mlp_only_layers"] = []
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [n for n in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size", "num_experts") if n not in d]
        if missing:
            raise UsageError(f"{source}: missing required field {missing[0]!r}")
        kwargs = {}
        for k in names:
            if k in d:
                kwargs[k] = _coerce(f"{source}:{k}", d[k], _field_types(cls)[k])
        return cls(**kwargs).validate()

    def to_hf_dict(self) -> dict:
        """transformers 4.x spelling (as the published Qwen3-30B-A3B); 5.x reads it too."""
        d = dataclasses.asdict(self)
        d.update({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "output_router_logits": False,
        })
        return d


@dataclass
class RunConfig:
    batch: int = 2
    seq_len: int = 512
    steps: int = 10
    warmup: int = 3
    dtype: str = "bfloat16"
    seed: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.0
    scopes: list[str] = field(default_factory=lambda: ["attn", "moe"])
    pool: str = "shared"
    data: typing.Optional[str] = None  # a .pt / .bin file of token ids; None = synthetic
    device: str = "auto"
    # Settings graph capture refuses (fail closed at plan and capture time):
    activation_checkpointing: bool = False
    fp8: bool = False
    pipeline_interleave: int = 1
    dynamic_shapes: bool = False

    def validate(self) -> "RunConfig":
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise UsageError(f"run.dtype {self.dtype!r} must be bfloat16, float32 or float16")
        for name in ("batch", "seq_len", "steps"):
            if getattr(self, name) <= 0:
                raise UsageError(f"run.{name} must be positive, got {getattr(self, name)}")
        if self.lr < 0:
            raise UsageError(f"run.lr must be >= 0, got {self.lr}")
        bad = [s for s in self.scopes if s not in ("attn", "moe")]
        if bad:
            raise UsageError(f"run.scopes: unknown scope {bad[0]!r}; choose from attn, moe")
        if self.pool not in ("shared", "per_scope", "per_entry", "auto"):
            raise UsageError(f"run.pool {self.pool!r} must be shared, per_scope, per_entry or auto")
        return self


@dataclass
class MoeConfig:
    mode: str = "dropless"  # dropless | capacity
    capacity_factor: float = 1.25
    backend: str = "auto"  # auto (permute_free on CUDA, reference on CPU) | reference | permute_free

    def validate(self) -> "MoeConfig":
        if self.mode not in ("dropless", "capacity"):
            raise UsageError(f"moe.mode {self.mode!r} must be dropless or capacity")
        if self.capacity_factor <= 0:
            raise UsageError(f"moe.capacity_factor must be positive, got {self.capacity_factor}")
        if self.backend not in ("auto", "reference", "permute_free"):
            raise UsageError(f"moe.backend {self.backend!r} must be auto, reference or permute_free")
        return self

    @property
    def capacity(self) -> float | None:
        """The capacity factor the expert functions take: None means dropless."""
        return self.capacity_factor if self.mode == "capacity" else None


@dataclass
class Profile:
    name: str
    model: ModelConfig
    run: RunConfig
    moe: MoeConfig
    description: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description,
                "model": dataclasses.asdict(self.model), "run": dataclasses.asdict(self.run),
                "moe": dataclasses.asdict(self.moe)}


SECTIONS = {"model": ModelConfig, "run": RunConfig, "moe": MoeConfig}


def profile_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("moegraph_cli.profiles").iterdir()
                  if p.name.endswith(".yaml"))


def load_profile(name_or_path: str = DEFAULT_PROFILE, overrides: list[str] | None = None) -> Profile:
    """A profile by name (profiles/NAME.yaml) or by path to a YAML file, with overrides."""
    path = Path(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")) and path.exists():
        text, source = path.read_text(), str(path)
    else:
        res = resources.files("moegraph_cli.profiles").joinpath(f"{name_or_path}.yaml")
        if not res.is_file():
            raise UsageError(f"profile {name_or_path!r} not found; available: "
                             + ", ".join(profile_names()))
        text, source = res.read_text(), f"profiles/{name_or_path}.yaml"
    raw = yaml.safe_load(text) or {}
    unknown = set(raw) - {"name", "description", *SECTIONS}
    if unknown:
        raise UsageError(f"{source}: unknown section {sorted(unknown)[0]!r}")
    sections = {}
    for sec, cls in SECTIONS.items():
        values = raw.get(sec) or {}
        sections[sec] = _build(cls, values, f"{source}:{sec}")
    prof = Profile(name=raw.get("name", path.stem), description=raw.get("description", ""),
                   **sections)
    return apply_overrides(prof, overrides or [])


def profile_from_model(model: ModelConfig, name: str, overrides: list[str] | None = None,
                       base: str = DEFAULT_PROFILE) -> Profile:
    """A checkpoint's architecture with the default profile's run settings."""
    prof = load_profile(base)
    prof.model, prof.name = model, name
    return apply_overrides(prof, overrides or [])


def apply_overrides(prof: Profile, overrides: list[str]) -> Profile:
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--set {item!r}: expected section.field=value")
        sec, _, name = key.strip().partition(".")
        if sec not in SECTIONS or not name:
            raise UsageError(f"--set {key!r}: unknown key; sections are model, run, moe "
                             "(e.g. run.seq_len=2048)")
        obj = getattr(prof, sec)
        types_ = _field_types(type(obj))
        if name not in types_:
            raise UsageError(f"--set {key!r}: unknown key; {sec} fields are "
                             + ", ".join(sorted(types_)))
        parsed = yaml.safe_load(value) if value.strip() else ""
        if types_[name] == list[str] and isinstance(parsed, str):
            parsed = [s.strip() for s in parsed.split(",") if s.strip()]
        setattr(obj, name, _coerce(f"--set {key}", parsed, types_[name]))
    prof.model.validate()
    prof.run.validate()
    prof.moe.validate()
    return prof


def read_hf_config(checkpoint_dir: str | Path) -> ModelConfig:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise UsageError(f"checkpoint {checkpoint_dir}: no config.json")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    return ModelConfig.from_hf_dict(d, source=str(path))


def _build(cls, values: dict, source: str):
    types_ = _field_types(cls)
    for k in values:
        if k not in types_:
            raise UsageError(f"{source}: unknown field {k!r}")
    obj = cls(**{k: _coerce(f"{source}.{k}", v, types_[k]) for k, v in values.items()})
    return obj.validate()


def _field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(where: str, value, typ):
    """Check `value` against a field type; ints widen to float, nothing else converts."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        return _coerce(where, value, args[0])
    if origin is list:
        (inner,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise UsageError(f"{where}: expected a list, got {value!r}")
        return [_coerce(where, v, inner) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    raise UsageError(f"{where}: expected {getattr(typ, '__name__', typ)}, got {value!r}")
