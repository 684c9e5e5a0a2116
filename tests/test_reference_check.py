"""`verify --reference transformers` compares fp32 copies, whatever the training dtype."""

import pytest
import torch

from moegraph_cli.models import MoeCausalLM
from moegraph_cli.commands.reference_check import honour_config, logits_parity

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
    from moegraph_cli.commands import reference_check

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


def test_parity_reports_router_margins():
    model = MoeCausalLM.from_profile("tiny-qwen2-moe", dtype=torch.float32, overrides=SMALL)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    r = logits_parity(model, ids)
    assert r["passed"] and r["min_router_margin"] > 0
    assert r["max_abs_before_near_tie"] == r["max_abs"] or r["first_near_tie"] is not None


def test_an_exact_router_tie_is_found_at_the_first_position():
    """Every router row equal: every token's k-th and (k+1)-th scores tie in every layer."""
    from moegraph_cli.commands.reference_check import logits_and_margins

    model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32, overrides=SMALL)
    with torch.no_grad():
        for layer in model.layers:
            if layer.is_moe:
                w = layer.moe.router.weight
                w.copy_(w[:1].expand_as(w))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    logits, margin = logits_and_margins(model, ids)
    assert logits.shape[:2] == ids.shape and margin.shape == ids.shape
    assert (margin == 0).all()


def test_explain_gap_compares_the_prefix_before_the_first_tie():
    from moegraph_cli.commands.reference_check import explain_gap

    gap = torch.tensor([[1e-6, 2e-6, 5e-2, 3e-2], [1e-6, 3e-6, 1e-6, 4e-6]])
    margin = torch.tensor([[0.3, 0.2, 1e-7, 0.5], [0.1, 0.2, 0.3, float("inf")]])
    r = explain_gap(gap, margin)
    assert r["near_ties"] == 1 and r["first_near_tie"] == 2 and r["first_over_tolerance"] == 2
    assert r["max_abs_before_near_tie"] == pytest.approx(4e-6)
    assert r["min_router_margin"] == pytest.approx(1e-7)
    none = explain_gap(gap[1:], margin[1:])
    assert none["first_near_tie"] is None and none["first_over_tolerance"] is None
    assert none["max_abs_before_near_tie"] == pytest.approx(4e-6)


def test_verify_renders_the_near_tie_line_only_when_there_is_one(monkeypatch):
    import io

    from rich.console import Console

    from moegraph_cli.report import render

    def shown(ref):
        buf = io.StringIO()
        monkeypatch.setattr(render, "out", Console(file=buf, width=200))
        render.verify_result({"profile": "p", "lr": 0.0, "scopes": ["attn"], "eager_losses": [1.0],
                              "graph_losses": [1.0], "grad_max_abs": 0.0, "grad_worst": "w",
                              "reference": ref, "passed": True, "verdict": "v"},
                             as_json=False)
        return buf.getvalue()

    base = {"impl": "transformers", "max_abs": 0.09, "tolerance": 1e-4, "passed": False,
            "min_router_margin": 4.3e-06, "near_ties": 3, "first_near_tie": 259,
            "first_over_tolerance": 333, "max_abs_before_near_tie": 4.2e-05}
    text = shown(base)
    assert "max-abs 0.09 (tolerance 0.0001)" in text
    assert "near-tie (margin 4.3e-06) first at position 259; max-abs before it 4.2e-05" in text
    assert "first position over tolerance: 333" in text
    clean = dict(base, max_abs=2e-6, passed=True, first_near_tie=None, near_ties=0,
                 first_over_tolerance=None, max_abs_before_near_tie=2e-6, min_router_margin=0.3)
    assert "near-tie" not in shown(clean)
    assert "ignores" not in shown(dict(clean, reference_set_from_config=[]))
    text = shown(dict(clean, reference_set_from_config=["swiglu_alpha", "swiglu_limit"]))
    assert "this transformers ignores swiglu_alpha, swiglu_limit of the config" in text


GPT_OSS_SWIGLU = ["model.swiglu_limit=0.3", "model.swiglu_alpha=1.5"]


def test_a_reference_that_ignores_the_swiglu_fields_is_given_them():
    """transformers 5.17's GptOssExperts hard-codes alpha 1.702 and limit 7.0 whatever the
    config says (5.25 reads the config): such a reference is set from its config, and the
    fields are named."""
    import transformers

    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16,
                                    num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, swiglu_limit=0.3, swiglu_alpha=1.5)
    hf = transformers.GptOssForCausalLM(cfg)
    experts = [m for m in hf.modules() if type(m).__name__ == "GptOssExperts"]
    assert experts
    for m in experts:  # as a release that ignores the fields builds them
        m.alpha, m.limit = 1.702, 7.0
    assert honour_config(hf) == ["swiglu_alpha", "swiglu_limit"]
    assert all((m.alpha, m.limit) == (1.5, 0.3) for m in experts)
    assert honour_config(hf) == []


def test_gpt_oss_parity_with_its_own_swiglu_fields():
    """Clamps that act on these weights (limit 0.3), under any transformers release: the
    result names the fields where this one ignores them."""
    model = MoeCausalLM.from_profile("tiny-gpt-oss", dtype=torch.float32,
                                     overrides=[*SMALL, *GPT_OSS_SWIGLU])
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    r = logits_parity(model, ids)
    assert r["passed"] and r["max_abs"] <= 1e-4, r
    assert r["reference_set_from_config"] in ([], ["swiglu_alpha", "swiglu_limit"])
