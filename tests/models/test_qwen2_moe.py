"""Qwen2-MoE against transformers' Qwen2MoeForCausalLM (fp32, CPU), and through the product."""

import json

import pytest

from family_checks import check_emulated_lr0, check_hf_checkpoint, check_init_checkpoint
from cli_util import run_cli

transformers = pytest.importorskip("transformers")


def hf_config(**overrides):
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                  shared_expert_intermediate_size=20, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=6,
                  num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2,
                  mlp_only_layers=[3], rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                  router_aux_loss_coef=0.05, max_position_embeddings=256)
    fields.update(overrides)
    cfg = transformers.Qwen2MoeConfig(**fields)
    cfg.architectures = ["Qwen2MoeForCausalLM"]
    return cfg


@pytest.mark.parametrize("overrides", [{}, {"decoder_sparse_step": 1, "mlp_only_layers": [],
                                            "norm_topk_prob": False, "qkv_bias": False,
                                            "tie_word_embeddings": True}])
def test_transformers_checkpoint_loads_and_matches(tmp_path, overrides):
    ours = check_hf_checkpoint(tmp_path, hf_config(**overrides))
    cfg = ours.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 3, 12)
    assert cfg.shared_expert_intermediate_size == 20 and cfg.intermediate_size == 40
    assert cfg.qkv_bias == overrides.get("qkv_bias", True)
    kinds = [layer.is_moe for layer in ours.layers]
    assert kinds == ([False, True, False, False] if not overrides else [True] * 4)
    moe = next(layer.moe for layer in ours.layers if layer.is_moe)
    assert moe.shared_expert.gate_proj.weight.shape == (20, 32)
    assert moe.shared_expert_gate.weight.shape == (1, 32)


def test_transformers_4x_config_means_qkv_bias():
    """transformers 4.x wrote no qkv_bias: its Qwen2-MoE always has q/k/v biases."""
    from moegraph_cli.config import ModelConfig

    d = ModelConfig(model_type="qwen2_moe", qkv_bias=True,
                    shared_expert_intermediate_size=64).to_hf_dict()
    del d["qkv_bias"]
    assert ModelConfig.from_hf_dict(d).qkv_bias


def test_shared_expert_is_live(tmp_path):
    """Without the shared expert the logits differ: the parity test above covers it."""
    import torch

    from moegraph_cli import models

    check_hf_checkpoint(tmp_path, hf_config())
    ours = models.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = ours(ids).logits
        for layer in ours.layers:
            if layer.is_moe:
                layer.moe.shared_expert_gate.weight.fill_(-1e4)  # sigmoid -> 0
        gap = (full - ours(ids).logits).abs().max().item()
    assert gap > 1e-3


@pytest.mark.parametrize("overrides", [[], ["model.mlp_only_layers=[0]",
                                            "model.norm_topk_prob=true", "model.qkv_bias=false",
                                            "model.shared_expert_intermediate_size=24"]])
def test_init_checkpoint_loads_in_transformers(tmp_path, overrides):
    ours, theirs = check_init_checkpoint(
        tmp_path, "tiny-qwen2-moe", ["model.shared_expert_intermediate_size=20", *overrides])
    written = json.loads((tmp_path / "init" / "config.json").read_text())
    assert written["model_type"] == "qwen2_moe"
    assert written["shared_expert_intermediate_size"] == ours.config.shared_expert_intermediate_size
    assert theirs.config.qkv_bias == ours.config.qkv_bias


@pytest.mark.parametrize("extra", [[], ["moe.mode=capacity", "moe.capacity_factor=0.5",
                                        "model.mlp_only_layers=[1]"],
                                   ["moe.backend=permute_free"]])
def test_graphs_lr0_bitwise(extra):
    check_emulated_lr0("tiny-qwen2-moe", ["model.shared_expert_intermediate_size=20", *extra])


def test_inspect_and_plan():
    code, out, err = run_cli("inspect", "--profile", "tiny-qwen2-moe", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["architecture"]["model_type"] == "qwen2_moe"
    shapes = info["layer_groups"][0]["shapes"]
    assert shapes["attn.q_proj.bias"] == [512] and shapes["attn.k_proj.bias"] == [256]
    assert shapes["moe.shared_expert.up_proj.weight"] == [512, 512]
    assert shapes["moe.shared_expert_gate.weight"] == [1, 512]
    params = info["params"]
    # the shared expert is always active: active = total - experts + k/E (2/8) of the experts
    assert params["active_per_token"] == params["total"] - params["experts"] * 3 // 4
    shared = 3 * 512 * 512 + 512  # gate/up/down of width 512, and its gate
    assert params["moe"] - params["experts"] == 2 * (shared + 8 * 512 + 512)  # + router, norm
    code, out, err = run_cli("plan", "--profile", "tiny-qwen2-moe", "--budget", "8GiB", "--json")
    assert code == 0, err
