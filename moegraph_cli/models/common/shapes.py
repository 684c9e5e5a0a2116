"""Parameter shapes from ModelConfig and the family: moegraph state-dict name -> shape. No torch.

`param_shapes(cfg)` holds the names and shapes of `MoeCausalLM(cfg).state_dict()` (parameters and
persistent buffers, the whole model: every expert, no expert-parallel slice): the embedding, each
layer's entries under `layers.{i}.` (the family's `layer_shapes(cfg, i)`), the final norm and the
lm head unless it is tied. FLOPs, `inspect`, the memory model and the checkpoint's checks all
read it; the HF tensor names stay in the checkpoint's name table (keys.py, io/), whose targets
are these same shapes (tests/models/test_shapes.py checks both against a model built on the
meta device).

The pieces below mirror the modules that own the parameters: `attention_shapes` is
attention.AttentionScope, `mla_shapes` mla.MlaScope, `moe_shapes` ffn.MoeScope and
`dense_mlp_shapes` ffn.DenseMlpScope, each taking the arguments its module takes, so a family's
`layer_shapes` reads like its `decoder_layer`. Within a layer the entries are in the name
table's order (attention, then the MoE or dense MLP scope), which is the order a loaded state
dict has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...config import ModelConfig

Shapes = dict[str, tuple[int, ...]]


def param_shapes(cfg: "ModelConfig") -> Shapes:
    """moegraph state-dict name -> shape for the whole model (see the module docstring)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shapes: Shapes = {"embed_tokens.weight": (V, H)}
    layer_shapes = cfg.family.layer_shapes
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"layers.{i}.{name}": shape
                       for name, shape in layer_shapes(cfg, i).items()})
    shapes["norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def attention_shapes(cfg: "ModelConfig", qk_norm: str | None, qkv_bias: bool = False,
                     o_bias: bool = False, sinks: bool = False) -> Shapes:
    """The `attn` scope of attention.AttentionScope: input norm, q/k/v/o projections (optional
    q/k/v and o biases), q/k RMSNorm per head (`"head"`) or over the projection (`"proj"`),
    and a sink logit per head."""
    H, hd = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: Shapes = {"attn.input_norm.weight": (H,), "attn.q_proj.weight": (q_rows, H)}
    if qkv_bias:
        shapes["attn.q_proj.bias"] = (q_rows,)
    shapes["attn.k_proj.weight"] = (kv_rows, H)
    if qkv_bias:
        shapes["attn.k_proj.bias"] = (kv_rows,)
    shapes["attn.v_proj.weight"] = (kv_rows, H)
    if qkv_bias:
        shapes["attn.v_proj.bias"] = (kv_rows,)
    shapes["attn.o_proj.weight"] = (H, q_rows)
    if o_bias:
        shapes["attn.o_proj.bias"] = (H,)
    if qk_norm == "head":
        shapes.update({"attn.q_norm.weight": (hd,), "attn.k_norm.weight": (hd,)})
    elif qk_norm == "proj":
        shapes.update({"attn.q_norm.weight": (q_rows,), "attn.k_norm.weight": (kv_rows,)})
    if sinks:
        shapes["attn.sinks"] = (cfg.num_attention_heads,)
    return shapes


def mla_shapes(cfg: "ModelConfig", bias: bool = False) -> Shapes:
    """The `attn` scope of mla.MlaScope: plain or low-rank queries, the kv latent with its
    shared rope key, their norms, and the o projection; `bias` on q_a, kv_a and o."""
    H, nh, rot = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_rope_head_dim
    q_rank, kv_rank = cfg.q_lora_rank, cfg.kv_lora_rank
    qk = cfg.qk_nope_head_dim + rot
    shapes: Shapes = {"attn.input_norm.weight": (H,)}
    if q_rank is None:
        shapes["attn.q_proj.weight"] = (nh * qk, H)
    else:
        shapes["attn.q_a_proj.weight"] = (q_rank, H)
        if bias:
            shapes["attn.q_a_proj.bias"] = (q_rank,)
        shapes["attn.q_a_norm.weight"] = (q_rank,)
        shapes["attn.q_b_proj.weight"] = (nh * qk, q_rank)
    shapes["attn.kv_a_proj_with_mqa.weight"] = (kv_rank + rot, H)
    if bias:
        shapes["attn.kv_a_proj_with_mqa.bias"] = (kv_rank + rot,)
    shapes["attn.kv_a_norm.weight"] = (kv_rank,)
    shapes["attn.kv_b_proj.weight"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv_rank)
    shapes["attn.o_proj.weight"] = (H, nh * cfg.v_head_dim)
    if bias:
        shapes["attn.o_proj.bias"] = (H,)
    return shapes


def moe_shapes(cfg: "ModelConfig", router: str = "softmax", shared_gate: bool = True,
               bias: bool = False) -> Shapes:
    """The `moe` scope of ffn.MoeScope: post norm, router (a bias with `"topk_softmax"`, the
    `e_score_correction_bias` buffer with `"sigmoid_grouped"`), the stacked experts
    `w_gate_up` [E, 2F, H] and `w_down` [E, H, F] (with `bias`, `b_gate_up` [E, 2F] and
    `b_down` [E, H]), and the shared expert when the config has one (gated by `shared_gate`)."""
    E, F, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    shapes: Shapes = {"moe.post_norm.weight": (H,), "moe.router.weight": (E, H)}
    if router == "topk_softmax":
        shapes["moe.router.bias"] = (E,)
    if router == "sigmoid_grouped":
        shapes["moe.e_score_correction_bias"] = (E,)
    shapes["moe.w_gate_up"] = (E, 2 * F, H)
    if bias:
        shapes["moe.b_gate_up"] = (E, 2 * F)
    shapes["moe.w_down"] = (E, H, F)
    if bias:
        shapes["moe.b_down"] = (E, H)
    S = cfg.shared_expert_width
    if S > 0:
        shapes.update(swiglu_shapes(H, S, "moe.shared_expert."))
        if shared_gate:
            shapes["moe.shared_expert_gate.weight"] = (1, H)
    return shapes


def dense_mlp_shapes(cfg: "ModelConfig") -> Shapes:
    """The `mlp` scope of ffn.DenseMlpScope: post norm and a SwiGLU of intermediate_size."""
    H = cfg.hidden_size
    return {"mlp.post_norm.weight": (H,), **swiglu_shapes(H, cfg.intermediate_size, "mlp.")}


def swiglu_shapes(hidden: int, width: int, prefix: str) -> Shapes:
    """gate/up [width, hidden] and down [hidden, width] projections under `prefix`."""
    return {prefix + "gate_proj.weight": (width, hidden),
            prefix + "up_proj.weight": (width, hidden),
            prefix + "down_proj.weight": (hidden, width)}
