"""The models with the fused norm / rope kernels (models/common/fused.py) forced on under the
Triton interpreter (CPU, fp32) against the torch path: logits and every parameter's gradient
within 1e-5, as autograd's gradients and as sinks' written ones; and the switch's reach."""

import copy
import math

import pytest
import torch

from moegraph_cli import grads
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.models.common import fused
from moegraph_cli.train.trainer import allocate_grads, batches
from moegraph_kernels import rmsnorm

SMALL = ["model.vocab_size=96", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "model.num_hidden_layers=2", "model.num_experts=8",
         "model.num_experts_per_tok=2"]
FAMILIES = [
    # per-head q/k norm + rope: the fused rope kernel with its norm; half = 6 is masked
    ("tiny-qwen3-moe", ["model.head_dim=12"]),
    ("tiny-mixtral", []),  # rope alone
    ("tiny-olmoe", ["model.clip_qkv=0.5"]),  # norm over the projection, clip, rope alone
    ("tiny-deepseek-v3", ["model.num_key_value_heads=4", "model.head_dim=4",
                          "model.qk_rope_head_dim=4", "model.qk_nope_head_dim=6",
                          "model.v_head_dim=6", "model.q_lora_rank=12",
                          "model.kv_lora_rank=8"]),  # MLA: its latent norms only
]


def _run(model, ids, on_cpu, monkeypatch, sinks=False):
    monkeypatch.setattr(fused, "ON_CPU", on_cpu)
    if sinks:
        allocate_grads(model)
        for p in model.parameters():
            p.grad.fill_(math.nan)
            grads.sink(p)
        with grads.backward_pass(accumulate=False):
            out = model(ids, labels=ids)
            out.loss.backward()
    else:
        out = model(ids, labels=ids)
        out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("profile,extra", FAMILIES)
def test_fused_path_matches_torch_path(profile, extra, sinks, monkeypatch):
    monkeypatch.setattr(rmsnorm, "SCRATCH_FILL", math.nan)
    model = MoeCausalLM.from_profile(profile, dtype=torch.float32, overrides=SMALL + extra)
    ids = next(batches(96, 2, 6, 0, "cpu"))
    want_logits, want = _run(copy.deepcopy(model), ids, False, monkeypatch)
    logits, got = _run(model, ids, True, monkeypatch, sinks=sinks)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    for n, g in got.items():
        assert torch.isfinite(g).all(), n
        torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.parametrize("profile,extra", FAMILIES[:2])
def test_bnsd_rope_layout_matches_torch_path(profile, extra, monkeypatch):
    """The rope's other output layout (MOEGRAPH_ROPE_LAYOUT=bnsd) gives the same model."""
    monkeypatch.setattr(fused, "ROPE_LAYOUT", "bnsd")
    model = MoeCausalLM.from_profile(profile, dtype=torch.float32, overrides=SMALL + extra)
    ids = next(batches(96, 2, 6, 0, "cpu"))
    want_logits, want = _run(copy.deepcopy(model), ids, False, monkeypatch)
    logits, got = _run(model, ids, True, monkeypatch)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-5, msg=n)


def test_expand_heads_repeats_each_head_in_the_layout_of_q():
    from moegraph_cli.models.common.attention import expand_heads
    B, S, Nkv, D, rep = 2, 5, 3, 4, 2
    k = torch.randn(B, Nkv, S, D)
    want = k.repeat_interleave(rep, dim=1)
    q_bnsd = torch.randn(B, Nkv * rep, S, D)
    q_bsnd = torch.randn(B, S, Nkv * rep, D).transpose(1, 2)
    got = expand_heads(k, rep, like=q_bnsd)
    assert torch.equal(got, want) and got.is_contiguous()
    got = expand_heads(k.transpose(1, 2).contiguous().transpose(1, 2), rep, like=q_bsnd)
    assert torch.equal(got, want) and got.transpose(1, 2).is_contiguous()


def test_switch_reaches_the_kernels(monkeypatch):
    """ON_CPU routes norms and the rope through the kernels (their outputs differ from torch's
    in the last bits), ENABLED = False restores the torch path bitwise."""
    calls = []
    for name in ("rms_norm", "rms_norm_skip", "rms_norm_fork", "rope"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _f=real, _n=name, **k: (calls.append(_n),
                                                                             _f(*a, **k))[1])
    model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32, overrides=SMALL)
    ids = next(batches(96, 1, 8, 0, "cpu"))
    with torch.no_grad():
        want = model(ids).logits
        assert calls == []
        monkeypatch.setattr(fused, "ON_CPU", True)
        model(ids)
        # 2 layers: input norms (with their skip connection), post norms (with their skip
        # connection and two consumers, router and experts), q and k ropes (norm fused in);
        # the final norm.
        assert calls.count("rms_norm_skip") == 2 and calls.count("rms_norm_fork") == 2
        assert calls.count("rms_norm") == 1
        assert calls.count("rope") == 4
        monkeypatch.setattr(fused, "ENABLED", False)
        assert torch.equal(model(ids).logits, want)
