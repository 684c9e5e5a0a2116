"""`verify --reference transformers` compares fp32 copies, whatever the training dtype."""

import pytest
import torch

from moegraph_cli.models import MoeCausalLM
from moegraph_cli.reference_check import logits_parity

pytest.importorskip("transformers")

SMALL = ["model.vocab_size=128", "model.hidden_size=64", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=16", "model.moe_intermediate_size=32"]


@pytest.mark.parametrize("profile", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe",
                                     "tiny-qwen2-moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_is_checked_in_fp32(dtype, profile):
    """Against the family's own transformers class."""
    model = MoeCausalLM.from_profile(profile, dtype=dtype, overrides=SMALL)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    r = logits_parity(model, ids)
    assert r["compared_in"] == "float32" and r["passed"], r
    assert r["max_abs"] <= 1e-4
    assert r["model_dtype"] == str(dtype).replace("torch.", "")


def test_a_wrong_weight_is_caught():
    model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32, overrides=SMALL)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    from moegraph_cli import reference_check

    real = reference_check.fp32_reference_copy

    def broken(m):
        copy = real(m)
        with torch.no_grad():
            copy.layers[0].attn.o_proj.weight.mul_(1.05)
        return copy

    reference_check.fp32_reference_copy = broken
    try:
        r = logits_parity(model, ids)
    finally:
        reference_check.fp32_reference_copy = real
    assert not r["passed"] and r["max_abs"] > 1e-4
