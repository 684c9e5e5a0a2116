"""DeepSeek-V3 (transformers' `DeepseekV3ForCausalLM`; Moonlight and Kimi-style checkpoints
share its model_type).

Attention: multi-head latent attention (common.mla): low-rank queries (`q_lora_rank`, or a
plain `q_proj` when null), keys and values from one `kv_lora_rank` latent, rope on the
`qk_rope_head_dim` part only (interleaved pairs with `rope_interleave`), yarn `rope_scaling`
with its attention factor and mscale^2 softmax scale; `attention_bias` on q_a, kv_a and o.
The first `first_k_dense_replace` layers are a dense SwiGLU `mlp` of `intermediate_size`; the
others MoE: the sigmoid router `mlp.gate` (group-limited top-k over `n_group` groups keeping
`topk_group`, chosen with the buffer `mlp.gate.e_score_correction_bias`, weights renormalised
when `norm_topk_prob`, times `routed_scaling_factor`), the routed experts
(`mlp.experts.{e}.{gate,up,down}_proj`; config.json counts them in `n_routed_experts`) and
an ungated shared expert `mlp.shared_experts` of width `n_shared_experts *
moe_intermediate_size`. transformers' class has no aux loss: router_aux_loss_coef is 0, and
moe.bias_update_rate turns on the auxiliary-loss-free bias rule. transformers ignores
`moe_layer_freq`, `topk_method`, `scoring_func` and the MTP layers' settings; so does this.
Shared parts: common.mla (MlaScope), common.rope (yarn, interleaved), common.ffn (MoeScope
with router="sigmoid_grouped" and an ungated shared expert; DenseMlpScope).
"""

from __future__ import annotations

from ..io.documents import show
from ..errors import UsageError
from .common.keys import dense_mlp_keys, expert_keys, model_keys
from .common.shapes import dense_mlp_shapes, mla_shapes, moe_shapes
from .registry import Family, one_spelling, require, require_ints, yarn_check, yarn_scaling

# config.json fields read under ModelConfig's names.
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
          "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor", "kv_lora_rank",
          "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group",
          "topk_group", "first_k_dense_replace", "norm_topk_prob", "hidden_act",
          "max_position_embeddings", "initializer_range", "rms_norm_eps",
          "tie_word_embeddings", "rope_theta", "rope_interleave", "attention_bias")
RENAMED = {"n_routed_experts": "num_experts"}
REQUIRED = tuple(f for f in FIELDS if f not in ("q_lora_rank", "num_key_value_heads",
                                                "initializer_range", "hidden_act",
                                                "max_position_embeddings")) \
    + ("n_routed_experts",)  # HF spellings; q_lora_rank may be null but must be there


def read_config(d: dict, source: str) -> dict:
    one_spelling(d, "n_routed_experts", ("num_local_experts", "num_experts"), source)
    require(d, REQUIRED, source)
    require_ints(d, (*RENAMED, "qk_rope_head_dim"), source)  # renamed, or copied to head_dim
    if "q_lora_rank" not in d:
        raise UsageError(f"{source}: missing required field 'q_lora_rank' (null for a plain "
                         "q_proj)")
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]  # transformers' rule
    scaling = yarn_scaling(d.get("rope_parameters") or d.get("rope_scaling") or {}, source)
    out = {k: d[k] for k in FIELDS if k in d}
    out.update({ours: d[theirs] for theirs, ours in RENAMED.items()})
    out.update(head_dim=d["qk_rope_head_dim"], rope_scaling=scaling, router_aux_loss_coef=0.0,
               decoder_sparse_step=1, mlp_only_layers=[])
    return out


def write_config(cfg) -> dict:
    d = {k: getattr(cfg, k) for k in FIELDS}
    d.update({theirs: getattr(cfg, ours) for theirs, ours in RENAMED.items()})
    d.update({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "attention_dropout": 0.0,
        "output_router_logits": False,
    })
    return d


def checks(cfg) -> list[tuple[str, bool, str]]:
    E, G = cfg.num_experts, cfg.n_group
    per_group = E // G if G > 0 and E % G == 0 else 0
    return [
        ("num_experts", E > 0, "num_experts must be positive for deepseek_v3"),
        ("kv_lora_rank", cfg.kv_lora_rank > 0, "kv_lora_rank must be positive for deepseek_v3"),
        ("q_lora_rank", cfg.q_lora_rank is None or cfg.q_lora_rank > 0,
         f"q_lora_rank must be positive or null, got {show(cfg.q_lora_rank)}"),
        ("qk_nope_head_dim", cfg.qk_nope_head_dim > 0 and cfg.v_head_dim > 0,
         "qk_nope_head_dim and v_head_dim must be positive for deepseek_v3"),
        ("head_dim", cfg.head_dim == cfg.qk_rope_head_dim,
         f"head_dim {cfg.head_dim} must be qk_rope_head_dim {cfg.qk_rope_head_dim} for "
         "deepseek_v3 (the rope part is the rope's head dim)"),
        ("num_key_value_heads", cfg.num_key_value_heads == cfg.num_attention_heads,
         f"num_key_value_heads {cfg.num_key_value_heads} must equal num_attention_heads "
         f"{cfg.num_attention_heads} for deepseek_v3 (MLA expands keys per head)"),
        ("n_group", per_group >= 2,
         f"num_experts {E} must split into n_group {G} groups of at least 2 experts"),
        ("topk_group", 1 <= cfg.topk_group <= max(G, 1),
         f"topk_group must be in 1..n_group ({G}), got {cfg.topk_group}"),
        ("num_experts_per_tok", cfg.num_experts_per_tok <= cfg.topk_group * per_group,
         f"num_experts_per_tok {cfg.num_experts_per_tok} must be at most topk_group x experts "
         f"per group ({cfg.topk_group * per_group})"),
        ("routed_scaling_factor", cfg.routed_scaling_factor > 0,
         f"routed_scaling_factor must be positive, got {cfg.routed_scaling_factor}"),
        ("n_shared_experts", cfg.n_shared_experts >= 0,
         f"n_shared_experts must be >= 0, got {cfg.n_shared_experts}"),
        ("first_k_dense_replace", 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers,
         f"first_k_dense_replace must be in 0..num_hidden_layers, got "
         f"{cfg.first_k_dense_replace}"),
        yarn_check(cfg.rope_scaling),
        ("router_aux_loss_coef", cfg.router_aux_loss_coef == 0,
         "router_aux_loss_coef must be 0 for deepseek_v3 (transformers' class has no aux "
         "loss; moe.bias_update_rate balances the experts)"),
    ]


def key_map(cfg, fused_layers: set[int]) -> dict:
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    kv_rank, q_rank, bias = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.attention_bias

    def layer(put, i):
        put("input_layernorm.weight", "attn.input_norm.weight", (H,))
        a = "self_attn."
        if q_rank is None:
            put(a + "q_proj.weight", "attn.q_proj.weight", (nh * qk, H))
        else:
            put(a + "q_a_proj.weight", "attn.q_a_proj.weight", (q_rank, H))
            if bias:
                put(a + "q_a_proj.bias", "attn.q_a_proj.bias", (q_rank,))
            put(a + "q_a_layernorm.weight", "attn.q_a_norm.weight", (q_rank,))
            put(a + "q_b_proj.weight", "attn.q_b_proj.weight", (nh * qk, q_rank))
        put(a + "kv_a_proj_with_mqa.weight", "attn.kv_a_proj_with_mqa.weight",
            (kv_rank + cfg.qk_rope_head_dim, H))
        if bias:
            put(a + "kv_a_proj_with_mqa.bias", "attn.kv_a_proj_with_mqa.bias",
                (kv_rank + cfg.qk_rope_head_dim,))
        put(a + "kv_a_layernorm.weight", "attn.kv_a_norm.weight", (kv_rank,))
        put(a + "kv_b_proj.weight", "attn.kv_b_proj.weight",
            (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv_rank))
        put(a + "o_proj.weight", "attn.o_proj.weight", (H, nh * cfg.v_head_dim))
        if bias:
            put(a + "o_proj.bias", "attn.o_proj.bias", (H,))
        if cfg.is_moe_layer(i):
            put("post_attention_layernorm.weight", "moe.post_norm.weight", (H,))
            put("mlp.gate.weight", "moe.router.weight", (cfg.num_experts, H))
            put("mlp.gate.e_score_correction_bias", "moe.e_score_correction_bias",
                (cfg.num_experts,))
            expert_keys(put, cfg, "mlp.experts", i in fused_layers)
            if cfg.shared_expert_width > 0:
                dense_mlp_keys(put, cfg, "mlp.shared_experts.", "moe.shared_expert.",
                               cfg.shared_expert_width)
        else:
            put("post_attention_layernorm.weight", "mlp.post_norm.weight", (H,))
            dense_mlp_keys(put, cfg, "mlp.", "mlp.", cfg.intermediate_size)

    return model_keys(cfg, layer)


def layer_shapes(cfg, i: int) -> dict:
    ffn = moe_shapes(cfg, router="sigmoid_grouped", shared_gate=False) if cfg.is_moe_layer(i) \
        else dense_mlp_shapes(cfg)
    return {**mla_shapes(cfg, bias=cfg.attention_bias), **ffn}


def decoder_layer(cfg, moe, layer_idx: int, ep=None):
    from .common.decoder import DecoderLayer
    from .common.ffn import DenseMlpScope, MoeScope
    from .common.mla import MlaScope

    is_moe = cfg.is_moe_layer(layer_idx)
    ffn = MoeScope(cfg, moe, ep, router="sigmoid_grouped", shared_gate=False) if is_moe \
        else DenseMlpScope(cfg)
    return DecoderLayer(layer_idx, MlaScope(cfg, bias=cfg.attention_bias), ffn, is_moe)


FAMILY = Family(model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM",
                read_config=read_config, write_config=write_config, checks=checks,
                key_map=key_map, experts_prefix="mlp.experts.", decoder_layer=decoder_layer,
                layer_shapes=layer_shapes,
                features=frozenset({"norm_topk_prob", "attention_bias", "q_lora_rank",
                                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                    "v_head_dim", "rope_interleave", "rope_scaling", "n_group",
                                    "topk_group", "routed_scaling_factor", "n_shared_experts",
                                    "first_k_dense_replace"}))
