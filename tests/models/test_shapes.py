"""Parameter shapes from the config and the family (models/common/shapes.py): for every shipped
profile, and for variants that switch each family's optional parameters on or off, they are
the names and shapes of the model built on the meta device, and the checkpoint's name table
fills exactly them, in the same order."""

import pytest
import torch

from moegraph_cli import models
from moegraph_cli.config import load_profile, profile_names
from moegraph_cli.io.hf_names import hf_to_moegraph_names, moegraph_shapes
from moegraph_cli.models.common.shapes import param_shapes
from moegraph_cli.report.summary import layer_shapes

# Settings that add or remove parameters, on the tiny profiles (layer counts kept small).
VARIANTS = {
    "qwen3-tied-sparse-step": ("tiny-qwen3-moe", ["model.tie_word_embeddings=true",
                                                  "model.num_hidden_layers=4",
                                                  "model.decoder_sparse_step=2",
                                                  "model.mlp_only_layers=[3]"]),
    "qwen2-no-shared-no-bias": ("tiny-qwen2-moe", ["model.shared_expert_intermediate_size=0",
                                                   "model.qkv_bias=false",
                                                   "model.mlp_only_layers=[1]"]),
    "olmoe-biases": ("tiny-olmoe", ["model.attention_bias=true"]),
    "deepseek-plain-q-biases": ("tiny-deepseek-v3", ["model.q_lora_rank=null",
                                                     "model.attention_bias=true",
                                                     "model.n_shared_experts=0",
                                                     "model.first_k_dense_replace=0"]),
    "deepseek-q-lora-biases": ("tiny-deepseek-v3", ["model.attention_bias=true"]),
    "gpt-oss-no-attention-bias": ("tiny-gpt-oss", ["model.attention_bias=false"]),
}

CASES = [(name, []) for name in profile_names()] + list(VARIANTS.values())
IDS = profile_names() + list(VARIANTS)


def built_shapes(prof) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = models.MoeCausalLM(prof.model, prof.moe)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("profile, overrides", CASES, ids=IDS)
def test_param_shapes_are_the_models_and_the_name_tables(profile, overrides):
    prof = load_profile(profile, overrides)
    shapes = param_shapes(prof.model)
    assert shapes == built_shapes(prof)
    table = moegraph_shapes(prof.model)
    assert list(shapes.items()) == list(table.items())  # same order: a load's result order
    per_expert = {s.name for s in hf_to_moegraph_names(prof.model).values()}
    assert per_expert == set(shapes)


def test_the_variants_change_what_they_should():
    """The variants above reach each optional parameter (else they test nothing new)."""
    def names(key):
        profile, overrides = VARIANTS[key]
        return set(param_shapes(load_profile(profile, overrides).model))

    assert "lm_head.weight" not in names("qwen3-tied-sparse-step")
    assert {"layers.0.mlp.up_proj.weight", "layers.1.moe.w_down",
            "layers.3.mlp.up_proj.weight"} <= names("qwen3-tied-sparse-step")
    assert not any("shared_expert" in n or n.endswith("_proj.bias")
                   for n in names("qwen2-no-shared-no-bias"))
    assert "layers.0.attn.o_proj.bias" in names("olmoe-biases")
    plain_q = names("deepseek-plain-q-biases")
    assert "layers.0.attn.q_proj.weight" in plain_q and "layers.0.attn.q_a_proj.weight" not in plain_q
    assert "layers.0.moe.e_score_correction_bias" in plain_q
    assert {"layers.0.attn.q_a_proj.bias", "layers.0.attn.kv_a_proj_with_mqa.bias",
            "layers.2.moe.shared_expert.down_proj.weight"} <= names("deepseek-q-lora-biases")
    no_bias = names("gpt-oss-no-attention-bias")
    assert "layers.0.attn.sinks" in no_bias and "layers.0.moe.b_down" in no_bias
    assert "layers.0.attn.q_proj.bias" not in no_bias


def test_inspect_reads_them_per_layer():
    cfg = load_profile("tiny-qwen2-moe").model
    for i in range(cfg.num_hidden_layers):
        want = {k: list(v) for k, v in cfg.family.layer_shapes(cfg, i).items()}
        assert layer_shapes(cfg, i) == want
    assert layer_shapes(cfg, 0)["moe.shared_expert_gate.weight"] == [1, cfg.hidden_size]
