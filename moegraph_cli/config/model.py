"""ModelConfig: every architecture field, under one name, with its validation; read from and
written to HF config.json through the family (models/registry.py), which maps its spelling."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ..io.documents import is_int, is_number, kind_of, parse_json, read_text, show
from ..errors import UsageError
from .fields import MAX_INT, check_int_sizes, coerce, field_types, invalid


@dataclass
class ModelConfig:
    """Every field any family reads, under one name; a family's file (models/) says which
    config.json fields it reads into which of these, and which it leaves at their defaults."""

    model_type: str = "qwen3_moe"  # the family: models/<family>.py
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
    sliding_window: typing.Optional[int] = None  # attention window (Mixtral); None: full causal
    clip_qkv: typing.Optional[float] = None  # clamp q/k/v projections to +-clip_qkv (OLMoE)
    shared_expert_intermediate_size: int = 0  # an always-on expert of this width (Qwen2-MoE)
    qkv_bias: bool = False  # biases on q/k/v only (Qwen2-MoE); attention_bias: on o too (OLMoE)
    # Multi-head latent attention (DeepSeek-V3; kv_lora_rank 0: none). head_dim is then the
    # rope part, qk_rope_head_dim, as transformers sets it.
    q_lora_rank: typing.Optional[int] = None  # None: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rope on interleaved pairs (x0, x1), (x2, x3), ...
    rope_scaling: typing.Optional[dict] = None  # yarn parameters (rope_type, factor, ...)
    # DeepSeek-V3 router: sigmoid scores, group-limited top-k, scaled weights.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # an ungated shared expert of n * moe_intermediate_size
    first_k_dense_replace: int = 0  # the first k layers are dense
    # GPT-OSS: per-layer attention kind ("sliding_attention" within sliding_window, or
    # "full_attention"; empty: every layer alike) and the experts' clamped SwiGLU.
    layer_types: list[str] = field(default_factory=list)
    swiglu_limit: typing.Optional[float] = None  # None: the plain SwiGLU
    swiglu_alpha: typing.Optional[float] = None  # the sigmoid's gain with swiglu_limit

    @property
    def family(self):
        """The architecture family (models/registry.Family) of model_type."""
        from ..models.registry import family_of

        return family_of(self.model_type)

    @property
    def shared_expert_width(self) -> int:
        """The shared expert's width: Qwen2-MoE's own field, or DeepSeek's n_shared_experts
        experts side by side; 0 without one."""
        return self.shared_expert_intermediate_size or \
            self.n_shared_experts * self.moe_intermediate_size

    @property
    def attn_head_dims(self) -> tuple[int, int]:
        """(q/k head dim, v head dim) of attention: head_dim twice, or MLA's
        (qk_nope_head_dim + qk_rope_head_dim, v_head_dim)."""
        if self.kv_lora_rank > 0:
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    def layer_window(self, layer_idx: int) -> int | None:
        """The attention window of a layer: sliding_window, unless layer_types names the layer
        "full_attention"; None for full causal attention."""
        if self.layer_types and self.layer_types[layer_idx] == "full_attention":
            return None
        return self.sliding_window

    def is_moe_layer(self, layer_idx: int) -> bool:
        """HF rule: MoE unless listed in mlp_only_layers, every decoder_sparse_step-th layer,
        and not one of the first first_k_dense_replace layers (DeepSeek)."""
        return (
            layer_idx not in self.mlp_only_layers
            and layer_idx >= self.first_k_dense_replace
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def validate(self, prefix: str = "model.") -> "ModelConfig":
        """Refuse a config moegraph cannot build; `prefix` starts every message ("model." for
        a profile, "DIR/config.json: " for a checkpoint)."""
        c = self
        from ..models.registry import family_of, feature_checks

        try:
            family = family_of(c.model_type, f"{prefix}model_type")
        except UsageError as e:
            raise invalid("model_type", str(e)) from None
        check_int_sizes(self, prefix)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "moe_intermediate_size",
                     "intermediate_size", "max_position_embeddings", "rms_norm_eps",
                     "rope_theta"):
            if getattr(c, name) <= 0:
                raise invalid(name, f"{prefix}{name} must be positive, got {getattr(c, name)}")
        if c.num_experts < 0:
            raise invalid("num_experts", f"{prefix}num_experts must be >= 0 (0: every layer "
                          f"dense), got {c.num_experts}")
        checks = [
            ("hidden_act", c.hidden_act == "silu",
             f"{prefix}hidden_act is {show(c.hidden_act)}; only 'silu' is supported"),
            ("num_attention_heads", c.num_attention_heads % c.num_key_value_heads == 0,
             f"{prefix}num_attention_heads {c.num_attention_heads} is not a multiple of "
             f"num_key_value_heads {c.num_key_value_heads}"),
            ("head_dim", c.head_dim % 2 == 0,
             f"{prefix}head_dim {c.head_dim} must be even for RoPE"),
            ("num_experts_per_tok", 0 < c.num_experts_per_tok <= max(c.num_experts, 1),
             f"{prefix}num_experts_per_tok {c.num_experts_per_tok} must be in 1..num_experts "
             f"({c.num_experts})"),
            ("decoder_sparse_step", c.decoder_sparse_step >= 1,
             f"{prefix}decoder_sparse_step must be >= 1, got {c.decoder_sparse_step}"),
            ("sliding_window", c.sliding_window is None or c.sliding_window > 0,
             f"{prefix}sliding_window must be positive or null, got {c.sliding_window}"),
            ("clip_qkv", c.clip_qkv is None or c.clip_qkv > 0,
             f"{prefix}clip_qkv must be positive or null, got {c.clip_qkv}"),
            ("shared_expert_intermediate_size", c.shared_expert_intermediate_size >= 0,
             f"{prefix}shared_expert_intermediate_size must be >= 0, got "
             f"{c.shared_expert_intermediate_size}"),
        ]
        checks += [
            ("layer_types", not c.layer_types or (
                len(c.layer_types) == c.num_hidden_layers
                and set(c.layer_types) <= {"sliding_attention", "full_attention"}),
             f"{prefix}layer_types must list 'sliding_attention' or 'full_attention' for each "
             f"of the {c.num_hidden_layers} layers, got {show(c.layer_types)}"),
            ("swiglu_limit", c.swiglu_limit is None or c.swiglu_limit > 0,
             f"{prefix}swiglu_limit must be positive or null, got {show(c.swiglu_limit)}"),
            ("initializer_range", 0 <= c.initializer_range <= 1,
             f"{prefix}initializer_range must be in [0, 1] (the standard deviation of the "
             f"seeded init's weights), got {show(c.initializer_range)}"),
        ]
        yarn = (_yarn_problem(c.rope_scaling, c.rope_theta) if "rope_scaling" in family.features
                else None)
        checks.append(("rope_scaling", yarn is None, f"{prefix}rope_scaling{yarn}"))
        checks += [(name, ok, f"{prefix}{msg}") for name, ok, msg in
                   [*feature_checks(family, c), *family.checks(c)]]
        for name, ok, msg in checks:
            if not ok:
                raise invalid(name, msg)
        return self

    def check_layer_indices(self, prefix: str = "model.") -> "ModelConfig":
        """Refuse layer indices outside the model in a user's config (profile, --set,
        config.json). transformers ignores them; here they are a mistake worth naming."""
        layers = self.num_hidden_layers
        outside = [i for i in self.mlp_only_layers if not 0 <= i < layers]
        if outside:
            raise invalid("mlp_only_layers", f"{prefix}mlp_only_layers holds {outside[0]}, "
                          f"which is not a layer of the model (layers 0..{layers - 1} with "
                          f"num_hidden_layers {layers})")
        return self

    # -- HF config.json ---------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(d, dict):
            raise UsageError(f"{source}: expected a JSON object of config fields, got "
                             f"{kind_of(d)}")
        from ..models.registry import family_of, supported_types

        if "model_type" not in d:
            raise UsageError(f"{source}: no model_type field; config.json names its family, "
                             "e.g. \"model_type\": \"qwen3_moe\" (moegraph reads "
                             + ", ".join(repr(t) for t in supported_types()) + ")")
        family = family_of(d["model_type"], f"{source}: model_type")
        d = dict(d)
        quant = d.get("quantization_config")
        if quant is not None:
            if not isinstance(quant, dict):
                raise UsageError(f"{source}: quantization_config must be an object or null, got "
                                 f"{show(quant)}")
            method = quant.get("quant_method")
            if not (isinstance(method, str) and method in family.quant_methods):
                known = "".join(f" and {m}" for m in sorted(family.quant_methods))
                raise UsageError(f"{source}: quantization_config.quant_method {show(method)} "
                                 f"is not supported for {family.model_type} checkpoints "
                                 f"(moegraph reads unquantised{known} weights)")
        for name in ("rope_parameters", "rope_scaling"):
            if d.get(name) is not None and not isinstance(d[name], dict):
                raise UsageError(f"{source}: {name} must be an object or null, got "
                                 f"{show(d[name])}")
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if rope:
            if "rope_type" not in rope and "type" not in rope and set(rope) - {"rope_theta"}:
                # transformers fails on it; read as the default rope, its factor would be lost
                name = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
                raise UsageError(f"{source}: {name} has no rope_type; give 'default' or 'yarn' "
                                 f"(got {show(rope)})")
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default" and "rope_scaling" not in family.features:
                raise UsageError(f"{source}: rope type {show(rope_type)} is not supported "
                                 "(only 'default')")
            if "rope_theta" not in d and "rope_theta" in rope:
                d["rope_theta"] = rope["rope_theta"]
        d = family.read_config(d, source)
        if d.get("mlp_only_layers") is None:
            d["mlp_only_layers"] = []
        if d.get("head_dim") is None:
            d.pop("head_dim", None)  # derived below, as transformers does
        missing = [n for n in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size", "num_experts") if n not in d]
        if missing:
            raise UsageError(f"{source}: missing required field {missing[0]!r}")
        types_ = field_types(cls)
        kwargs = {k: coerce(f"{source}: {k}", d[k], typ) for k, typ in types_.items() if k in d}
        if "head_dim" not in kwargs and kwargs["num_attention_heads"] > 0:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        kwargs["model_type"] = family.model_type
        return cls(**kwargs).validate(f"{source}: ").check_layer_indices(f"{source}: ")

    def to_hf_dict(self) -> dict:
        """config.json in the family's spelling (transformers 4.x's, which 5.x reads too)."""
        return self.family.write_config(self)

def read_hf_config(checkpoint_dir: str | Path) -> ModelConfig:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise UsageError(f"checkpoint {checkpoint_dir}: no config.json")
    d = parse_json(read_text(path, None), str(path))
    return ModelConfig.from_hf_dict(d, source=str(path))


def _yarn_problem(rope: dict | None, theta: float = 10000.0) -> str | None:
    """What is wrong with the values of a yarn `rope_scaling`, as the end of a message
    (".factor must be ..."); None when nothing is. The keys allowed and rope_type are each
    family's check; these values reach the rope's arithmetic (math.log of
    original / (beta * 2 pi) and of factor, divisions by log(rope_theta) and by the mscale
    terms), so every one that does must keep it finite."""
    if not rope or rope.get("rope_type") != "yarn":
        return None
    for key in ("factor", "original_max_position_embeddings"):
        if rope.get(key) is None:
            return f" needs {key} for yarn (transformers requires it), got {show(rope)}"
    for key in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor"):
        value = rope.get(key)
        if value is not None and not is_number(value):
            return f".{key} must be a finite number, got {show(value)}"
    for key in ("factor", "attention_factor"):
        value = rope.get(key)
        if value is not None and value <= 0:
            return f".{key} must be positive, got {show(value)}"
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):  # 0 reads as unset
        value = rope.get(key)
        if value is not None and value < 0:
            return f".{key} must be >= 0, got {show(value)}"
    original = rope["original_max_position_embeddings"]
    if not is_int(original) or not 0 < original <= MAX_INT:
        return (f".original_max_position_embeddings must be an integer in 1..{MAX_INT}, got "
                f"{show(original)}")
    if rope.get("truncate") is not None and not isinstance(rope["truncate"], bool):
        return f".truncate must be true or false, got {show(rope['truncate'])}"
    for key, unset in (("beta_fast", 32), ("beta_slow", 1)):  # a subnormal beta: log(inf)
        if not math.isfinite(original / ((rope.get(key) or unset) * 2 * math.pi)):
            return f".{key} {show(rope[key])} is too small"
    if theta == 1:
        return " (yarn) needs rope_theta other than 1 (it divides by log(rope_theta)), got 1"
    return None

