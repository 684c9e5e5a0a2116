"""The embedding backward kernel on CUDA against torch's F.embedding backward: fp32 to
rounding, bf16 by flash-attention's rule (error against an fp64 reference at most twice that
of torch's own bf16 gradient), write over NaN, accumulate, tied head, the model's embedding
gradient, sync-freedom, determinism and CUDA-graph replay; at Qwen3's vocab and hidden size."""

import math

import pytest
import torch

from moegraph_cli import grads
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.trainer import allocate_grads, batches
from moegraph_kernels.embedding_backward import embedding_backward_into

pytestmark = pytest.mark.cuda
DEV = "cuda"
ERROR_FLOOR = 2.0 ** -10


def _ids(T, V, seed):
    """Zipf-like ids: a few very frequent tokens (long runs), most rows unused."""
    gen = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(p, T, replacement=True, generator=gen).to(DEV)


def _torch_grad(dy, ids, V):
    w = torch.zeros(V, dy.shape[-1], dtype=dy.dtype, device=DEV, requires_grad=True)
    torch.nn.functional.embedding(ids, w).backward(dy)
    return w.grad


def _rel_err(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T,V,H", [(1024, 151936, 2048), (8192, 32000, 1024), (1, 64, 96),
                                   (333, 1000, 200)])
def test_fp32_and_bf16_against_torch(T, V, H):
    ids = _ids(T, V, seed=T)
    dy = torch.randn(T, H, device=DEV)
    ref64 = torch.zeros(V, H, dtype=torch.float64, device=DEV).index_add_(0, ids, dy.double())
    out32 = torch.full((V, H), math.nan, device=DEV)
    embedding_backward_into(dy, ids, out32, accumulate=False)
    # fp32 sums each row in token order: within the bound of recursive summation (Higham,
    # |error| <= gamma_(n-1) sum|x| per element, gamma_m = m u / (1 - m u), u = 2^-24),
    # which also forces rows of one token to exact copies and unused rows to exact zeros.
    # (Torch sums in a tree, so its error is smaller on the hot rows; the sequential order
    # is what makes this kernel deterministic.)
    count = torch.bincount(ids, minlength=V).double()
    abs_sum = torch.zeros(V, H, dtype=torch.float64, device=DEV).index_add_(0, ids,
                                                                            dy.abs().double())
    nu = (count - 1).clamp_min(0)[:, None] * 2.0 ** -24
    bound = nu / (1 - nu) * abs_sum
    err32 = (out32.double() - ref64).abs()
    assert (err32 <= bound).all(), (err32 - bound).max().item()
    out16 = torch.full((V, H), math.nan, dtype=torch.bfloat16, device=DEV)
    embedding_backward_into(dy.bfloat16(), ids, out16, accumulate=False)
    assert torch.isfinite(out16).all()
    unused = torch.ones(V, dtype=torch.bool, device=DEV)
    unused[ids] = False
    assert (out16[unused] == 0).all()
    err = _rel_err(out16, ref64)
    base = _rel_err(_torch_grad(dy.bfloat16(), ids, V), ref64)
    assert err <= 2 * max(base, ERROR_FLOOR), f"bf16 error {err:.3g} vs torch bf16 {base:.3g}"


def test_accumulate_adds_once_rounded():
    T, V, H = 1024, 5000, 256
    ids = _ids(T, V, seed=1)
    dy = torch.randn(T, H, device=DEV)
    before = torch.randn(V, H, device=DEV)
    out = before.clone()
    embedding_backward_into(dy, ids, out, accumulate=True)
    torch.testing.assert_close(out, before + _torch_grad(dy, ids, V), rtol=1e-5, atol=1e-5)
    unused = torch.ones(V, dtype=torch.bool, device=DEV)
    unused[ids] = False
    assert torch.equal(out[unused], before[unused])


def test_deterministic_sync_free_and_graph_replay():
    T, V, H = 1024, 151936, 2048
    ids, dy = _ids(T, V, seed=2), torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(V, H, dtype=torch.bfloat16, device=DEV)
    embedding_backward_into(dy, ids, out, accumulate=False)  # compile outside the check
    first = out.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        embedding_backward_into(dy, ids, out, accumulate=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, first)
    static_ids, static_dy = ids.clone(), dy.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        embedding_backward_into(static_dy, static_ids, out, accumulate=False)
    for seed in (3, 4):
        nids = _ids(T, V, seed)
        ndy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
        static_ids.copy_(nids)
        static_dy.copy_(ndy)
        out.fill_(math.nan)
        graph.replay()
        want = torch.empty_like(out)
        embedding_backward_into(ndy, nids, want, accumulate=False)
        assert torch.equal(out, want)


@pytest.mark.parametrize("tied", [False, True])
def test_model_embedding_gradient_written_into_the_sink(tied):
    """The tiny model on CUDA in fp32: the sink's embedding gradient (write over NaN, then
    accumulate) equals autograd's, tied to the head or not."""
    over = [f"model.tie_word_embeddings={'true' if tied else 'false'}"]
    model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32, device=DEV,
                                     overrides=over)
    ref = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32, device=DEV,
                                   overrides=over)
    ids = next(batches(model.config.vocab_size, 2, 64, 0, DEV))
    ids[:, :16] = 5  # a long run of one token
    ref(ids, labels=ids).loss.backward()
    allocate_grads(model)
    for p in model.parameters():
        p.grad.fill_(math.nan)
        grads.sink(p)
    w = model.embed_tokens.weight
    with grads.backward_pass(accumulate=False):
        model(ids, labels=ids).loss.backward()
    assert torch.isfinite(w.grad).all()
    torch.testing.assert_close(w.grad, ref.embed_tokens.weight.grad, rtol=1e-4, atol=1e-6)
    first = w.grad.clone()
    with grads.backward_pass(accumulate=True):
        model(ids, labels=ids).loss.backward()
    torch.testing.assert_close(w.grad, 2 * first, rtol=1e-5, atol=1e-6)
