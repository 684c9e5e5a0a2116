"""Mixtral (transformers' `MixtralForCausalLM`).

Attention without q/k norm or biases, within `sliding_window` when set; every layer MoE
(`block_sparse_moe`: router `gate`, experts `experts.{e}.w1/w3/w2` = gate/up/down); softmax
top-k router whose top-k weights are always renormalised. config.json spells the expert width
`intermediate_size` and the expert count `num_local_experts`.
Shared parts: common.attention (qk_norm=None, sliding window), common.ffn (MoeScope).
"""

from __future__ import annotations

from ..io.documents import show
from ..errors import UsageError
from .common.keys import attention_keys, expert_keys, model_keys
from .common.shapes import attention_shapes, moe_shapes
from .registry import Family, one_spelling, require

# config.json fields read under ModelConfig's names.
FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "num_experts_per_tok", "rms_norm_eps",
          "rope_theta", "max_position_embeddings", "tie_word_embeddings",
          "router_aux_loss_coef", "hidden_act", "initializer_range", "sliding_window")
# config.json -> ModelConfig. ModelConfig's intermediate_size (the dense MLP width) is not
# read: no layer of this family is dense.
RENAMED = {"intermediate_size": "moe_intermediate_size", "num_local_experts": "num_experts"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_experts_per_tok", "num_local_experts", "rms_norm_eps",
            "rope_theta", "router_aux_loss_coef", "tie_word_embeddings")  # HF spellings


def read_config(d: dict, source: str) -> dict:
    one_spelling(d, "num_local_experts", ("num_experts",), source)  # the attribute_map's
    jitter = d.get("router_jitter_noise") or 0
    if jitter:
        raise UsageError(f"{source}: router_jitter_noise {show(jitter)} is not supported "
                         "(only 0)")
    require(d, REQUIRED, source)
    if d.get("num_key_value_heads") is None and "num_attention_heads" in d:
        d["num_key_value_heads"] = d["num_attention_heads"]  # transformers' rule
    out = {k: d[k] for k in FIELDS if k in d}
    out.update({ours: d[theirs] for theirs, ours in RENAMED.items() if theirs in d})
    out.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return out


def write_config(cfg) -> dict:
    d = {k: getattr(cfg, k) for k in FIELDS}
    d.update({theirs: getattr(cfg, ours) for theirs, ours in RENAMED.items()})
    d.update({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    })
    return d


def checks(cfg) -> list[tuple[str, bool, str]]:
    return [
        ("num_experts", cfg.num_experts > 0, "num_experts must be positive for mixtral"),
    ]


def key_map(cfg, fused_layers: set[int]) -> dict:
    def layer(put, i):
        attention_keys(put, cfg, qk_norm=None)
        put("post_attention_layernorm.weight", "moe.post_norm.weight", (cfg.hidden_size,))
        put("block_sparse_moe.gate.weight", "moe.router.weight",
            (cfg.num_experts, cfg.hidden_size))
        expert_keys(put, cfg, "block_sparse_moe.experts", i in fused_layers,
                    names=("w1", "w3", "w2"))

    return model_keys(cfg, layer)


def layer_shapes(cfg, i: int) -> dict:
    return {**attention_shapes(cfg, qk_norm=None), **moe_shapes(cfg)}


def decoder_layer(cfg, moe, layer_idx: int, ep=None):
    from .common.attention import AttentionScope
    from .common.decoder import DecoderLayer
    from .common.ffn import MoeScope

    attn = AttentionScope(cfg, qk_norm=None, sliding_window=cfg.sliding_window)
    return DecoderLayer(layer_idx, attn, MoeScope(cfg, moe, ep), is_moe=True)


FAMILY = Family(model_type="mixtral", architecture="MixtralForCausalLM",
                read_config=read_config, write_config=write_config, checks=checks,
                key_map=key_map, experts_prefix="block_sparse_moe.experts.",
                decoder_layer=decoder_layer, layer_shapes=layer_shapes,
                features=frozenset({"sliding_window"}))
