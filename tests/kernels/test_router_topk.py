"""kernels/router_topk.py (Triton, interpreter on CPU, fp32) against topk_ids_ref (a stable
descending sort) and torch.topk: random rows, ties, NaN and -inf, k == E, one token, odd E,
strided rows, a NaN-poisoned output; the routers through it (moe/routing.py) against torch's
top-k, values and gradients; bf16 and a CUDA graph on CUDA."""

import pytest
import torch

from moegraph_cli.moe import routing
from moegraph_kernels import router_topk as K

CASES = [  # T, E, k
    (1, 8, 2),  # one token (Mixtral's E)
    (37, 128, 8),  # Qwen3's router, rows spanning several programs
    (5, 60, 4),  # Qwen2-MoE's odd E
    (9, 3, 3),  # k == E
    (4, 1, 1),
    (70, 64, 8),  # OLMoE
]


def _poisoned(T, k):
    return torch.full((T, k), -7, dtype=torch.int64)


@pytest.mark.parametrize("T,E,k", CASES)
def test_random_rows_match_torch(T, E, k):
    x = torch.randn(T, E, generator=torch.Generator().manual_seed(T * E + k))
    ids = K.topk_ids(x, k, out=_poisoned(T, k))
    assert torch.equal(ids, K.topk_ids_ref(x, k))
    vals, want_ids = torch.topk(x, k, dim=-1)
    assert torch.equal(ids, want_ids) and torch.equal(x.gather(1, ids), vals)


def test_ties_go_to_the_lower_index_and_every_column_once():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0],
                      [0.5] * 6,
                      [float("-inf")] * 3 + [1.0] * 3])
    ids = K.topk_ids(x, 6)
    assert ids.tolist() == [[1, 2, 4, 3, 0, 5], list(range(6)), [3, 4, 5, 0, 1, 2]]
    assert torch.equal(ids, K.topk_ids_ref(x, 6))


def test_nan_ranks_first_as_in_torch():
    nan = float("nan")
    x = torch.tensor([[0.1, nan, 0.7, nan, 0.2], [nan] * 5])
    ids = K.topk_ids(x, 3)
    assert ids.tolist() == [[1, 3, 2], [0, 1, 2]]
    assert torch.equal(ids, K.topk_ids_ref(x, 3))
    assert torch.equal(ids[0], torch.topk(x[:1], 3).indices[0])


def test_strided_rows_and_empty_input():
    buf = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    x = buf[:, 3:35]  # row stride 40
    assert torch.equal(K.topk_ids(x, 5), K.topk_ids_ref(x.contiguous(), 5))
    assert K.topk_ids(torch.empty(0, 8), 2).shape == (0, 2)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="need 0 < k <= E"):
        K.topk_ids(torch.randn(2, 4), 5)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        K.topk_ids(torch.randn(4, 2).t(), 1)
    with pytest.raises(ValueError, match="out must be"):
        K.topk_ids(torch.randn(2, 4), 2, out=torch.empty(2, 2, dtype=torch.int32))


@pytest.mark.parametrize("norm", [False, True])
def test_routers_through_the_kernel_match_torch_topk(norm, monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 16, generator=g)
    w = torch.randn(12, 16, generator=g, requires_grad=True)
    b = torch.randn(12, generator=g, requires_grad=True)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(routing, "ON_CPU", on)
        w.grad = b.grad = None
        ids, weights, probs = routing.route(x, w, 4, norm)
        g_ids, g_weights, g_probs = routing.route_topk_softmax(x, w, b, 3)
        (weights.sum() + (weights * probs[:, :4]).sum() + g_weights.pow(2).sum()).backward()
        outs.append((ids, weights, probs, g_ids, g_weights, g_probs, w.grad, b.grad))
    for want, got in zip(*outs):
        assert torch.equal(want, got)


# -- CUDA ----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k", [(16384, 128, 8), (1000, 60, 4), (333, 8, 2), (64, 32, 32)])
def test_cuda_matches_reference(T, E, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, E, device="cuda", generator=g).to(dtype)  # bf16: many ties
    ids = K.topk_ids(x, k, out=torch.full((T, k), -7, dtype=torch.int64, device="cuda"))
    assert torch.equal(ids, K.topk_ids_ref(x, k))
    assert torch.equal(x.gather(1, ids), torch.topk(x, k, dim=-1).values)


@pytest.mark.cuda
def test_cuda_graph_replays_the_kernel():
    x = torch.randn(512, 128, device="cuda")
    out = torch.empty(512, 8, dtype=torch.int64, device="cuda")
    K.topk_ids(x, 8, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.topk_ids(x, 8, out=out)
    x.copy_(torch.randn(512, 128, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, K.topk_ids_ref(x, 8))
