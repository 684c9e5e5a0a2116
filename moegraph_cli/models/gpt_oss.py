"""GPT-OSS (transformers' `GptOssForCausalLM`).

Attention with biases on q/k/v/o (`attention_bias`), a learned sink logit per head
(`self_attn.sinks`, common/sinks.py) and, per `layer_types`, a sliding window of
`sliding_window` ("sliding_attention") or full causal attention ("full_attention"); yarn rope
(`rope_scaling` / `rope_parameters`, no truncation in the published configs). Every layer MoE:
the router `mlp.router` has a bias, picks the top-k logits and softmaxes over those k; the
experts have biases on both projections and the clamped SwiGLU
(up + 1) * gate * sigmoid(alpha * gate) with gate <= limit, |up| <= limit (`swiglu_limit`,
`swiglu_alpha`). transformers' loss adds router_aux_loss_coef * aux loss when
output_router_logits is on, as moegraph's always does.

Experts on disk are stacked, HF's layout: `mlp.experts.gate_up_proj` [E, H, 2F] with gate and
up interleaved in the last dim (gate = [..., ::2], up = [..., 1::2]), `gate_up_proj_bias`
[E, 2F] likewise, `down_proj` [E, F, H], `down_proj_bias` [E, H]; the key map's layouts
(keys.py) de-interleave and transpose them into moegraph's [E, 2F, H] / [E, H, F] on load and
back on save. Hub checkpoints store the two expert weights as MXFP4 (`*_blocks` + `*_scales`,
`quantization_config.quant_method` "mxfp4"); they load dequantised (checkpoint.py, mxfp4.py).
config.json spells the expert width `intermediate_size`, the expert count
`num_local_experts` (4.x hub files also `experts_per_token` for num_experts_per_tok). Fields
transformers' class defaults identically in 4.x and 5.x (layer_types alternating from
sliding, sliding_window 128, attention_bias, the yarn rope, rope_theta 150000, swiglu_limit
7.0, swiglu_alpha 1.702) take those defaults when absent.
Shared parts: common.attention (sinks, biases, per-layer window), common.rope (yarn),
common.ffn (MoeScope with router="topk_softmax", expert biases, clamped SwiGLU).
"""

from __future__ import annotations

from ..io.documents import show
from .common.keys import attention_keys, model_keys
from .common.shapes import attention_shapes, moe_shapes
from .registry import Family, one_spelling, require, require_ints, yarn_check, yarn_scaling

# config.json fields read under ModelConfig's names.
FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "num_experts_per_tok", "rms_norm_eps",
          "rope_theta", "max_position_embeddings", "tie_word_embeddings",
          "router_aux_loss_coef", "hidden_act", "initializer_range", "sliding_window",
          "attention_bias", "layer_types", "swiglu_limit", "swiglu_alpha")
RENAMED = {"intermediate_size": "moe_intermediate_size", "num_local_experts": "num_experts"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_experts_per_tok", "num_local_experts", "rms_norm_eps",
            "router_aux_loss_coef", "tie_word_embeddings")  # HF spellings
# transformers' GptOssConfig defaults (the same in 4.x and 5.x).
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
DEFAULTS = {"sliding_window": 128, "attention_bias": True, "rope_theta": 150000.0,
            "swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def read_config(d: dict, source: str) -> dict:
    from ..config import MAX_INT

    one_spelling(d, "num_local_experts", ("num_experts",), source)  # the attribute_map's
    one_spelling(d, "num_experts_per_tok", ("experts_per_token",), source)  # 4.x hub files
    require(d, REQUIRED, source)
    require_ints(d, (*RENAMED, "num_hidden_layers"), source)
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]  # transformers' rule
    for name, value in DEFAULTS.items():
        if name not in d:
            d[name] = value
    if d.get("layer_types") is None and 0 < d["num_hidden_layers"] <= MAX_INT:
        # (a count out of range is validation's to name, before a list of that length)
        d["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                            for i in range(d["num_hidden_layers"])]
    has_rope = "rope_parameters" in d or "rope_scaling" in d
    rope = (d.get("rope_parameters") or d.get("rope_scaling") or {}) if has_rope else DEFAULT_ROPE
    scaling = yarn_scaling(rope, source)
    out = {k: d[k] for k in FIELDS if k in d}
    out.update({ours: d[theirs] for theirs, ours in RENAMED.items()})
    out.update(rope_scaling=scaling, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[])
    return out


def write_config(cfg) -> dict:
    d = {k: getattr(cfg, k) for k in FIELDS}
    d.update({theirs: getattr(cfg, ours) for theirs, ours in RENAMED.items()})
    rope = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    d.update({
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        # 4.x reads rope_scaling + rope_theta, 5.x rope_parameters (its class default would
        # otherwise replace a missing one with yarn): both, saying the same.
        "rope_scaling": rope,
        "rope_parameters": {**(rope or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
        "attention_dropout": 0.0,
        "output_router_logits": False,
    })
    return d


def checks(cfg) -> list[tuple[str, bool, str]]:
    return [
        ("num_experts", cfg.num_experts > 0, "num_experts must be positive for gpt_oss"),
        ("layer_types", len(cfg.layer_types) == cfg.num_hidden_layers,
         f"layer_types must name the attention of each of the {cfg.num_hidden_layers} layers "
         f"for gpt_oss, got {show(cfg.layer_types)}"),
        ("sliding_window", cfg.sliding_window is not None
         or "sliding_attention" not in cfg.layer_types,
         "sliding_window must be set for gpt_oss when layer_types has 'sliding_attention' "
         "layers (transformers' default is 128), got null"),
        ("swiglu_limit", cfg.swiglu_limit is not None and cfg.swiglu_alpha is not None,
         "swiglu_limit and swiglu_alpha must be set for gpt_oss (transformers' 7.0 and 1.702)"),
        yarn_check(cfg.rope_scaling),
    ]


def key_map(cfg, fused_layers: set[int]) -> dict:
    E, F, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    bias = cfg.attention_bias

    def layer(put, i):
        attention_keys(put, cfg, qk_norm=None, qkv_bias=bias, o_bias=bias)
        put("self_attn.sinks", "attn.sinks", (cfg.num_attention_heads,))
        put("post_attention_layernorm.weight", "moe.post_norm.weight", (H,))
        put("mlp.router.weight", "moe.router.weight", (E, H))
        put("mlp.router.bias", "moe.router.bias", (E,))
        # Always stacked on disk (transformers has no per-expert spelling for gpt_oss).
        x = "mlp.experts."
        put(x + "gate_up_proj", "moe.w_gate_up", (E, H, 2 * F),
            layout=("deinterleave", "transpose"))
        put(x + "gate_up_proj_bias", "moe.b_gate_up", (E, 2 * F), layout=("deinterleave",))
        put(x + "down_proj", "moe.w_down", (E, F, H), layout=("transpose",))
        put(x + "down_proj_bias", "moe.b_down", (E, H))

    return model_keys(cfg, layer)


def layer_shapes(cfg, i: int) -> dict:
    attn = attention_shapes(cfg, qk_norm=None, qkv_bias=cfg.attention_bias,
                            o_bias=cfg.attention_bias, sinks=True)
    return {**attn, **moe_shapes(cfg, router="topk_softmax", bias=True)}


def decoder_layer(cfg, moe, layer_idx: int, ep=None):
    from ..moe.activation import clamped_swiglu
    from .common.attention import AttentionScope
    from .common.decoder import DecoderLayer
    from .common.ffn import MoeScope

    attn = AttentionScope(cfg, qk_norm=None, qkv_bias=cfg.attention_bias,
                          o_bias=cfg.attention_bias, sliding_window=cfg.layer_window(layer_idx),
                          sinks=True)
    ffn = MoeScope(cfg, moe, ep, router="topk_softmax", bias=True,
                   act=clamped_swiglu(limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha))
    return DecoderLayer(layer_idx, attn, ffn, is_moe=True)


FAMILY = Family(model_type="gpt_oss", architecture="GptOssForCausalLM",
                read_config=read_config, write_config=write_config, checks=checks,
                key_map=key_map, experts_prefix="mlp.experts.", decoder_layer=decoder_layer,
                layer_shapes=layer_shapes,
                features=frozenset({"sliding_window", "attention_bias", "rope_scaling",
                                    "layer_types", "swiglu_limit", "swiglu_alpha"}),
                quant_methods=frozenset({"mxfp4"}))
