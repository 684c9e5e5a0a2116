"""The architecture registry: families found by file, the choice by model_type, each family's
key map agreeing with the modules it builds, config.json round trips, and the refusal of an
unsupported model_type."""

import dataclasses
import json

import pytest
import torch

from moegraph_cli import models
from moegraph_cli.io.hf_names import moegraph_shapes
from moegraph_cli.config import ModelConfig, load_profile, profile_names
from moegraph_cli.errors import UsageError

from cli_util import run_cli

TINY = {"qwen3_moe": "tiny-qwen3-moe", "mixtral": "tiny-mixtral", "olmoe": "tiny-olmoe",
        "qwen2_moe": "tiny-qwen2-moe", "deepseek_v3": "tiny-deepseek-v3",
        "gpt_oss": "tiny-gpt-oss"}


def test_every_family_is_found_and_has_a_tiny_profile():
    assert models.supported_types() == sorted(TINY)
    assert all(name in profile_names() for name in TINY.values())
    transformers = pytest.importorskip("transformers")
    for fam in models.families().values():
        assert hasattr(transformers, fam.architecture), fam.architecture


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_key_map_names_every_parameter_the_family_builds(model_type):
    prof = load_profile(TINY[model_type], ["model.num_hidden_layers=3"])
    with torch.device("meta"):
        model = models.MoeCausalLM(prof.model, prof.moe)
    built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert built == moegraph_shapes(prof.model)
    assert model.config.family is models.family_of(model_type)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_from_profile_picks_the_family(model_type):
    model = models.from_profile(TINY[model_type], seed=1, overrides=["model.vocab_size=64"])
    assert model.config.model_type == model_type
    assert model.embed_tokens.weight.dtype == torch.bfloat16  # the profile's dtype


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_config_json_round_trip_in_both_spellings(model_type):
    cfg = load_profile(TINY[model_type]).model
    d = cfg.to_hf_dict()
    assert d["model_type"] == model_type and d["architectures"] == [cfg.family.architecture]
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(d))) == cfg
    # transformers 5.x: rope_parameters instead of rope_theta
    v5 = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**(d["rope_scaling"] or {"rope_type": "default"}),  # yarn: DeepSeek
                             "rope_theta": cfg.rope_theta}
    assert ModelConfig.from_hf_dict(v5) == cfg


def test_fields_a_family_does_not_read_are_ignored_in_config_json():
    d = load_profile("tiny-qwen3-moe").model.to_hf_dict()
    d.update(clip_qkv=0.5, shared_expert_intermediate_size=64, qkv_bias=True)
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.clip_qkv, cfg.shared_expert_intermediate_size, cfg.qkv_bias) == (None, 0, False)


def test_unsupported_model_type_is_refused_naming_the_supported(tmp_path):
    with pytest.raises(UsageError, match="model_type is 'jamba'; moegraph reads "
                                         "'deepseek_v3', 'gpt_oss', 'mixtral', 'olmoe', "
                                         "'qwen2_moe', 'qwen3_moe'"):
        ModelConfig.from_hf_dict({**ModelConfig().to_hf_dict(), "model_type": "jamba"})
    ckpt = tmp_path / "ck"
    code, _, err = run_cli("init", "tiny-mixtral", ckpt, "--set", "model.vocab_size=64",
                           "--set", "model.hidden_size=32", "--set", "model.head_dim=8")
    assert code == 0, err
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "dbrx"}))
    code, out, err = run_cli("inspect", ckpt)
    assert code == 2 and out == ""
    assert err.strip().endswith("model_type is 'dbrx'; moegraph reads 'deepseek_v3', "
                                "'gpt_oss', 'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe'")
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_cli("plan", "--budget", "8GiB", "--set", "model.model_type=jamba")
    assert code == 2 and "model.model_type is 'jamba'; moegraph reads 'deepseek_v3'" in err


def test_a_family_refuses_settings_it_does_not_have():
    cfg = load_profile("tiny-qwen3-moe").model
    for field, value in [("clip_qkv", 0.5), ("shared_expert_intermediate_size", 64),
                         ("qkv_bias", True), ("sliding_window", 128)]:
        with pytest.raises(UsageError, match=f"model.{field}"):
            dataclasses.replace(cfg, **{field: value}).validate()


@pytest.mark.parametrize("model_type,field", [("mixtral", "rms_norm_eps"),
                                              ("mixtral", "num_local_experts"),
                                              ("olmoe", "norm_topk_prob"),
                                              ("qwen2_moe", "shared_expert_intermediate_size"),
                                              ("deepseek_v3", "n_group"),
                                              ("deepseek_v3", "rope_interleave"),
                                              ("deepseek_v3", "q_lora_rank")])
def test_a_field_transformers_would_default_is_required(model_type, field):
    """No class default stands in for a field config.json leaves out."""
    d = load_profile(TINY[model_type]).model.to_hf_dict()
    del d[field]
    with pytest.raises(UsageError, match=f"config.json: missing required field '{field}'"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("model_type,name,alias", [
    ("qwen3_moe", "num_experts", "num_local_experts"), ("qwen2_moe", "num_experts",
                                                        "num_local_experts"),
    ("olmoe", "num_experts", "num_local_experts"), ("mixtral", "num_local_experts",
                                                    "num_experts"),
    ("gpt_oss", "num_local_experts", "num_experts"),
    ("deepseek_v3", "n_routed_experts", "num_local_experts")])
def test_two_spellings_of_the_expert_count_must_agree(model_type, name, alias):
    """Which spelling transformers reads depends on its version: two that disagree are
    refused naming both; two that agree load."""
    from moegraph_cli.models.registry import families

    family = families()[model_type]
    with pytest.raises(UsageError, match=f"{name} 8 and {alias} 4 disagree"):
        family.read_config({name: 8, alias: 4}, "config.json")
    try:  # agreeing spellings get past that check (other fields may still be missing)
        family.read_config({name: 8, alias: 8}, "config.json")
    except UsageError as e:
        assert "disagree" not in str(e)
