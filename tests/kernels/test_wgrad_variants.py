"""The expert dW kernel's variants (kernels/wgrad.py) against its masked K loop.

`PADDED_K` runs the K loop over an expert's padded slot range, so the slot-order operand (dY1
for dW_gate_up, A for dW_down) needs no K mask; with `GemmConfig.tma` that operand loads
through a TMA descriptor. The padding slots are zeros on the slot-order side (every row of a
live block is written) and masked on the gathered side, so the dot sees the same values:
results are bitwise equal, except where the interpreter's numpy matmul sums the transposed
TMA tile of dW_gate_up's L in another order (compared to 1e-6). The `cuda` tests compare bf16
on the GPU bitwise. Outputs start full of NaN: an unwritten element shows up; empty experts
must get exact zeros.
"""

from __future__ import annotations

import functools

import pytest
import torch
from routing_cases import moe_inputs

import moegraph_kernels.wgrad as wg
from moegraph_cli.moe.experts import build_routes
from moegraph_kernels.dact_swiglu import dact_swiglu, dp_tiles
from moegraph_kernels.fc1_swiglu import fc1_swiglu
from moegraph_kernels.gemm_config import GemmConfig, dact_config, fc1_config, route_block_m

CASES = [  # (routing, T, k, E, H, F)
    ("uniform", 48, 2, 8, 33, 19),  # odd sizes: no descriptor fits, pointer path
    ("zipf", 64, 4, 7, 36, 20),  # ragged M and N tiles
    ("one_expert", 40, 1, 5, 64, 64),  # every token to one expert
    ("sparse_experts", 32, 2, 9, 32, 48),  # empty experts
    ("uniform", 1, 2, 5, 32, 32),  # one token
    ("uniform", 12, 5, 5, 20, 16),  # k == E
]
CPU_CFG = GemmConfig(32, 32, 16, 4, 4, 1)


@functools.lru_cache(maxsize=None)
def _problem(case, capacity_factor, device, dtype, route_block):
    """Inputs of both dW kernels, Y1 / A / dY1 written by the product's own kernels (read only
    by the tests, so shared between them)."""
    kind, T, k, E, H, F = case
    x, ids, w, w_gate_up, w_down, dout = [t.to(device) for t in
                                          moe_inputs(kind, T, k, E, H, F, seed=T + E)]
    x, w, w_gate_up, w_down, dout = (t.to(dtype) for t in (x, w, w_gate_up, w_down, dout))
    routes = build_routes(ids, w, E, route_block, capacity_factor)
    S = routes.num_slots
    w_N = w.reshape(-1).contiguous()
    nan = functools.partial(torch.full, fill_value=float("nan"), device=device)
    y1 = nan((S, 2 * F), dtype=dtype)
    fc1_cfg = fc1_config(F, route_block, torch.device(device))
    fc1_swiglu(x, w_gate_up, w_N, routes, y1, nan((S, F), dtype=dtype), fc1_cfg)
    dact_cfg = dact_config(F, route_block, torch.device(device))
    dy1, act = nan((S, 2 * F), dtype=dtype), nan((S, F), dtype=dtype)
    dact_swiglu(dout, w_down, y1, w_N, routes, dy1, act,
                nan((S, dp_tiles(F, dact_cfg)), dtype=torch.float32), dact_cfg)
    return x, dout, dy1, act, routes, (E, H, F)


def _both_dw(problem, cfg, padded, monkeypatch, accumulate_onto=None):
    x, dout, dy1, act, routes, (E, H, F) = problem
    monkeypatch.setattr(wg, "PADDED_K", padded)
    out = []
    for gather_l, (l_rows, r_rows, m, n) in ((True, (dout, act, H, F)),
                                             (False, (dy1, x, 2 * F, H))):
        dw = torch.full((E, m, n), float("nan"), dtype=x.dtype, device=x.device) \
            if accumulate_onto is None else accumulate_onto[len(out)].clone()
        wg.expert_wgrad(l_rows, r_rows, routes, dw, gather_l, not gather_l, cfg,
                        accumulate=accumulate_onto is not None)
        out.append((dw, wg.LAST_WGRAD_PLAN[gather_l]))
    return out


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_padded_k_loop_matches_the_masked_loop(case, tma, capacity_factor, monkeypatch):
    problem = _problem(case, capacity_factor, "cpu", torch.float32, 16)
    cfg = CPU_CFG._replace(tma=tma)
    want = _both_dw(problem, CPU_CFG, False, monkeypatch)
    got = _both_dw(problem, cfg, True, monkeypatch)
    routes = problem[4]
    empty = routes.expert_counts == 0
    _, _, _, _, H, F = case
    for name, (g, plan), (w, _) in zip(("dW_down", "dW_gate_up"), got, want):
        assert torch.isfinite(g).all(), f"{name}: an element left unwritten"
        assert (g[empty] == 0).all(), f"{name}: an empty expert's tile is not exact zeros"
        assert plan[0], f"{name}: the padded loop did not run ({plan})"
        # A descriptor needs 16-byte rows: fp32 F and 2F, H multiples of 4.
        slot_cols = F if name == "dW_down" else 2 * F
        assert plan[1] == (tma and slot_cols % 4 == 0), (name, plan)
        if plan[1] and name == "dW_gate_up":  # the transposed TMA tile: numpy's sum order
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(g, w), f"{name} ({plan}): differs from the masked loop"


@pytest.mark.parametrize("store_tma", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_persistent_and_tma_store_variants_are_bitwise_equal(case, store_tma, monkeypatch):
    """One program an SM over the tiles and / or the TMA bulk store: the same values; every
    element written (NaN before); the store by TMA exactly where M is a multiple of BLOCK_M."""
    problem = _problem(case, None, "cpu", torch.float32, 16)
    want = _both_dw(problem, CPU_CFG, True, monkeypatch)
    _, _, _, _, H, F = case
    for persistent in (False, True):
        cfg = CPU_CFG._replace(persistent=persistent, store_tma=store_tma)
        got = _both_dw(problem, cfg, True, monkeypatch)
        for gather_l, (g, _), (w, _) in zip((True, False), got, want):
            m = H if gather_l else 2 * F
            assert wg.LAST_WGRAD_STORE[gather_l] == (persistent,
                                                     store_tma and m % CPU_CFG.block_m == 0)
            assert torch.equal(g, w), (gather_l, persistent, store_tma)


def test_an_accumulating_launch_keeps_the_pointer_store(monkeypatch):
    problem = _problem(CASES[3], None, "cpu", torch.float32, 16)
    base = [torch.randn(t.shape) for t, _ in _both_dw(problem, CPU_CFG, True, monkeypatch)]
    want = _both_dw(problem, CPU_CFG, True, monkeypatch, accumulate_onto=base)
    got = _both_dw(problem, CPU_CFG._replace(persistent=True, store_tma=True), True,
                   monkeypatch, accumulate_onto=base)
    assert wg.LAST_WGRAD_STORE[False] == (True, False)
    for (g, _), (w, _) in zip(got, want):
        assert torch.equal(g, w)


def test_padded_loop_accumulates_like_the_masked_loop(monkeypatch):
    problem = _problem(CASES[3], None, "cpu", torch.float32, 16)
    base = [torch.randn(t.shape) for t, _ in _both_dw(problem, CPU_CFG, False, monkeypatch)]
    want = _both_dw(problem, CPU_CFG, False, monkeypatch, accumulate_onto=base)
    got = _both_dw(problem, CPU_CFG._replace(tma=True), True, monkeypatch,
                   accumulate_onto=base)
    empty = problem[4].expert_counts == 0
    for (g, _), (w, _), b in zip(got, want, base):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        assert torch.equal(g[empty], b[empty]), "an empty expert's accumulated tile changed"


def test_a_k_tile_that_does_not_divide_the_route_block_keeps_the_masked_loop(monkeypatch):
    problem = _problem(CASES[1], None, "cpu", torch.float32, 16)
    got = _both_dw(problem, CPU_CFG._replace(block_k=32, tma=True), True, monkeypatch)
    want = _both_dw(problem, CPU_CFG._replace(block_k=32), False, monkeypatch)
    for (g, plan), (w, _) in zip(got, want):
        assert plan == (False, False)
        assert torch.equal(g, w)


GPU_SHAPES = [  # (routing, T, k, E, H, F)
    ("zipf", 512, 4, 16, 512, 256),
    ("uniform", 1024, 8, 128, 2048, 768),  # the Qwen3 expert shape, short K loops
    ("sparse_experts", 2048, 8, 33, 1024, 384),  # empty experts, 128-row route blocks
    ("zipf", 8192, 8, 128, 2048, 768),  # the Qwen3 shape at load, skewed
]
GPU_TILES = [GemmConfig(128, 128, 32, 8, 8, 5), GemmConfig(256, 128, 64, 4, 8, 3),
             GemmConfig(128, 256, 64, 4, 8, 3), GemmConfig(128, 128, 64, 8, 4, 2)]


@pytest.mark.cuda
@pytest.mark.parametrize("tile", GPU_TILES, ids=lambda c: "x".join(map(str, c[:6])))
@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_padded_and_tma_variants_are_bitwise_equal(case, tile, monkeypatch):
    _, T, k, E, H, F = case
    block = route_block_m(T * k, E, torch.device("cuda"))
    problem = _problem(case, None, "cuda", torch.bfloat16, block)
    want = _both_dw(problem, tile, False, monkeypatch)
    empty = problem[4].expert_counts == 0
    for tma in (False, True):
        got = _both_dw(problem, tile._replace(tma=tma), True, monkeypatch)
        torch.cuda.synchronize()
        for name, (g, plan), (w, _) in zip(("dW_down", "dW_gate_up"), got, want):
            assert plan == (True, tma), (name, plan)
            assert torch.isfinite(g).all(), name
            assert (g[empty] == 0).all(), name
            assert torch.equal(g, w), (
                f"{name} tma={tma}: max |diff| {(g.float() - w.float()).abs().max().item():.3e}")


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_persistent_and_tma_store_variants_are_bitwise_equal(case, monkeypatch):
    _, T, k, E, H, F = case
    block = route_block_m(T * k, E, torch.device("cuda"))
    problem = _problem(case, None, "cuda", torch.bfloat16, block)
    for tile in (wg.wgrad_config(F, torch.device("cuda"), T * k / E),
                 wg.wgrad_config(H, torch.device("cuda"), T * k / E, slot_order_l=True)):
        # The Triton kernel's variants (the warp-specialized one: test_wgrad_ws.py)
        plain = tile._replace(persistent=False, store_tma=False, warp_specialize=False)
        want = _both_dw(problem, plain, True, monkeypatch)
        for persistent, store in ((True, False), (False, True), (True, True)):
            cfg = plain._replace(persistent=persistent, store_tma=store)
            got = _both_dw(problem, cfg, True, monkeypatch)
            torch.cuda.synchronize()
            for gather_l, (g, _), (w, _) in zip((True, False), got, want):
                assert wg.LAST_WGRAD_STORE[gather_l][0] == persistent
                assert torch.isfinite(g).all(), (cfg, gather_l)
                assert torch.equal(g, w), (cfg, gather_l)


@pytest.mark.cuda
def test_cuda_fp32_dw_keeps_the_pointer_store_and_fits_its_stages(monkeypatch):
    """A 4-byte dW's staging tile would not fit beside the pipeline: the pointer store, and
    the long-loop tile's stages lowered until shared memory holds them (the same sums)."""
    case = GPU_SHAPES[3]
    _, T, k, E, H, F = case
    problem = _problem(case, None, "cuda", torch.float32, 128)
    tile = wg.wgrad_config(H, torch.device("cuda"), T * k / E, slot_order_l=True)
    got = _both_dw(problem, tile._replace(store_tma=True), True, monkeypatch)
    want = _both_dw(problem, tile._replace(persistent=False, store_tma=False), True,
                    monkeypatch)
    torch.cuda.synchronize()
    for gather_l, (g, _), (w, _) in zip((True, False), got, want):
        assert wg.LAST_WGRAD_STORE[gather_l][1] is False
        assert torch.equal(g, w), gather_l


def test_long_loop_tiles_run_persistent_and_store_by_tma_as_measured(monkeypatch):
    """dW_down always; dW_gate_up's TMA store only up to 1024 slots an expert (the H200
    sweep); MOEGRAPH_WGRAD_PERSISTENT / _TMA_STORE (read into PERSISTENT / STORE_TMA) force
    either, and the short-loop tile keeps neither."""
    monkeypatch.setattr(wg, "PERSISTENT", None)
    monkeypatch.setattr(wg, "STORE_TMA", None)
    cuda = torch.device("cuda")
    down, up = wg.wgrad_config(768, cuda, 512), wg.wgrad_config(2048, cuda, 512, True)
    assert (down.persistent, down.store_tma, up.persistent, up.store_tma) == (True,) * 4
    up_long = wg.wgrad_config(2048, cuda, 2048, True)
    assert up_long.persistent and not up_long.store_tma
    short = wg.wgrad_config(768, cuda, 64)
    assert not short.persistent and not short.store_tma
    monkeypatch.setattr(wg, "PERSISTENT", False)
    monkeypatch.setattr(wg, "STORE_TMA", True)
    forced = wg.wgrad_config(2048, cuda, 2048, True)
    assert not forced.persistent and forced.store_tma
    assert forced._replace(persistent=True, store_tma=False) == up_long


@pytest.mark.parametrize("T", [8192, 32768])
def test_the_long_loop_tile_puts_its_256_on_the_slot_order_operand(T):
    from moegraph_cli.moe.experts import tile_configs
    cfg = tile_configs(T * 8, 128, 2048, 768, torch.device("cuda"))
    # dW_gate_up: L = dY1 in slot order (M side); dW_down: R = A in slot order (N side).
    assert (cfg.wgrad_gate_up.block_m, cfg.wgrad_gate_up.block_n) == (256, 128)
    assert (cfg.wgrad_down.block_m, cfg.wgrad_down.block_n) == (128, 256)
    assert cfg.wgrad_gate_up.tma and cfg.wgrad_down.tma
    short = tile_configs(1024 * 8, 128, 2048, 768, torch.device("cuda"))
    assert short.wgrad_gate_up == short.wgrad_down  # the short-loop tile, both weights
