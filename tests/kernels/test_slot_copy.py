"""The slot copies (gemm_config.py): fc1_swiglu's `x_slots_out` and dact_swiglu's
`dout_slots_out` hold the gathered rows in slot order (zeros for padding slots, dead blocks
untouched), leave the GEMMs' own outputs unchanged, and the expert path under
TileConfigs.x_copy / dout_copy gives the same output and gradients, bit for bit, as without
(same values, same K order in every dW tile), with and without capacity, tail launches and
recompute_fc1.

CPU cases run in the Triton interpreter in fp32; the `cuda` tests compare bf16 on the GPU
under the product's tiles. Every buffer starts full of NaN.
"""

from __future__ import annotations

import pytest
import torch
from routing_cases import moe_inputs

import moegraph_kernels.gemm_config as gc
from moegraph_cli.moe.experts import (build_routes, permute_free_experts,
                                      permute_free_moe_with_drops, poisoned_scratch,
                                      tile_configs)
from moegraph_cli.moe.reference import reference_moe
from moegraph_cli.moe.routing import local_dispatch
from moegraph_kernels.dact_swiglu import dact_swiglu, dp_tiles
from moegraph_kernels.fc1_swiglu import fc1_swiglu

CASES = [  # (routing, T, k, E, H, F)
    ("uniform", 48, 2, 8, 33, 19),  # odd sizes: a ragged last K step
    ("zipf", 64, 4, 7, 36, 20),  # more column tiles than K steps in none, ragged in both
    ("one_expert", 40, 1, 5, 64, 64),  # every token to one expert
    ("sparse_experts", 32, 2, 9, 32, 48),  # empty experts
    ("uniform", 1, 2, 5, 32, 32),  # one token
    ("uniform", 12, 5, 5, 20, 16),  # k == E
    ("zipf", 24, 2, 4, 96, 40),  # three column tiles over three K steps
]
CFGS = {  # name: the kernels' GemmConfig (block_m 16: the route block's size or half)
    "base": gc.GemmConfig(16, 32, 32, 4, 4, 1),
    "persistent": gc.GemmConfig(16, 32, 32, 4, 4, 1, persistent=True),
    "tma+persistent": gc.GemmConfig(16, 32, 32, 4, 4, 1, tma=True, persistent=True),
    "tail": gc.GemmConfig(16, 32, 32, 4, 4, 1, split_tail=True),
    "narrow": gc.GemmConfig(16, 16, 16, 4, 4, 1),  # more column tiles, more K steps
}


def _nan(*shape):
    return torch.full(shape, float("nan"))


def _live(routes):
    return (routes.block_expert >= 0).repeat_interleave(routes.block_m)


def _want_copy(rows_TK, routes):
    """rows[slot_token] in slot order, zeros for padding slots."""
    tok = routes.slot_token.long()
    ok = tok < rows_TK.shape[0]
    out = torch.zeros(routes.num_slots, rows_TK.shape[1])
    out[ok] = rows_TK[tok[ok]]
    return out


@pytest.mark.parametrize("cfg_name", CFGS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_copies_hold_the_gathered_rows_and_change_nothing_else(case, cfg_name):
    kind, T, k, E, H, F = case
    cfg = CFGS[cfg_name]
    x, ids, w, w_gate_up, w_down, dout = moe_inputs(kind, T, k, E, H, F, seed=T + E)
    routes = build_routes(ids, w, E, 16, None)
    w_N = w.reshape(-1).contiguous()
    S = routes.num_slots
    live = _live(routes)

    plain = fc1_swiglu(x, w_gate_up, w_N, routes, _nan(S, 2 * F), _nan(S, F), cfg)
    x_S = _nan(S, H)
    got = fc1_swiglu(x, w_gate_up, w_N, routes, _nan(S, 2 * F), _nan(S, F), cfg,
                     x_slots_out=x_S)
    for g, p in zip(got, plain):
        assert torch.equal(g[live], p[live])
    assert torch.equal(x_S[live], _want_copy(x, routes)[live])
    assert torch.isnan(x_S[~live]).all(), "a dead block's row was written"

    y1 = plain[0]
    outs = lambda: (_nan(S, 2 * F), _nan(S, F), _nan(S, dp_tiles(F, cfg)))  # noqa: E731
    plain = dact_swiglu(dout, w_down, y1, w_N, routes, *outs(), cfg)
    d_S = _nan(S, H)
    got = dact_swiglu(dout, w_down, y1, w_N, routes, *outs(), cfg, dout_slots_out=d_S)
    for g, p in zip(got, plain):
        assert torch.equal(g[live], p[live])
    assert torch.equal(d_S[live], _want_copy(dout, routes)[live])
    assert torch.isnan(d_S[~live]).all(), "a dead block's row was written"


@pytest.mark.parametrize("shape", [(10, 32), (12, 31)])
def test_a_copy_of_the_wrong_shape_is_a_value_error(shape):
    x, ids, w, w_gate_up, w_down, dout = moe_inputs("uniform", 8, 2, 4, 32, 16, seed=1)
    routes = build_routes(ids, w, 4, 16, None)
    S, cfg = routes.num_slots, CFGS["base"]
    bad = torch.zeros(shape) if shape[0] != S else torch.zeros(S, 64)[:, :32]
    with pytest.raises(ValueError, match="slot copy must be a row-major"):
        fc1_swiglu(x, w_gate_up, w.reshape(-1), routes, _nan(S, 32), _nan(S, 16), cfg,
                   x_slots_out=bad)
    with pytest.raises(ValueError, match="slot copy must be a row-major"):
        dact_swiglu(dout, w_down, _nan(S, 32), w.reshape(-1), routes, _nan(S, 32),
                    _nan(S, 16), _nan(S, 1), cfg, dout_slots_out=torch.zeros(S + 1, 32))


def _grads(fn, x, ids, w, w_gate_up, w_down, dout):
    leaves = [t.clone().requires_grad_() for t in (x, w, w_gate_up, w_down)]
    y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    return [y.detach(), *torch.autograd.grad(y, leaves, dout)]


COPIES = {"dout": dict(dout_copy=True), "x": dict(x_copy=True),
          "both": dict(dout_copy=True, x_copy=True)}


@pytest.mark.parametrize("copies", COPIES)
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
@pytest.mark.parametrize("case", CASES[:6], ids=lambda c: "-".join(map(str, c)))
def test_expert_path_with_copies_is_bitwise_the_same(case, capacity_factor, copies):
    kind, T, k, E, H, F = case
    inputs = moe_inputs(kind, T, k, E, H, F, seed=T + E)
    base = tile_configs(T * k, E, H, F, torch.device("cpu"))
    with_copies = base._replace(**COPIES[copies])

    def run(cfg):
        with poisoned_scratch():
            return _grads(lambda *a: permute_free_moe_with_drops(*a, capacity_factor, cfg)[0],
                          *inputs)

    want, got = run(base), run(with_copies)
    names = ["y", "dx", "dtopk_weights", "dw_gate_up", "dw_down"]
    for name, g, r in zip(names, got, want):
        assert torch.isfinite(g).all(), name
        assert torch.equal(g, r), f"{name} differs with the {copies} slot copy"
    ref = _grads(lambda *a: reference_moe(*a, capacity_factor), *inputs)
    for name, g, r in zip(names, got, ref):
        scale = max(1.0, r.abs().max().item())
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * scale,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("recompute", [False, True])
def test_recompute_fc1_with_the_x_copy(recompute, monkeypatch):
    """With recompute_fc1 the backward's FC1 writes the X copy; same bits as without it."""
    import moegraph_cli.moe.experts as ex
    kind, T, k, E, H, F = ("zipf", 64, 4, 7, 36, 20)
    inputs = moe_inputs(kind, T, k, E, H, F, seed=3)
    base = tile_configs(T * k, E, H, F, torch.device("cpu"))
    real = ex.tile_configs

    def run(copies):
        monkeypatch.setattr(ex, "tile_configs", lambda *a: real(*a)._replace(**copies))
        dispatch = local_dispatch(inputs[1], inputs[2], E, None)
        with poisoned_scratch():
            return _grads(lambda x, ids, w, wgu, wd: permute_free_experts(
                x, ids, w, wgu, wd, dispatch, recompute_fc1=recompute), *inputs)

    want, got = run({}), run(dict(x_copy=True, dout_copy=True))
    for g, r in zip(got, want):
        assert torch.equal(g, r)


# ---------------------------------------------------------------------------------------------
# GPU: the product's tiles with each copy against without, bf16, bitwise.

GPU_SHAPES = [  # (routing, T, k, E, H, F)
    ("uniform", 8192, 8, 128, 2048, 768),  # the Qwen3 expert shape, 128-row route blocks
    ("uniform", 1024, 8, 128, 2048, 768),  # 64-row blocks, the short-loop dW tiles
    ("sparse_experts", 2048, 8, 33, 1024, 384),  # empty experts
    ("zipf", 512, 4, 16, 512, 256),
]


@pytest.mark.cuda
@pytest.mark.parametrize("copies", COPIES)
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_copies_are_bitwise_the_same(case, tail, copies):
    kind, T, k, E, H, F = case
    x, ids, w, w_gate_up, w_down, dout = moe_inputs(kind, T, k, E, H, F, seed=1)
    bf = torch.bfloat16
    inputs = [x.cuda().to(bf), ids.cuda(), w.cuda().to(bf), w_gate_up.cuda().to(bf),
              w_down.cuda().to(bf), dout.cuda().to(bf)]
    base = tile_configs(T * k, E, H, F, torch.device("cuda"))
    if tail:
        base = base._replace(**{n: getattr(base, n)._replace(split_tail=True)
                                for n in ("fc1", "dact")})
    with_copies = base._replace(**COPIES[copies])

    def run(cfg):
        with poisoned_scratch():
            return _grads(lambda *a: permute_free_moe_with_drops(*a, None, cfg)[0], *inputs)

    want, got = run(base), run(with_copies)
    torch.cuda.synchronize()
    for name, g, r in zip(["y", "dx", "dtopk_weights", "dw_gate_up", "dw_down"], got, want):
        assert torch.isfinite(g).all(), name
        assert torch.equal(g, r), (
            f"{name} under the {copies} copy: max |diff| "
            f"{(g.float() - r.float()).abs().max().item():.3e}")
