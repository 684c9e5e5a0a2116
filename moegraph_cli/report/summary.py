"""What `moegraph inspect` reports: architecture, parameter counts, per-layer shapes, and the
static memory of a training step (weights, grads, AdamW states)."""

from __future__ import annotations

from ..config import ModelConfig, Profile
from ..models.common.shapes import param_shapes

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def layer_shapes(cfg: ModelConfig, layer_idx: int) -> dict[str, list[int]]:
    """moegraph parameter names (relative to the layer) and shapes, from the config and the
    family (models/common/shapes.py, the one place that spells the model's parameters)."""
    return {k: list(v) for k, v in all_layer_shapes(cfg).get(layer_idx, {}).items()}


_SHAPES_CACHE: dict[str, dict[int, dict[str, list[int]]]] = {}


def all_layer_shapes(cfg: ModelConfig) -> dict[int, dict[str, list[int]]]:
    """Every layer's shapes from one pass over `param_shapes` (callers loop over layers:
    rebuilding the whole model's shapes per layer made `inspect` quadratic in the layer
    count)."""
    import dataclasses
    import json

    key = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    if key not in _SHAPES_CACHE:
        out: dict[int, dict[str, list[int]]] = {}
        for name, shape in param_shapes(cfg).items():
            if name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                out.setdefault(int(idx), {})[rest] = list(shape)
        _SHAPES_CACHE.clear()
        _SHAPES_CACHE[key] = out
    return _SHAPES_CACHE[key]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total and per-token active parameter counts, split by part."""
    embed = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    attn = moe = dense = experts = active_experts = 0
    for i in range(cfg.num_hidden_layers):
        for name, shape in layer_shapes(cfg, i).items():
            n = _numel(shape)
            if name.startswith("attn."):
                attn += n
            elif name.startswith("moe."):
                moe += n
                if name in ("moe.w_gate_up", "moe.w_down"):
                    experts += n
                    active_experts += n // cfg.num_experts * cfg.num_experts_per_tok
            else:
                dense += n
    total = embed + head + attn + moe + dense + cfg.hidden_size
    active = total - experts + active_experts
    return {"total": total, "active_per_token": active, "embedding": embed, "lm_head": head,
            "attention": attn, "moe": moe, "experts": experts, "dense_mlp": dense,
            "final_norm": cfg.hidden_size}


def rope_buffer_bytes(cfg: ModelConfig, seq_len: int, dtype: str) -> int:
    """The rope cos and sin tables [seq_len, head_dim] the model keeps for the run's length
    (models/common/rope.py): static memory beside the parameters."""
    return 2 * seq_len * cfg.head_dim * DTYPE_BYTES[dtype]


def static_memory(cfg: ModelConfig, dtype: str) -> dict[str, int]:
    """Bytes that live for the whole run: weights, grads, AdamW exp_avg and exp_avg_sq.

    AdamW keeps its two states in the parameter dtype (torch's AdamW, fused or not)."""
    n = param_counts(cfg)["total"]
    b = DTYPE_BYTES[dtype]
    out = {"weights": n * b, "grads": n * b, "optimizer": 2 * n * b}
    out["total"] = sum(out.values())
    return out


def fold_layers(layers: list[dict], key) -> list[dict]:
    """Runs of consecutive layers whose `key(layer)` is equal, as {"first", "last", "count",
    **the first layer}: one table row for layers 0-47 of a uniform model."""
    groups: list[dict] = []
    for layer in layers:
        if groups and key(layer) == groups[-1]["_key"] \
                and layer["layer"] == groups[-1]["last"] + 1:
            groups[-1]["last"] = layer["layer"]
            groups[-1]["count"] += 1
        else:
            groups.append({**layer, "first": layer["layer"], "last": layer["layer"],
                           "count": 1, "_key": key(layer)})
    for g in groups:
        del g["_key"]
    return groups


def summarize(prof: Profile, source: str) -> dict:
    """`static_memory_bytes` is what `moegraph plan` counts as static for the same run:
    weights, grads, AdamW states and the rope tables for run.seq_len."""
    cfg = prof.model
    layers = []
    for i in range(cfg.num_hidden_layers):
        shapes = layer_shapes(cfg, i)
        layers.append({"layer": i, "kind": "moe" if cfg.is_moe_layer(i) else "dense",
                       "params": sum(_numel(s) for s in shapes.values()), "shapes": shapes})
    static = static_memory(cfg, prof.run.dtype)
    static["buffers"] = rope_buffer_bytes(cfg, prof.run.seq_len, prof.run.dtype)
    static["total"] += static["buffers"]
    static["total"] = static.pop("total")  # last, after the parts
    mla = {}
    if cfg.kv_lora_rank > 0:  # DeepSeek-V3: the latent attention and the grouped router
        rope = cfg.rope_scaling or {}
        mla = {"q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
               "qk_nope_head_dim": cfg.qk_nope_head_dim,
               "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
               "rope_interleave": cfg.rope_interleave,
               "rope_type": rope.get("rope_type", "default"),
               "n_group": cfg.n_group, "topk_group": cfg.topk_group,
               "routed_scaling_factor": cfg.routed_scaling_factor,
               "first_k_dense_replace": cfg.first_k_dense_replace}
    return {
        "source": source,
        "name": prof.name,
        "architecture": {
            "model_type": cfg.model_type,
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
            "moe_intermediate": cfg.moe_intermediate_size, "vocab": cfg.vocab_size,
            "norm_topk_prob": cfg.norm_topk_prob, "mlp_only_layers": cfg.mlp_only_layers,
            "decoder_sparse_step": cfg.decoder_sparse_step, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "shared_expert_intermediate": cfg.shared_expert_width,
            "sliding_window": cfg.sliding_window, "clip_qkv": cfg.clip_qkv,
            "qkv_bias": cfg.qkv_bias, "attention_bias": cfg.attention_bias, **mla,
        },
        "run": {"batch": prof.run.batch, "seq_len": prof.run.seq_len, "dtype": prof.run.dtype},
        # capacity_factor: None when dropless (mode capacity is what uses it)
        "moe": {"mode": prof.moe.mode, "capacity_factor": prof.moe.capacity},
        "params": param_counts(cfg),
        "static_memory_bytes": static,
        "layers": layers,
        "layer_groups": [{k: g[k] for k in ("first", "last", "count", "kind", "params",
                                            "shapes")}
                         for g in fold_layers(layers, lambda l: (l["kind"], l["shapes"]))],
    }
