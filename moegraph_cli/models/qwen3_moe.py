"""Qwen3-MoE (transformers' `Qwen3MoeForCausalLM`).

Attention with per-head q/k RMSNorm, no biases; MoE layers (router `mlp.gate`, experts
`mlp.experts.{e}.{gate,up,down}_proj`) every `decoder_sparse_step`-th layer unless listed in
`mlp_only_layers`, the others a dense SwiGLU `mlp` of `intermediate_size`; softmax top-k router
with optional renormalisation (`norm_topk_prob`).
Shared parts: common.attention (qk_norm="head"), common.ffn (MoeScope, DenseMlpScope).
"""

from __future__ import annotations

from ..errors import UsageError
from .common.keys import attention_keys, dense_mlp_keys, expert_keys, model_keys
from .common.shapes import attention_shapes, dense_mlp_shapes, moe_shapes
from .registry import Family, one_spelling

# config.json fields read, under the same names in ModelConfig.
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
          "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
          "mlp_only_layers", "rms_norm_eps", "rope_theta", "max_position_embeddings",
          "tie_word_embeddings", "router_aux_loss_coef", "attention_bias", "hidden_act",
          "initializer_range")


def read_config(d: dict, source: str) -> dict:
    one_spelling(d, "num_experts", ("num_local_experts",), source)  # transformers 5.x
    if d.get("use_sliding_window"):
        raise UsageError(f"{source}: use_sliding_window=true is not supported")
    return {k: d[k] for k in FIELDS if k in d}


def write_config(cfg) -> dict:
    d = {k: getattr(cfg, k) for k in FIELDS}
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


def checks(cfg) -> list[tuple[str, bool, str]]:
    return []  # its settings are the generic ones and its features


def key_map(cfg, fused_layers: set[int]) -> dict:
    def layer(put, i):
        attention_keys(put, cfg, qk_norm="head")
        if cfg.is_moe_layer(i):
            put("post_attention_layernorm.weight", "moe.post_norm.weight", (cfg.hidden_size,))
            put("mlp.gate.weight", "moe.router.weight", (cfg.num_experts, cfg.hidden_size))
            expert_keys(put, cfg, "mlp.experts", i in fused_layers)
        else:
            put("post_attention_layernorm.weight", "mlp.post_norm.weight", (cfg.hidden_size,))
            dense_mlp_keys(put, cfg, "mlp.", "mlp.", cfg.intermediate_size)

    return model_keys(cfg, layer)


def layer_shapes(cfg, i: int) -> dict:
    ffn = moe_shapes(cfg) if cfg.is_moe_layer(i) else dense_mlp_shapes(cfg)
    return {**attention_shapes(cfg, qk_norm="head"), **ffn}


def decoder_layer(cfg, moe, layer_idx: int, ep=None):
    from .common.attention import AttentionScope
    from .common.decoder import DecoderLayer
    from .common.ffn import DenseMlpScope, MoeScope

    is_moe = cfg.is_moe_layer(layer_idx)
    ffn = MoeScope(cfg, moe, ep) if is_moe else DenseMlpScope(cfg)
    return DecoderLayer(layer_idx, AttentionScope(cfg, qk_norm="head"), ffn, is_moe)


FAMILY = Family(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
                read_config=read_config, write_config=write_config, checks=checks,
                key_map=key_map, experts_prefix="mlp.experts.", decoder_layer=decoder_layer,
                layer_shapes=layer_shapes,
                features=frozenset({"norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}))
