"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM (fp32, CPU), and through the product.
(tests/test_model_parity.py covers `moegraph init` checkpoints of the default profile.)"""

import pytest

from family_checks import check_emulated_lr0, check_hf_checkpoint, check_init_checkpoint

transformers = pytest.importorskip("transformers")


def hf_config(**overrides):
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=12, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
                  decoder_sparse_step=2, mlp_only_layers=[3], rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                  router_aux_loss_coef=0.05, max_position_embeddings=256)
    fields.update(overrides)
    cfg = transformers.Qwen3MoeConfig(**fields)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


@pytest.mark.parametrize("overrides", [{}, {"decoder_sparse_step": 1, "mlp_only_layers": [],
                                            "norm_topk_prob": False,
                                            "tie_word_embeddings": True}])
def test_transformers_checkpoint_loads_and_matches(tmp_path, overrides):
    ours = check_hf_checkpoint(tmp_path, hf_config(**overrides))
    cfg = ours.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 3, 12)
    assert cfg.head_dim == 12 and cfg.rope_theta == 5000.0
    kinds = [layer.is_moe for layer in ours.layers]
    assert kinds == ([False, True, False, False] if not overrides else [True] * 4)
    assert ours.layers[1].attn.q_norm.weight.shape == (12,)


def test_init_checkpoint_loads_in_transformers(tmp_path):
    check_init_checkpoint(tmp_path, "tiny-qwen3-moe",
                          ["model.mlp_only_layers=[0]", "model.norm_topk_prob=false"])


def test_graphs_lr0_bitwise():
    check_emulated_lr0("tiny-qwen3-moe", ["moe.mode=capacity", "moe.capacity_factor=0.5"])
