"""The warp-specialized dA + SwiGLU backward (kernels/dact_swiglu_ws.py) against dact_swiglu's
paired Triton tile, on a Hopper GPU.

Same tile, same K order, the same formulas: dY1 and A bitwise equal on every row of a live
block; dp_part (each column a quarter's sum over its columns, summed in another order) within
fp32 rounding and the same on every run; the rows of dead blocks are never written (outputs
start full of NaN). Where the kernel does not take a launch (`dact_swiglu_ws.fits`, the
clamped SwiGLU), the Triton kernel runs instead. On the CPU only that choice, the stage cap
and the fallback of a failed launch are checked, with the GPU checks stubbed: Gluon has no
interpreter.
"""

from __future__ import annotations

import pytest
import torch
from routing_cases import moe_inputs
from test_slot_gemm_ws import SHAPES, _hopper, _live_rows

import moegraph_kernels.dact_swiglu_ws as ws
import moegraph_kernels.gemm_launch as gl
from moegraph_cli.moe.experts import build_routes, tile_configs
from moegraph_kernels import gluon_hopper
from moegraph_kernels.dact_swiglu import dact_swiglu, dp_tiles
from moegraph_kernels.gemm_config import GemmConfig

# The product's dA tile at 128-row blocks (moe/experts.tile_configs): paired, 128 x 256.
TILE = GemmConfig(128, 128, 64, 8, 8, 3, paired=True)


def _problem(case, device="cuda", dtype=torch.bfloat16, block=128):
    kind, T, k, E, H, F, capacity = case
    _, ids, w, _, w_down, _ = [t.to(device) for t in moe_inputs(kind, T, k, E, H, F)]
    routes = build_routes(ids, w, E, block, capacity)
    gen = torch.Generator().manual_seed(2)
    # Padding slots' Y1 rows zero, as FC1 writes them.
    real = (routes.slot_route.cpu() < ids.numel())[:, None]
    y1 = (torch.randn(routes.num_slots, 2 * F, generator=gen) * real).to(device, dtype)
    dout = torch.randn(T, H, generator=gen).to(device, dtype)
    return dout, w_down.to(dtype), y1, w.reshape(-1).to(dtype), routes


def _run(problem, cfg, **kw):
    """(dY1, A, dp_part) under cfg into NaN-filled buffers, and the plan."""
    dout, w_down, y1, w_N, routes = problem
    S, F = routes.num_slots, w_down.shape[2]
    nan = float("nan")
    outs = (torch.full((S, 2 * F), nan, dtype=dout.dtype, device=dout.device),
            torch.full((S, F), nan, dtype=dout.dtype, device=dout.device),
            torch.full((S, dp_tiles(F, cfg)), nan, dtype=torch.float32, device=dout.device))
    dact_swiglu(dout, w_down, y1, w_N, routes, *outs, cfg, **kw)
    return outs, gl.LAST_PLAN["dact"]


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_warp_specialized_dact_matches_the_triton_kernel(case):
    problem = _problem(case)
    routes = problem[-1]
    live = _live_rows(routes)
    padding = live & (routes.slot_route >= problem[3].numel())
    want, _ = _run(problem, TILE)
    got, plan = _run(problem, TILE._replace(warp_specialize=True))
    again, _ = _run(problem, TILE._replace(warp_specialize=True))
    torch.cuda.synchronize()
    # F not a multiple of the 256-wide tile: the Triton kernel's launch
    assert plan.warp_specialize == (case[5] % 256 == 0) and not plan.fallback, plan
    for name, g, w, a in zip(("dY1", "A", "dp_part"), got, want, again):
        assert torch.isfinite(g[live]).all(), name
        assert torch.isnan(g[~live]).all(), name
        assert (g[padding] == 0).all(), name
        assert torch.equal(g[live], a[live]), name  # the same on every run
        if name == "dp_part":
            torch.testing.assert_close(g[live], w[live], rtol=1e-5, atol=1e-4)
        else:
            assert torch.equal(g[live], w[live]), (
                f"{name}: max |diff| {(g[live].float() - w[live].float()).abs().max():.3e}")


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
def test_cuda_warp_specialized_dact_replays_in_a_graph_and_leaves_the_clamped_swiglu():
    """Captured once, replayed on new values: the replay equals a fresh launch's. The clamped
    SwiGLU (GPT-OSS) is not this kernel's: it runs the Triton kernel."""
    dout0, w_down, y1, w_N, routes = _problem(SHAPES[0])
    _, T, k, E, H, F, _ = SHAPES[0]
    cfg = tile_configs(T * k, E, H, F, torch.device("cuda")).dact._replace(warp_specialize=True)
    dout = dout0.clone()
    outs = (torch.empty(routes.num_slots, 2 * F, dtype=dout.dtype, device=dout.device),
            torch.empty(routes.num_slots, F, dtype=dout.dtype, device=dout.device),
            torch.empty(routes.num_slots, dp_tiles(F, cfg), device=dout.device))
    dact_swiglu(dout, w_down, y1, w_N, routes, *outs, cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dact_swiglu(dout, w_down, y1, w_N, routes, *outs, cfg)
    assert gl.LAST_PLAN["dact"].warp_specialize
    dout.copy_(dout0.flip(0))
    graph.replay()
    want, _ = _run((dout0.flip(0).contiguous(), w_down, y1, w_N, routes), cfg)
    torch.cuda.synchronize()
    live = _live_rows(routes)
    for g, w in zip(outs, want):
        assert torch.equal(g[live], w[live])
    _, plan = _run((dout0, w_down, y1, w_N, routes), cfg, clamp=(1.702, 7.0))
    assert not plan.warp_specialize, plan


def test_the_warp_specialized_dact_takes_only_the_launches_it_fits():
    """`fits`: 2-byte operands of one dtype; the 128 x 256 tile dividing F; H a multiple of
    BK; 128-row tiles the size of the route block; 16-byte rows; never on the CPU."""
    bf = torch.bfloat16
    dout, w = torch.zeros(64, 512, dtype=bf), torch.zeros(4, 512, 512, dtype=bf)
    y1, dy1, act = (torch.zeros(256, 1024, dtype=bf), torch.zeros(256, 1024, dtype=bf),
                    torch.zeros(256, 512, dtype=bf))
    assert ws.fits(dout, w, y1, dy1, act, 128, 256, 64, 128)
    assert not ws.fits(dout, w, y1, dy1, act, 64, 256, 64, 64)  # 64-row tiles
    assert not ws.fits(dout, w, y1, dy1, act, 128, 128, 64, 128)  # not the paired tile
    assert not ws.fits(dout, w, y1, dy1, act, 128, 256, 64, 256)  # tile shorter than block
    assert not ws.fits(dout, torch.zeros(4, 512, 384, dtype=bf), torch.zeros(256, 768, dtype=bf),
                       torch.zeros(256, 768, dtype=bf), torch.zeros(256, 384, dtype=bf),
                       128, 256, 64, 128)  # F = 384: not a whole number of tiles
    assert not ws.fits(torch.zeros(64, 96, dtype=bf), torch.zeros(4, 96, 512, dtype=bf), y1,
                       dy1, act, 128, 256, 64, 128)  # H not a whole K tile
    assert not ws.fits(dout.float(), w.float(), y1.float(), dy1.float(), act.float(),
                       128, 256, 64, 128)
    flat = torch.zeros(1 + dout.numel(), dtype=bf)  # dOut starting 2 bytes into its buffer
    assert not ws.fits(flat[1:].view(dout.shape), w, y1, dy1, act, 128, 256, 64, 128)
    assert not gluon_hopper.available(torch.device("cpu"))


def test_the_stage_count_fits_shared_memory():
    # 128 x 256 x 64: 48 KB a stage; 3 beside the 64 KB of dA quarters.
    assert ws.stages_that_fit(128, 256, 64, 3) == 3
    assert ws.stages_that_fit(128, 256, 64, 5) == 3
    assert ws.stages_that_fit(128, 256, 64, 2) == 2
    for bm, bn, bk in ((128, 256, 64), (128, 128, 64), (128, 256, 32)):
        for want in range(1, 9):
            s = ws.stages_that_fit(bm, bn, bk, want)
            assert 1 <= s <= want
            assert (bm + bn) * bk * 2 * s + bm * bn * 2 <= ws.SHARED_BYTES


CPU_CASE = ("zipf", 64, 4, 8, 64, 64, None)


@pytest.mark.parametrize("fails", [False, True])
def test_dact_takes_the_warp_specialized_kernel_where_asked(fails, monkeypatch):
    """On the CPU, with the GPU checks stubbed: a paired config asking for warp_specialize
    calls the Gluon launcher (here a stand-in that writes the Triton kernel's result, or
    raises), and a failure leaves the Triton kernel's values; a config that does not ask, an
    unpaired one and the clamped SwiGLU never call it."""
    monkeypatch.setattr(gl, "_FAILED_VARIANTS", {})
    problem = _problem(CPU_CASE, "cpu", torch.float32, 16)
    cfg = GemmConfig(16, 16, 32, 4, 4, 1, paired=True)
    want, _ = _run(problem, cfg)
    calls = []

    def stand_in(dout, w, y1, w_N, routes, dy1, act, dp, *tile):
        calls.append(1)
        if fails:
            raise RuntimeError("compile failed")
        for o, v in zip((dy1, act, dp), want):
            o.copy_(v)
        return 3

    monkeypatch.setattr(gluon_hopper, "available", lambda device: True)
    monkeypatch.setattr(ws, "fits", lambda *args: True)
    monkeypatch.setattr(ws, "dact_swiglu_ws", stand_in)
    _run(problem, cfg)  # not asked: never called
    ws_cfg = cfg._replace(warp_specialize=True)
    _run(problem, ws_cfg._replace(paired=False))
    _run(problem, ws_cfg, clamp=(1.702, 7.0))
    assert calls == []
    if fails:
        with pytest.warns(RuntimeWarning, match="warp-specialized kernel failed"):
            got, plan = _run(problem, ws_cfg)
    else:
        got, plan = _run(problem, ws_cfg)
    assert calls == [1]
    assert plan.warp_specialize == (not fails) and (plan.grid == 3 or fails), plan
    live = _live_rows(problem[-1])
    for g, w in zip(got, want):
        assert torch.equal(g[live], w[live])
