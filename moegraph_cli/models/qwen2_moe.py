"""Qwen1.5-MoE / Qwen2-MoE (transformers' `Qwen2MoeForCausalLM`).

Attention with q/k/v biases (`qkv_bias`; transformers 4.x has no such field and always puts
them on) and no q/k norm; MoE layers every `decoder_sparse_step`-th layer unless listed in
`mlp_only_layers`, the others a dense SwiGLU `mlp` of `intermediate_size`. A MoE layer is the
softmax top-k router (`mlp.gate`, renormalised when `norm_topk_prob`), the routed experts
(`mlp.experts.{e}.{gate,up,down}_proj`) and a shared expert (`mlp.shared_expert`, width
`shared_expert_intermediate_size`) gated by `sigmoid(mlp.shared_expert_gate(x))`, added to
the routed output inside the moe scope.
Shared parts: common.attention (qk_norm=None, qkv_bias), common.ffn (MoeScope with its
shared expert, DenseMlpScope).
"""

from __future__ import annotations

from ..errors import UsageError
from .common.keys import attention_keys, dense_mlp_keys, expert_keys, model_keys
from .common.shapes import attention_shapes, dense_mlp_shapes, moe_shapes
from .registry import Family, one_spelling, require

# config.json fields read, under the same names in ModelConfig.
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
          "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
          "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "rms_norm_eps",
          "rope_theta", "max_position_embeddings", "tie_word_embeddings",
          "router_aux_loss_coef", "hidden_act", "initializer_range", "qkv_bias")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
            "rms_norm_eps", "rope_theta", "router_aux_loss_coef", "tie_word_embeddings")


def read_config(d: dict, source: str) -> dict:
    one_spelling(d, "num_experts", ("num_local_experts",), source)
    if d.get("use_sliding_window"):
        raise UsageError(f"{source}: use_sliding_window=true is not supported")
    layer_types = d.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        raise UsageError(f"{source}: layer_types other than full_attention are not supported")
    require(d, REQUIRED, source)
    if d.get("num_key_value_heads") is None and "num_attention_heads" in d:
        d["num_key_value_heads"] = d["num_attention_heads"]  # transformers' rule
    d.setdefault("qkv_bias", True)  # transformers 4.x: always biased, no field
    return {k: d[k] for k in FIELDS if k in d}


def write_config(cfg) -> dict:
    d = {k: getattr(cfg, k) for k in FIELDS}
    d.update({
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_hidden_layers,
        "attention_dropout": 0.0,
        "output_router_logits": False,
    })
    return d


def checks(cfg) -> list[tuple[str, bool, str]]:
    return []  # its settings are the generic ones and its features


def key_map(cfg, fused_layers: set[int]) -> dict:
    H, S = cfg.hidden_size, cfg.shared_expert_intermediate_size

    def layer(put, i):
        attention_keys(put, cfg, qk_norm=None, qkv_bias=cfg.qkv_bias)
        if cfg.is_moe_layer(i):
            put("post_attention_layernorm.weight", "moe.post_norm.weight", (H,))
            put("mlp.gate.weight", "moe.router.weight", (cfg.num_experts, H))
            expert_keys(put, cfg, "mlp.experts", i in fused_layers)
            if S > 0:
                dense_mlp_keys(put, cfg, "mlp.shared_expert.", "moe.shared_expert.", S)
                put("mlp.shared_expert_gate.weight", "moe.shared_expert_gate.weight", (1, H))
        else:
            put("post_attention_layernorm.weight", "mlp.post_norm.weight", (H,))
            dense_mlp_keys(put, cfg, "mlp.", "mlp.", cfg.intermediate_size)

    return model_keys(cfg, layer)


def layer_shapes(cfg, i: int) -> dict:
    ffn = moe_shapes(cfg) if cfg.is_moe_layer(i) else dense_mlp_shapes(cfg)
    return {**attention_shapes(cfg, qk_norm=None, qkv_bias=cfg.qkv_bias), **ffn}


def decoder_layer(cfg, moe, layer_idx: int, ep=None):
    from .common.attention import AttentionScope
    from .common.decoder import DecoderLayer
    from .common.ffn import DenseMlpScope, MoeScope

    is_moe = cfg.is_moe_layer(layer_idx)
    ffn = MoeScope(cfg, moe, ep) if is_moe else DenseMlpScope(cfg)
    attn = AttentionScope(cfg, qk_norm=None, qkv_bias=cfg.qkv_bias)
    return DecoderLayer(layer_idx, attn, ffn, is_moe)


FAMILY = Family(model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM",
                read_config=read_config, write_config=write_config, checks=checks,
                key_map=key_map, experts_prefix="mlp.experts.", decoder_layer=decoder_layer,
                layer_shapes=layer_shapes,
                features=frozenset({"norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                                    "qkv_bias", "shared_expert_intermediate_size"}))
