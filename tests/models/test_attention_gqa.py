"""attention.GQA: SDPA's own grouped K/V heads (`native`, the default) against the expanded
heads on CPU in fp32 -- the same model, logits and gradients within 1e-6; the families whose
attention cannot take SDPA's grouped heads (sinks, a sliding window shorter than the sequence)
keep the expansion."""

import copy
from types import SimpleNamespace

import pytest
import torch

from moegraph_cli.models import MoeCausalLM
from moegraph_cli.models.common import attention
from moegraph_cli.train.trainer import batches

SMALL = ["model.vocab_size=96", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "model.num_hidden_layers=2", "model.num_experts=8",
         "model.num_experts_per_tok=2"]


def _run(model, ids):
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("profile,extra", [
    ("tiny-qwen3-moe", []),
    ("tiny-mixtral", ["model.sliding_window=4"]),  # shorter than the sequence: expanded
    ("tiny-gpt-oss", ["model.layer_types=[sliding_attention,full_attention]"]),  # sinks
])
def test_native_grouped_heads_match_expanded(profile, extra, monkeypatch):
    model = MoeCausalLM.from_profile(profile, dtype=torch.float32, overrides=SMALL + extra)
    ids = next(batches(96, 2, 7, 0, "cpu"))
    monkeypatch.setattr(attention, "GQA", "expand")
    want_logits, want = _run(copy.deepcopy(model), ids)
    monkeypatch.setattr(attention, "GQA", "native")
    calls = []  # enable_gqa of each SDPA call attention.py makes (the sinks' own not seen)
    real = torch.nn.functional
    monkeypatch.setattr(attention, "F", SimpleNamespace(
        scaled_dot_product_attention=lambda *a, **k: (calls.append(k.get("enable_gqa", False)),
                                                      real.scaled_dot_product_attention(
                                                          *a, **k))[1]))
    logits, got = _run(model, ids)
    torch.testing.assert_close(logits, want_logits, rtol=1e-6, atol=1e-6)
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], rtol=1e-6, atol=1e-6, msg=n)
    assert any(calls) == (profile == "tiny-qwen3-moe")


def test_native_is_the_default():
    assert attention.GQA == "native" or "MOEGRAPH_ATTN_GQA" in __import__("os").environ
