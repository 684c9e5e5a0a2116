"""Mixtral against transformers' MixtralForCausalLM (fp32, CPU), and through the product."""

import json

import pytest

from family_checks import check_emulated_lr0, check_hf_checkpoint, check_init_checkpoint
from cli_util import run_cli

transformers = pytest.importorskip("transformers")


def hf_config(**overrides):
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                  num_local_experts=6, num_experts_per_tok=3, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                  sliding_window=16, router_aux_loss_coef=0.05, max_position_embeddings=256)
    fields.update(overrides)
    cfg = transformers.MixtralConfig(**fields)
    cfg.architectures = ["MixtralForCausalLM"]
    return cfg


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True,
                                            "sliding_window": None}])
def test_transformers_checkpoint_loads_and_matches(tmp_path, overrides):
    ours = check_hf_checkpoint(tmp_path, hf_config(**overrides))
    cfg = ours.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 3, 24)
    assert cfg.head_dim == 12 and cfg.rope_theta == 5000.0 and cfg.rms_norm_eps == 1e-6
    assert cfg.sliding_window == overrides.get("sliding_window", 16)
    assert not hasattr(ours.layers[0].attn, "q_norm")


@pytest.mark.parametrize("overrides", [[], ["model.sliding_window=8",
                                            "model.tie_word_embeddings=true"]])
def test_init_checkpoint_loads_in_transformers(tmp_path, overrides):
    ours, theirs = check_init_checkpoint(tmp_path, "tiny-mixtral", overrides)
    written = json.loads((tmp_path / "init" / "config.json").read_text())
    assert written["model_type"] == "mixtral" and written["num_local_experts"] == 8
    assert written["intermediate_size"] == 16  # the expert width, in Mixtral's spelling
    assert theirs.config.sliding_window == ours.config.sliding_window


@pytest.mark.parametrize("extra", [[], ["moe.mode=capacity", "moe.capacity_factor=0.5",
                                        "model.sliding_window=4"]])
def test_graphs_lr0_bitwise(extra):
    check_emulated_lr0("tiny-mixtral", extra)


def test_inspect_and_plan():
    code, out, err = run_cli("inspect", "--profile", "tiny-mixtral", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["architecture"]["model_type"] == "mixtral"
    shapes = info["layer_groups"][0]["shapes"]
    assert "attn.q_norm.weight" not in shapes
    assert shapes["moe.w_gate_up"] == [8, 512, 512] and shapes["moe.router.weight"] == [8, 512]
    code, out, err = run_cli("plan", "--profile", "tiny-mixtral", "--budget", "8GiB", "--json")
    assert code == 0, err
    assert json.loads(out)["key"]["profile"] == "tiny-mixtral"


def test_mixtral_refuses_what_it_lacks():
    code, out, err = run_cli("inspect", "--profile", "tiny-mixtral", "--set",
                             "model.mlp_only_layers=[0]")
    assert code == 2 and "mlp_only_layers is not a mixtral setting" in err


def test_sliding_window_attention_flops():
    import dataclasses

    from moegraph_cli.config import load_profile
    from moegraph_cli.report.flops import step_flops

    cfg = load_profile("tiny-mixtral").model
    full = step_flops(cfg, 1, 512)
    windowed = step_flops(dataclasses.replace(cfg, sliding_window=128), 1, 512)
    per_pair = 6.0 * 2 * 8 * 64  # layers x heads x head_dim, fwd + bwd
    assert full - windowed == per_pair * (512 * 512 - (2 * 512 * 128 - 128 * 128))
    assert step_flops(dataclasses.replace(cfg, sliding_window=4096), 1, 512) == full
