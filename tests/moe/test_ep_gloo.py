"""Expert-parallel dispatch and combine (moe/ep.py) over gloo against one process.

Every rank builds the same global inputs, runs ep_moe on its token slice with its expert
slice, and compares output, input grads and its experts' weight grads with reference_moe run
on each rank's tokens in one process (capacity is decided per source rank, over its own
tokens, so the reference applies it per slice too). fp32: differences are rounding only.
"""

import pytest
import torch
import torch.distributed as dist

from gloo_util import run_gloo
from moegraph_cli.moe.ep import EpGroup, ep_moe
from moegraph_cli.moe.reference import reference_experts, reference_moe
from routing_cases import moe_inputs

T, K, E, H, F = 12, 2, 8, 16, 8


def _reference(inputs, world, cf, extras=None):
    x, ids, w, wgu, wd, dout = [t.clone() for t in inputs]
    leaves = [t.requires_grad_() for t in (x, w, wgu, wd)]
    kw = {}
    if extras is not None:
        kw = dict(b_gate_up=extras[0].clone().requires_grad_(),
                  b_down=extras[1].clone().requires_grad_(), act=extras[2])
    ys = [reference_moe(x[r * T:(r + 1) * T], ids[r * T:(r + 1) * T], w[r * T:(r + 1) * T],
                        wgu, wd, cf, **kw) for r in range(world)]
    y = torch.cat(ys)
    (y * dout).sum().backward()
    bias_grads = [kw["b_gate_up"].grad, kw["b_down"].grad] if kw else []
    return y.detach(), [t.grad for t in leaves] + bias_grads


def _gpt_oss_extras():
    """Biases and the clamped SwiGLU (limit 1 so the clamp bites at these scales)."""
    from moegraph_cli.moe.activation import clamped_swiglu
    gen = torch.Generator().manual_seed(7)
    return torch.randn(E, 2 * F, generator=gen), torch.randn(E, H, generator=gen), \
        clamped_swiglu(limit=1.0)


def _check(rank, world, kind, cf, experts_name, uneven_rank, with_extras=False):
    inputs = moe_inputs(kind, world * T, K, E, H, F, seed=3)
    x, ids, w, wgu, wd, dout = inputs
    if uneven_rank is not None:
        # Every token of every rank routes to experts owned by one EP rank.
        lo = uneven_rank * (E // world)
        ids = (ids % (E // world)) + lo
        inputs = (x, ids, w, wgu, wd, dout)
    extras = _gpt_oss_extras() if with_extras else None
    want_y, (want_dx, want_dw, want_dgu, want_dd, *want_db) = _reference(inputs, world, cf,
                                                                         extras)
    ep = EpGroup(dist.group.WORLD, world, rank, E)
    lo, hi = ep.expert_range
    sl = slice(rank * T, (rank + 1) * T)
    xs, ws = x[sl].clone().requires_grad_(), w[sl].clone().requires_grad_()
    gu, dn = wgu[lo:hi].clone().requires_grad_(), wd[lo:hi].clone().requires_grad_()
    if experts_name == "permute_free":
        from moegraph_cli.moe.experts import permute_free_experts as experts
    else:
        experts = reference_experts
    kw, biases = {}, []
    if extras is not None:
        biases = [extras[0][lo:hi].clone().requires_grad_(),
                  extras[1][lo:hi].clone().requires_grad_()]
        kw = dict(b_gate_up_local=biases[0], b_down_local=biases[1], act=extras[2])
    y, dropped = ep_moe(xs, ids[sl], ws, gu, dn, cf, ep, experts, **kw)
    (y * dout[sl]).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, want_y[sl], **tol)
    torch.testing.assert_close(xs.grad, want_dx[sl], **tol)
    torch.testing.assert_close(ws.grad, want_dw[sl], **tol)
    # An expert stack that received nothing has no gradient: the trainer's zeroed .grad stays 0.
    pairs = [(gu.grad, want_dgu[lo:hi]), (dn.grad, want_dd[lo:hi])]
    pairs += [(b.grad, want[lo:hi]) for b, want in zip(biases, want_db)]
    for got, want in pairs:
        torch.testing.assert_close(torch.zeros_like(want) if got is None else got, want, **tol)
    # Dropped routes, summed over ranks, are what the per-slice capacity rule drops.
    total = dropped.clone()
    dist.all_reduce(total)
    if cf is None:
        assert int(total) == 0
    else:
        from moegraph_cli.moe.routing import local_dispatch
        want = sum(int((~local_dispatch(ids[r * T:(r + 1) * T], w[r * T:(r + 1) * T], E,
                                        cf).keep_TK).sum()) for r in range(world))
        assert int(total) == want and want > 0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cf", [None, 0.5])
def test_ep_matches_single_process(world, cf):
    run_gloo(_check, world, "zipf", cf, "reference", None)


@pytest.mark.parametrize("cf", [None, 0.5])
def test_ep_all_tokens_to_one_rank(cf):
    """Rank 1 owns every route; rank 0 computes nothing and still gets exact zero expert grads."""
    run_gloo(_check, 2, "uniform", cf, "reference", 1)


@pytest.mark.parametrize("cf", [None, 0.5])
def test_ep_permute_free_kernels(cf):
    """The Triton kernels (interpreter, fp32) read the received rows in place."""
    run_gloo(_check, 2, "sparse_experts", cf, "permute_free", None)


@pytest.mark.parametrize("experts_name", ["reference", "permute_free"])
def test_ep_with_gpt_oss_biases_and_clamp(experts_name):
    """Biases (local slices) and the clamped SwiGLU pass through ep_moe to either backend."""
    run_gloo(_check, 2, "zipf", 0.5, experts_name, None, True)
