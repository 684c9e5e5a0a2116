"""permute_free_moe (Triton kernels, interpreter on CPU, fp32) against reference_moe.

Every buffer the kernels write is allocated full of NaN (`poisoned_scratch`), so a padded slot
that reads a real row, or a real element left unwritten, turns a result non-finite.
"""

import pytest
import torch
from routing_cases import moe_inputs

from moegraph_cli.moe.experts import (permute_free_moe, permute_free_moe_with_drops,
                                      poisoned_scratch, tile_configs)
from moegraph_cli.moe.reference import reference_moe
from moegraph_cli.moe.routing import capacity_keep_TK, expert_capacity

CASES = [  # (routing, T, k, E, H, F)
    ("uniform", 48, 2, 8, 33, 19),
    ("zipf", 64, 4, 7, 33, 19),
    ("one_expert", 40, 1, 5, 24, 19),  # every token to one expert
    ("sparse_experts", 32, 2, 9, 17, 45),  # empty experts; F spans two column tiles
    ("uniform", 1, 2, 5, 33, 19),  # one token
    ("uniform", 12, 5, 5, 20, 17),  # k == E
    ("uniform", 40, 2, 4, 64, 64),  # even sizes: the unmasked-K / unmasked-N kernel paths
]


def _inputs(kind, T, k, E, H, F, seed=0):
    return moe_inputs(kind, T, k, E, H, F, seed)


def _run(fn, x, ids, w, w_gate_up, w_down, dout, capacity_factor):
    leaves = [t.clone().requires_grad_() for t in (x, w, w_gate_up, w_down)]
    y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3], capacity_factor)
    grads = torch.autograd.grad(y, leaves, dout)
    return [y.detach(), *grads]


NAMES = ["y", "dx", "dtopk_weights", "dw_gate_up", "dw_down"]


def _assert_matches(got, want):
    for name, g, r in zip(NAMES, got, want):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        scale = max(1.0, r.abs().max().item())
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0])
@pytest.mark.parametrize("kind,T,k,E,H,F", CASES)
def test_matches_reference(kind, T, k, E, H, F, capacity_factor):
    args = _inputs(kind, T, k, E, H, F, seed=T + E)
    with poisoned_scratch():
        got = _run(permute_free_moe, *args, capacity_factor)
    want = _run(reference_moe, *args, capacity_factor)
    _assert_matches(got, want)


def test_skewed_capacity_drops_are_counted_and_get_zero_weight_grads():
    x, ids, w, w_gate_up, w_down, dout = _inputs("tied_weights", 64, 3, 7, 33, 19, seed=5)
    cf = 0.75
    leaves = [t.clone().requires_grad_() for t in (x, w, w_gate_up, w_down)]
    with poisoned_scratch():
        y, dropped = permute_free_moe_with_drops(leaves[0], ids, leaves[1], leaves[2], leaves[3],
                                                 cf)
        got = [y.detach(), *torch.autograd.grad(y, leaves, dout)]
    keep = capacity_keep_TK(ids, w, 7, expert_capacity(64, 3, 7, cf))
    assert int(dropped) == int((~keep).sum()) > 0
    assert (got[2][~keep] == 0).all()
    _assert_matches(got, _run(reference_moe, x, ids, w, w_gate_up, w_down, dout, cf))


def test_empty_experts_get_exact_zero_weight_grads():
    x, ids, w, w_gate_up, w_down, dout = _inputs("sparse_experts", 24, 2, 6, 33, 19, seed=2)
    with poisoned_scratch():
        _, _, _, dw_gate_up, dw_down = _run(permute_free_moe, x, ids, w, w_gate_up, w_down, dout,
                                             None)
    empty = torch.arange(0, 6, 2)
    assert (dw_gate_up[empty] == 0).all() and (dw_down[empty] == 0).all()
    assert (dw_gate_up[1::2] != 0).any() and (dw_down[1::2] != 0).any()


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_two_runs_are_bitwise_identical(capacity_factor):
    args = _inputs("zipf", 48, 3, 7, 33, 19, seed=11)
    with poisoned_scratch():
        first = _run(permute_free_moe, *args, capacity_factor)
    second = _run(permute_free_moe, *args, capacity_factor)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("E,H,F,k", [(128, 2048, 768, 8), (8, 4096, 14336, 2),
                                     (64, 7168, 2048, 8), (7, 200, 100, 3)])
@pytest.mark.parametrize("T", [1, 1024, 8192, 32768])
def test_cuda_tile_configs_fit_hopper(E, H, F, k, T):
    cfg = tile_configs(T * k, E, H, F, torch.device("cuda"))
    for name in ("fc1", "fc2", "dact", "dx", "wgrad_down", "wgrad_gate_up"):
        c = getattr(cfg, name)
        b_tiles = 2 if name == "fc1" else 1  # fc1 loads a gate and an up tile per stage
        smem = (c.block_m * c.block_k + b_tiles * c.block_n * c.block_k) * 2 * c.num_stages
        assert smem <= 200 * 1024, (name, c, smem)  # 228 KB per SM, minus epilogue scratch
        assert min(c.block_m, c.block_n, c.block_k) >= 16 and c.num_warps in (4, 8), (name, c)
        if not name.startswith("wgrad"):
            assert cfg.route_block % c.block_m == 0, (name, c)


@pytest.mark.parametrize("kind,T,k,E,H,F", [CASES[0], CASES[3]])
def test_residual_rides_the_combine_with_the_bits_of_adding_it_after(kind, T, k, E, H, F):
    """permute_free_experts(..., residual=r) is r + permute_free_experts(...) bit for bit, and
    r's gradient is the output's."""
    from moegraph_cli.moe.experts import permute_free_experts
    from moegraph_cli.moe.routing import local_dispatch

    x, ids, w, w_gate_up, w_down, dout = _inputs(kind, T, k, E, H, F, seed=11)
    r = torch.randn(T, H, generator=torch.Generator().manual_seed(12))

    def run(fold):
        leaves = [t.clone().requires_grad_() for t in (x, w, w_gate_up, w_down, r)]
        dispatch = local_dispatch(ids, leaves[1], E, None)
        with poisoned_scratch():
            y = permute_free_experts(leaves[0], ids, *leaves[1:4], dispatch,
                                     residual=leaves[4] if fold else None)
            if not fold:
                y = leaves[4] + y
            return [y.detach(), *torch.autograd.grad(y, leaves, dout)]

    got, want = run(True), run(False)
    for name, g, ref in zip(NAMES + ["dresidual"], got, want):
        assert torch.equal(g, ref), name
    assert torch.equal(got[-1], dout)


@pytest.mark.parametrize("mode", ["keep", "fc1"])
@pytest.mark.parametrize("kind,T,k,E,H,F", [CASES[1], CASES[3], CASES[5]])
def test_kept_activation_gives_the_bits_of_the_recomputed_one(kind, T, k, E, H, F, mode):
    """FC1's activation kept for dW_down (`keep_act`: dA not writing it), or taken from FC1's
    re-run (`recompute_fc1`), changes no bit of the output or of any gradient against dA's
    recomputed one."""
    from moegraph_cli.moe.experts import permute_free_experts
    from moegraph_cli.moe.routing import local_dispatch

    x, ids, w, w_gate_up, w_down, dout = _inputs(kind, T, k, E, H, F, seed=13)

    def run(mode):
        leaves = [t.clone().requires_grad_() for t in (x, w, w_gate_up, w_down)]
        with poisoned_scratch():
            y = permute_free_experts(leaves[0], ids, *leaves[1:4],
                                     local_dispatch(ids, leaves[1], E, None),
                                     recompute_fc1=mode == "fc1", keep_act=mode == "keep")
            return [y.detach(), *torch.autograd.grad(y, leaves, dout)]

    got, recomputed = run(mode), run("none")
    for name, a, b in zip(NAMES, got, recomputed):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name
