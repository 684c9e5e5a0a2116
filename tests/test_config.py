import json

import pytest

from moegraph_cli.config import ModelConfig, apply_overrides, load_profile, profile_names
from moegraph_cli.errors import UsageError


def test_shipped_profiles_have_the_published_shapes():
    assert {"tiny-qwen3-moe", "qwen3-30b-a3b", "qwen3-30b-a3b-4layer"} <= set(profile_names())
    tiny = load_profile("tiny-qwen3-moe")
    m = tiny.model
    assert (m.num_hidden_layers, m.hidden_size, m.num_attention_heads, m.num_key_value_heads,
            m.head_dim, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size,
            m.vocab_size) == (2, 512, 8, 4, 64, 8, 2, 256, 32000)
    assert (tiny.run.batch, tiny.run.seq_len) == (2, 512)
    big = load_profile("qwen3-30b-a3b").model
    assert (big.num_hidden_layers, big.hidden_size, big.num_attention_heads,
            big.num_key_value_heads, big.head_dim, big.num_experts, big.num_experts_per_tok,
            big.moe_intermediate_size, big.vocab_size, big.norm_topk_prob, big.rope_theta) == \
        (48, 2048, 32, 4, 128, 128, 8, 768, 151936, True, 1e6)
    four = load_profile("qwen3-30b-a3b-4layer")
    assert four.model.num_hidden_layers == 4 and (four.run.batch, four.run.seq_len) == (1, 1024)
    assert four.model.hidden_size == big.hidden_size


def test_overrides_are_type_checked():
    p = load_profile("tiny-qwen3-moe", ["run.seq_len=2048", "model.mlp_only_layers=[1]",
                                        "run.scopes=attn", "moe.mode=capacity",
                                        "run.lr=0"])
    assert p.run.seq_len == 2048 and p.model.mlp_only_layers == [1]
    assert p.run.scopes == ["attn"] and p.moe.capacity == 1.25 and p.run.lr == 0.0
    with pytest.raises(UsageError, match=r"--set run.seq_len: expected int, got 'long'"):
        apply_overrides(p, ["run.seq_len=long"])
    with pytest.raises(UsageError, match=r"--set 'run.sequence': unknown key; run fields are"):
        apply_overrides(p, ["run.sequence=3"])
    with pytest.raises(UsageError, match=r"--set 'runs.seq_len': unknown key"):
        apply_overrides(p, ["runs.seq_len=3"])
    with pytest.raises(UsageError, match=r"expected section.field=value"):
        apply_overrides(p, ["run.seq_len"])
    with pytest.raises(UsageError, match=r"moe.mode 'sometimes' must be dropless or capacity"):
        apply_overrides(p, ["moe.mode=sometimes"])
    with pytest.raises(UsageError, match=r"run.scopes: unknown scope 'mlp'"):
        apply_overrides(p, ["run.scopes=attn,mlp"])


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(UsageError, match=r"profile 'nope' not found; available: .*tiny-qwen3-moe"):
        load_profile("nope")


def _hf4():
    return {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
            "rope_theta": 5000.0, "rms_norm_eps": 1e-5, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "tie_word_embeddings": False}


def test_both_config_spellings_read_the_same():
    v4 = _hf4()
    v5 = dict(v4)
    v5["num_local_experts"] = v5.pop("num_experts")
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": v5.pop("rope_theta")}
    a, b = ModelConfig.from_hf_dict(v4), ModelConfig.from_hf_dict(json.loads(json.dumps(v5)))
    assert a == b and a.num_experts == 4 and a.rope_theta == 5000.0 and not a.norm_topk_prob


def test_config_rejects_unsupported_fields():
    d = _hf4()
    d["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(UsageError, match=r"rope type 'yarn' is not supported"):
        ModelConfig.from_hf_dict(d)
    d = _hf4()
    d["model_type"] = "llama"
    with pytest.raises(UsageError, match=r"model_type is 'llama'"):
        ModelConfig.from_hf_dict(d)
    d = _hf4()
    del d["hidden_size"]
    with pytest.raises(UsageError, match=r"missing required field 'hidden_size'"):
        ModelConfig.from_hf_dict(d)
