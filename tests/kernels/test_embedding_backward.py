"""The embedding backward kernel (interpreter, fp32) writes into `.grad` what torch's
F.embedding backward computes, bit for bit (both sum a row's tokens in token order from zero):
duplicates, unused rows, write mode over NaN, accumulate mode, tied with a GEMM-written head,
and the whole model's embedding through it."""

import copy
import math

import pytest
import torch

from moegraph_cli import grads
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.models.common import embedding as embedding_mod
from moegraph_cli.models.common.embedding import embedding
from moegraph_cli.models.common.linear import linear
from moegraph_cli.train.trainer import allocate_grads, batches
from moegraph_kernels import embedding_backward as kernel_mod
from moegraph_kernels.embedding_backward import embedding_backward_into, embedding_backward_ref


def _ids(kind, T, V, gen):
    if kind == "uniform":
        return torch.randint(0, V, (T,), generator=gen)
    if kind == "one_row":  # every token the same id: one run across many loop iterations
        return torch.full((T,), V - 1, dtype=torch.long)
    if kind == "few_rows":  # heavy duplicates, most rows unused
        return torch.tensor([3, 7, 3, 3, 0, 7, 3, 11, 3, 0])[torch.randint(0, 10, (T,),
                                                                          generator=gen)]
    raise ValueError(kind)


def _torch_dense(dy, ids, V):
    w = torch.zeros(V, dy.shape[-1], requires_grad=True)
    torch.nn.functional.embedding(ids, w).backward(dy)
    return w.grad


CASES = [("uniform", 37, 50, 24), ("uniform", 64, 8, 96), ("one_row", 29, 6, 16),
         ("few_rows", 45, 13, 70), ("uniform", 1, 5, 8)]


@pytest.mark.parametrize("kind,T,V,H", CASES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_write_mode_over_nan_is_torchs_gradient_bitwise(kind, T, V, H, ids_dtype):
    gen = torch.Generator().manual_seed(T + V + H)
    ids = _ids(kind, T, V, gen)
    dy = torch.randn(T, H, generator=gen)
    out = torch.full((V, H), math.nan)
    embedding_backward_into(dy, ids.to(ids_dtype), out, accumulate=False)
    want = _torch_dense(dy, ids, V)
    assert torch.isfinite(out).all()
    assert torch.equal(out, want)
    unused = torch.ones(V, dtype=torch.bool)
    unused[ids] = False
    assert (out[unused] == 0).all()
    assert torch.equal(out, embedding_backward_ref(dy, ids, V))


@pytest.mark.parametrize("kind,T,V,H", CASES)
def test_accumulate_mode_adds_and_leaves_unused_rows(kind, T, V, H):
    gen = torch.Generator().manual_seed(T * V)
    ids = _ids(kind, T, V, gen)
    dy = torch.randn(T, H, generator=gen)
    before = torch.randn(V, H, generator=gen)
    out = before.clone()
    embedding_backward_into(dy, ids, out, accumulate=True)
    assert torch.equal(out, before + _torch_dense(dy, ids, V))  # grad.add_(dense), bitwise
    unused = torch.ones(V, dtype=torch.bool)
    unused[ids] = False
    assert torch.equal(out[unused], before[unused])


def test_strided_rows_and_deterministic():
    """dy and out with row strides past H (views into wider buffers); two runs agree bitwise."""
    gen = torch.Generator().manual_seed(4)
    T, V, H = 40, 9, 20
    ids = _ids("few_rows", T, V + 3, gen).clamp(max=V - 1)
    dy = torch.randn(T, H + 5, generator=gen)[:, :H]
    outs = []
    for _ in range(2):
        out = torch.full((V, H + 3), math.nan)[:, :H]
        embedding_backward_into(dy, ids, out, accumulate=False)
        outs.append(out.clone())
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], _torch_dense(dy, ids, V))


def _sink(w, fill):
    w.grad = torch.full_like(w, fill)
    grads.sink(w)


def test_function_writes_a_sink_and_returns_a_plain_parameters_gradient():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (3, 7), generator=gen)
    dy = torch.randn(3, 7, 16, generator=gen)
    w = torch.nn.Parameter(torch.randn(12, 16, generator=gen))
    embedding(ids, w, impl="triton").backward(dy)  # not a sink: autograd's contract
    want = w.grad.clone()
    assert torch.equal(want, _torch_dense(dy, ids, 12))
    _sink(w, math.nan)
    ptr = w.grad.data_ptr()
    with grads.backward_pass(accumulate=False):
        y = embedding(ids, w, impl="triton")
        assert torch.equal(y, w.detach()[ids])
        y.backward(dy)
    assert w.grad.data_ptr() == ptr and torch.equal(w.grad, want)
    with grads.backward_pass(accumulate=True):
        embedding(ids, w, impl="triton").backward(dy)
    assert torch.equal(w.grad, want + want)


def test_tied_with_a_gemm_written_head_adds_in_one_pass():
    """The head's GEMM writes `.grad` first in the pass (grads.target: the embedding must then
    add, and must not zero what the head wrote)."""
    gen = torch.Generator().manual_seed(1)
    V, H = 10, 8
    ids = torch.randint(0, V, (2, 6), generator=gen)
    w0 = torch.randn(V, H, generator=gen)
    dout = torch.randn(2, 6, V, generator=gen)

    def loss(w, impl):
        return (linear(embedding(ids, w, impl=impl) * 1.5, w) * dout).sum()

    ref = torch.nn.Parameter(w0.clone())
    loss(ref, "reference").backward()
    w = torch.nn.Parameter(w0.clone())
    _sink(w, math.nan)
    with grads.backward_pass(accumulate=False):
        loss(w, "triton").backward()
    assert torch.isfinite(w.grad).all()
    torch.testing.assert_close(w.grad, ref.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_model_embedding_through_the_kernel(monkeypatch, tied):
    """The model's embedding takes the kernel path (forced on the CPU): write mode over NaN and
    accumulate mode give autograd's gradients; untied, the embedding's is bitwise the same."""
    small = ["model.vocab_size=96", "model.hidden_size=32", "model.num_attention_heads=4",
             "model.num_key_value_heads=2", "model.head_dim=8",
             "model.moe_intermediate_size=16", "model.intermediate_size=48",
             "model.num_hidden_layers=1", "model.num_experts=4", "model.num_experts_per_tok=2",
             f"model.tie_word_embeddings={'true' if tied else 'false'}"]
    model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32, overrides=small)
    ids = next(batches(96, 2, 12, 0, "cpu"))
    ids[0, :5] = 7  # duplicates
    ref = copy.deepcopy(model)
    ref(ids, labels=ids).loss.backward()
    want = ref.embed_tokens.weight.grad
    monkeypatch.setattr(embedding_mod, "IMPL", "triton")
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("accumulate", args[3] if len(args) > 3 else None))
        return embedding_backward_into(*args, **kwargs)

    monkeypatch.setattr(kernel_mod, "embedding_backward_into", counted)
    allocate_grads(model)
    for p in model.parameters():
        p.grad.fill_(math.nan)
        grads.sink(p)
    w = model.embed_tokens.weight
    with grads.backward_pass(accumulate=False):
        model(ids, labels=ids).loss.backward()
    assert torch.isfinite(w.grad).all()
    if tied:
        torch.testing.assert_close(w.grad, want, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(w.grad, want)
    first = w.grad.clone()
    with grads.backward_pass(accumulate=True):
        model(ids, labels=ids).loss.backward()
    torch.testing.assert_close(w.grad, 2 * first, rtol=1e-6, atol=1e-7)
    # The kernel ran in both passes; tied, the head wrote first so even the first one added.
    assert calls == [tied, True]
