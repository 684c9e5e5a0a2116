"""OLMoE against transformers' OlmoeForCausalLM (fp32, CPU), and through the product."""

import json

import pytest

from family_checks import check_emulated_lr0, check_hf_checkpoint, check_init_checkpoint
from cli_util import run_cli

transformers = pytest.importorskip("transformers")


def hf_config(**overrides):
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                  num_experts_per_tok=3, norm_topk_prob=True, clip_qkv=0.6,
                  attention_bias=True, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                  router_aux_loss_coef=0.05, max_position_embeddings=256)
    fields.update(overrides)
    cfg = transformers.OlmoeConfig(**fields)
    cfg.architectures = ["OlmoeForCausalLM"]
    return cfg


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": False, "clip_qkv": None,
                                            "attention_bias": False,
                                            "tie_word_embeddings": True}])
def test_transformers_checkpoint_loads_and_matches(tmp_path, overrides):
    ours = check_hf_checkpoint(tmp_path, hf_config(**overrides))
    cfg = ours.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 3, 24)
    assert cfg.clip_qkv == overrides.get("clip_qkv", 0.6)
    assert cfg.norm_topk_prob == overrides.get("norm_topk_prob", True)
    attn = ours.layers[0].attn
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (16,)
    assert (attn.q_proj.bias is not None) == cfg.attention_bias
    assert (attn.o_proj.bias is not None) == cfg.attention_bias


def test_clip_qkv_bites(tmp_path):
    """The clamp is live in the parity test above: without it the logits differ."""
    import torch

    from moegraph_cli import models

    check_hf_checkpoint(tmp_path, hf_config())
    clipped = models.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    free = models.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for layer in free.layers:
        layer.attn.clip_qkv = None
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = (clipped(ids).logits - free(ids).logits).abs().max().item()
    assert gap > 1e-3


@pytest.mark.parametrize("overrides", [[], ["model.clip_qkv=0.5", "model.norm_topk_prob=true",
                                            "model.attention_bias=true"]])
def test_init_checkpoint_loads_in_transformers(tmp_path, overrides):
    ours, theirs = check_init_checkpoint(tmp_path, "tiny-olmoe", overrides)
    written = json.loads((tmp_path / "init" / "config.json").read_text())
    assert written["model_type"] == "olmoe" and written["intermediate_size"] == 16
    assert "head_dim" not in written  # OLMoE derives it
    assert theirs.config.clip_qkv == ours.config.clip_qkv


@pytest.mark.parametrize("extra", [[], ["moe.mode=capacity", "moe.capacity_factor=0.5",
                                        "model.clip_qkv=0.5", "model.attention_bias=true"]])
def test_graphs_lr0_bitwise(extra):
    check_emulated_lr0("tiny-olmoe", extra)


def test_inspect_and_plan():
    code, out, err = run_cli("inspect", "--profile", "tiny-olmoe", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["architecture"]["model_type"] == "olmoe"
    shapes = info["layer_groups"][0]["shapes"]
    assert shapes["attn.q_norm.weight"] == [512] and shapes["attn.k_norm.weight"] == [512]
    assert shapes["moe.w_gate_up"] == [16, 256, 512]
    code, out, err = run_cli("plan", "--profile", "tiny-olmoe", "--budget", "8GiB", "--json")
    assert code == 0, err


def test_olmoe_head_dim_is_derived():
    code, out, err = run_cli("inspect", "--profile", "tiny-olmoe", "--set", "model.head_dim=32")
    assert code == 2 and "its q norm spans hidden_size" in err
