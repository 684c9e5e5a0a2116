"""The model's MoE scope gives the same result on either expert backend (CPU, interpreter)."""

import pytest
import torch

from moegraph_cli.models import MoeCausalLM

SMALL = ["model.vocab_size=64", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.num_hidden_layers=1"]


@pytest.mark.parametrize("profile", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe",
                                     "tiny-qwen2-moe"])
def test_permute_free_backend_matches_reference_in_the_model(profile):
    """Every family's moe scope (Qwen2-MoE's with its shared expert) on either backend."""
    ref = MoeCausalLM.from_profile(profile, dtype=torch.float32,
                                   overrides=SMALL + ["moe.backend=reference"])
    pf = MoeCausalLM.from_profile(profile, dtype=torch.float32,
                                  overrides=SMALL + ["moe.backend=permute_free"])
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    a, b = ref(ids, labels=ids), pf(ids, labels=ids)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    a.loss.backward()
    b.loss.backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), pf.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
