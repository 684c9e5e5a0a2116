"""reference_moe against a plain per-token loop over routes (float64)."""

import pytest
import torch

from moegraph_cli.moe.reference import loop_moe, reference_moe
from moegraph_cli.moe.routing import capacity_keep_TK, expert_capacity


def _case(T, H, F, E, k, routing="uniform", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    wgu = torch.randn(E, 2 * F, H, generator=g) * 0.3
    wd = torch.randn(E, H, F, generator=g) * 0.3
    logits = torch.randn(T, E, generator=g)
    if routing == "one_expert":
        logits[:, 0] += 100.0
    elif routing == "skewed":
        logits += torch.log(1.0 / torch.arange(1, E + 1).float())[None] * 3
    elif routing == "empty":
        logits[:, E // 2:] -= 100.0
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return x, ids, w, wgu, wd


@pytest.mark.parametrize("T,H,F,E,k,routing", [
    (37, 24, 10, 5, 2, "uniform"), (16, 8, 6, 4, 1, "one_expert"), (1, 16, 8, 8, 2, "uniform"),
    (12, 16, 8, 3, 3, "uniform"), (40, 20, 12, 8, 2, "empty"), (33, 17, 9, 7, 3, "skewed")])
def test_dropless_matches_loop(T, H, F, E, k, routing):
    x, ids, w, wgu, wd = _case(T, H, F, E, k, routing)
    out = reference_moe(x, ids, w, wgu, wd)
    ref = loop_moe(x, ids, w, wgu, wd)
    assert out.shape == (T, H)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_every_token_to_one_expert_leaves_others_without_grad():
    x, ids, w, wgu, wd = _case(16, 8, 6, 4, 1, "one_expert")
    assert (ids == 0).all()
    wgu.requires_grad_(True)
    reference_moe(x, ids, w, wgu, wd).sum().backward()
    assert wgu.grad[1:].abs().sum() == 0 and wgu.grad[0].abs().sum() > 0


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_lowest_weight_routes(factor):
    T, H, F, E, k = 30, 12, 8, 4, 2
    x, ids, w, wgu, wd = _case(T, H, F, E, k, "skewed", seed=3)
    cap = expert_capacity(T, k, E, factor)
    keep = capacity_keep_TK(ids, w, E, cap)
    for e in range(E):
        sel = ids == e
        kept = keep & sel
        assert int(kept.sum()) == min(int(sel.sum()), cap)
        if int(sel.sum()) > cap:  # every kept route outweighs every dropped one
            assert w[kept].min() >= w[sel & ~keep].max()
    out = reference_moe(x, ids, w, wgu, wd, capacity_factor=factor)
    torch.testing.assert_close(out.double(), loop_moe(x, ids, w, wgu, wd, keep),
                               rtol=1e-5, atol=1e-5)
    if factor < 1.0:
        assert int((~keep).sum()) > 0


def test_capacity_ties_keep_the_lower_token():
    ids = torch.zeros(6, 1, dtype=torch.long)
    w = torch.full((6, 1), 0.5)
    keep = capacity_keep_TK(ids, w, 2, 4)
    assert keep[:, 0].tolist() == [True, True, True, True, False, False]


def test_capacity_formula():
    assert expert_capacity(100, 2, 8, 1.0) == 25
    assert expert_capacity(100, 2, 8, 1.25) == 32  # ceil(31.25)
    assert expert_capacity(1, 1, 64, 1.0) == 1
