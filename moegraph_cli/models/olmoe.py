"""OLMoE (transformers' `OlmoeForCausalLM`).

Attention with q/k RMSNorm over the whole projection (not per head: weights [hidden] and
[kv_heads * head_dim]) before RoPE, then q/k/v clamped to +-`clip_qkv` when set;
`attention_bias` puts biases on q/k/v and o. Every layer MoE (router `mlp.gate`, experts
`mlp.experts.{e}.{gate,up,down}_proj`); softmax top-k router, renormalised when
`norm_topk_prob`. config.json spells the expert width `intermediate_size`; head_dim is
hidden_size / num_attention_heads (the q norm spans hidden_size).
Shared parts: common.attention (qk_norm="proj", clip_qkv), common.ffn (MoeScope).
"""

from __future__ import annotations

from .common.keys import attention_keys, expert_keys, model_keys
from .common.shapes import attention_shapes, moe_shapes
from .registry import Family, one_spelling, require

# config.json fields read under ModelConfig's names.
FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
          "norm_topk_prob", "rms_norm_eps", "rope_theta", "max_position_embeddings",
          "tie_word_embeddings", "router_aux_loss_coef", "attention_bias", "hidden_act",
          "initializer_range", "clip_qkv")
# config.json -> ModelConfig. ModelConfig's intermediate_size (the dense MLP width) is not
# read: no layer of this family is dense.
RENAMED = {"intermediate_size": "moe_intermediate_size"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_experts", "num_experts_per_tok", "norm_topk_prob",
            "rms_norm_eps", "rope_theta", "router_aux_loss_coef",
            "tie_word_embeddings")  # HF spellings


def read_config(d: dict, source: str) -> dict:
    one_spelling(d, "num_experts", ("num_local_experts",), source)
    require(d, REQUIRED, source)
    if d.get("num_key_value_heads") is None and "num_attention_heads" in d:
        d["num_key_value_heads"] = d["num_attention_heads"]  # transformers' rule
    out = {k: d[k] for k in FIELDS if k in d}
    out.update({ours: d[theirs] for theirs, ours in RENAMED.items() if theirs in d})
    out.update(decoder_sparse_step=1, mlp_only_layers=[])
    return out


def write_config(cfg) -> dict:
    d = {k: getattr(cfg, k) for k in FIELDS if k != "head_dim"}  # derived: see checks
    d.update({theirs: getattr(cfg, ours) for theirs, ours in RENAMED.items()})
    d.update({
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "output_router_logits": False,
    })
    return d


def checks(cfg) -> list[tuple[str, bool, str]]:
    return [
        ("num_experts", cfg.num_experts > 0, "num_experts must be positive for olmoe"),
        ("head_dim", cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size,
         f"head_dim {cfg.head_dim} x num_attention_heads {cfg.num_attention_heads} must be "
         f"hidden_size {cfg.hidden_size} for olmoe (its q norm spans hidden_size)"),
    ]


def key_map(cfg, fused_layers: set[int]) -> dict:
    def layer(put, i):
        attention_keys(put, cfg, qk_norm="proj", qkv_bias=cfg.attention_bias,
                       o_bias=cfg.attention_bias)
        put("post_attention_layernorm.weight", "moe.post_norm.weight", (cfg.hidden_size,))
        put("mlp.gate.weight", "moe.router.weight", (cfg.num_experts, cfg.hidden_size))
        expert_keys(put, cfg, "mlp.experts", i in fused_layers)

    return model_keys(cfg, layer)


def layer_shapes(cfg, i: int) -> dict:
    attn = attention_shapes(cfg, qk_norm="proj", qkv_bias=cfg.attention_bias,
                            o_bias=cfg.attention_bias)
    return {**attn, **moe_shapes(cfg)}


def decoder_layer(cfg, moe, layer_idx: int, ep=None):
    from .common.attention import AttentionScope
    from .common.decoder import DecoderLayer
    from .common.ffn import MoeScope

    attn = AttentionScope(cfg, qk_norm="proj", qkv_bias=cfg.attention_bias,
                          o_bias=cfg.attention_bias, clip_qkv=cfg.clip_qkv)
    return DecoderLayer(layer_idx, attn, MoeScope(cfg, moe, ep), is_moe=True)


FAMILY = Family(model_type="olmoe", architecture="OlmoeForCausalLM",
                read_config=read_config, write_config=write_config, checks=checks,
                key_map=key_map, experts_prefix="mlp.experts.", decoder_layer=decoder_layer,
                layer_shapes=layer_shapes,
                features=frozenset({"norm_topk_prob", "clip_qkv", "attention_bias"}))
