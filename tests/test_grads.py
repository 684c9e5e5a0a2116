"""Gradients written, not added (moegraph_cli/grads.py) on the CPU: every parameter of the model
gets its gradient written over whatever `.grad` held (NaN-poisoned here), equal to autograd's;
accumulate mode adds; tied embeddings add the head's and the embedding's; micro-batches equal
one big batch; the permute-free expert kernels write and accumulate under the interpreter."""

import copy
import math

import pytest
import torch

from moegraph_cli import grads
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.trainer import allocate_grads, batches

SMALL = ["model.vocab_size=96", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "model.num_hidden_layers=2", "model.num_experts=8",
         "model.num_experts_per_tok=2"]


def _model(extra=()):
    return MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32,
                                    overrides=SMALL + list(extra))


def _reference_grads(model, ids):
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = None
        grads.sink(p, False)
    ref(ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _sinks(model, fill=math.nan):
    allocate_grads(model)
    for p in model.parameters():
        p.grad.fill_(fill)
        grads.sink(p)


@pytest.mark.parametrize("extra", [[], ["model.tie_word_embeddings=true"],
                                   ["model.mlp_only_layers=[1]"],
                                   ["moe.mode=capacity", "moe.capacity_factor=0.5"]])
def test_write_mode_overwrites_poisoned_grads_with_autograds(extra):
    model = _model(extra)
    ids = next(batches(96, 2, 12, 0, "cpu"))
    want = _reference_grads(model, ids)
    _sinks(model)
    with grads.backward_pass(accumulate=False):
        model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), n
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("profile,extra", [
    ("tiny-mixtral", ["model.sliding_window=4"]),
    ("tiny-olmoe", ["model.attention_bias=true", "model.clip_qkv=0.5"]),
    ("tiny-qwen2-moe", ["model.shared_expert_intermediate_size=24", "model.mlp_only_layers=[0]"]),
    ("tiny-deepseek-v3", ["model.num_key_value_heads=4", "model.head_dim=4",
                          "model.qk_rope_head_dim=4", "model.qk_nope_head_dim=6",
                          "model.v_head_dim=10", "model.q_lora_rank=12", "model.kv_lora_rank=8",
                          "model.attention_bias=true"]),
    ("tiny-deepseek-v3", ["model.num_key_value_heads=4", "model.head_dim=4",
                          "model.qk_rope_head_dim=4", "model.qk_nope_head_dim=6",
                          "model.v_head_dim=6", "model.q_lora_rank=null", "model.kv_lora_rank=8",
                          "model.rope_interleave=false"]),
])
def test_write_mode_for_every_family(profile, extra):
    """Biases, q/k norms over the projection, the shared expert (gated and not), MLA's
    projections and latent norms and the grouped sigmoid router write their grads too."""
    model = MoeCausalLM.from_profile(profile, dtype=torch.float32, overrides=SMALL + extra)
    ids = next(batches(96, 2, 12, 0, "cpu"))
    want = _reference_grads(model, ids)
    _sinks(model)
    with grads.backward_pass(accumulate=False):
        model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), n
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7, msg=n)


def test_accumulate_mode_adds_to_what_grad_holds():
    model = _model()
    ids = next(batches(96, 2, 12, 0, "cpu"))
    want = _reference_grads(model, ids)
    _sinks(model, fill=0.5)
    with grads.backward_pass(accumulate=True):
        model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n] + 0.5, rtol=1e-6, atol=1e-6, msg=n)


def test_no_autograd_accumulation_reaches_a_sink():
    """Nothing reaches AccumulateGrad: `.grad` keeps its identity (a fixed address) and a
    second write-mode backward gives the same gradient, not twice it."""
    model = _model(["model.tie_word_embeddings=true"])
    ids = next(batches(96, 2, 12, 0, "cpu"))
    _sinks(model)
    before = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
    outs = []
    for _ in range(2):
        with grads.backward_pass(accumulate=False):
            model(ids, labels=ids).loss.backward()
        outs.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n, p in model.named_parameters():
        assert p.grad.data_ptr() == before[n], n
        assert torch.equal(outs[0][n], outs[1][n]), n


def test_micro_batches_equal_one_batch():
    """k micro-batches (loss / k each, the later ones accumulating) give the gradients of one
    batch of k times the size, within fp32 rounding (the aux loss off: it pools statistics
    over the batch, which micro-batches cannot)."""
    extra = ["model.router_aux_loss_coef=0.0"]
    big, micro = _model(extra), _model(extra)
    ids = next(batches(96, 4, 12, 3, "cpu"))
    want = _reference_grads(big, ids)
    _sinks(micro)
    for i, part in enumerate(ids.chunk(2)):
        with grads.backward_pass(accumulate=i > 0):
            (micro(part, labels=part).loss / 2).backward()
    for n, p in micro.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_non_sink_parameters_keep_autograds_contract():
    w = torch.nn.Parameter(torch.randn(3, 4))
    x = torch.randn(5, 4, requires_grad=True)
    from moegraph_cli.models.common.linear import linear
    linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(5, 3).t() @ x.detach())
    grads.sink(w)
    w.grad.fill_(math.nan)
    with grads.backward_pass(accumulate=False):
        linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(5, 3).t() @ x.detach())


def test_permute_free_wgrad_writes_and_accumulates_into_sinks():
    """The expert kernels (interpreter, fp32) write dW into a NaN-poisoned `.grad`, including
    exact zeros for an expert with no tokens, and add to it in accumulate mode."""
    from moegraph_cli.moe.experts import permute_free_moe

    torch.manual_seed(0)
    T, H, F, E, k = 9, 16, 8, 4, 2
    x = torch.randn(T, H, requires_grad=True)
    ids = torch.tensor([[0, 1]] * T)  # experts 2 and 3 get nothing
    w = torch.full((T, k), 0.5, requires_grad=True)
    w_gu = torch.nn.Parameter(torch.randn(E, 2 * F, H) * 0.1)
    w_d = torch.nn.Parameter(torch.randn(E, H, F) * 0.1)
    dout = torch.randn(T, H)
    permute_free_moe(x, ids, w, w_gu, w_d).backward(dout)
    want = (w_gu.grad.clone(), w_d.grad.clone())
    for p in (w_gu, w_d):
        p.grad.fill_(math.nan)
        grads.sink(p)
    with grads.backward_pass(accumulate=False):
        permute_free_moe(x, ids, w, w_gu, w_d).backward(dout)
    assert torch.equal(w_gu.grad, want[0]) and torch.equal(w_d.grad, want[1])
    assert torch.equal(w_gu.grad[2:], torch.zeros_like(w_gu.grad[2:]))
    with grads.backward_pass(accumulate=True):
        permute_free_moe(x, ids, w, w_gu, w_d).backward(dout)
    torch.testing.assert_close(w_gu.grad, 2 * want[0])
    torch.testing.assert_close(w_d.grad, 2 * want[1])
