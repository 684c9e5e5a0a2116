"""The warp-specialized FC1 + SwiGLU (kernels/fc1_swiglu_ws.py) against fc1_swiglu's Triton
kernel, on a Hopper GPU.

Same tile, same K order, same wgmma shapes, the same SwiGLU formula: Y1 and A bitwise equal
on every row of a live block (padding slots' rows zeros in both); the rows of dead blocks are
never written (outputs start full of NaN). Where the kernel does not take a launch
(`fc1_swiglu_ws.fits`, a bias or the clamped SwiGLU), the Triton kernel runs instead. On the
CPU only that choice, the stage cap and the fallback of a failed launch are checked, with the
GPU checks stubbed: Gluon has no interpreter. (tests/kernels/test_compile_report_script.py
lowers the kernel for sm_90a.)
"""

from __future__ import annotations

import pytest
import torch
from routing_cases import moe_inputs
from test_slot_gemm_ws import SHAPES, _hopper, _live_rows

import moegraph_kernels.fc1_swiglu_ws as ws
import moegraph_kernels.gemm_launch as gl
from moegraph_cli.moe.experts import build_routes, tile_configs
from moegraph_kernels import gluon_hopper
from moegraph_kernels.fc1_swiglu import fc1_swiglu
from moegraph_kernels.gemm_config import GemmConfig

# The product's FC1 tile at 128-row blocks (moe/experts.tile_configs): the Gluon kernel runs
# it (and TILE_S3) at the 3 stages that fit beside its two hand-off buffers, the same K order.
TILE = GemmConfig(128, 128, 64, 4, 8, 4, tma=True, persistent=True, paired=True)
TILE_S3 = TILE._replace(num_stages=3)


def _problem(case, device="cuda", dtype=torch.bfloat16, block=128):
    kind, T, k, E, H, F, capacity = case
    x, ids, w, w_gate_up, _, _ = [t.to(device) for t in moe_inputs(kind, T, k, E, H, F)]
    routes = build_routes(ids, w, E, block, capacity)
    return x.to(dtype), w_gate_up.to(dtype), w.reshape(-1).to(dtype), routes


def _run(problem, cfg, **kw):
    """(Y1, A) under cfg into NaN-filled buffers, and the plan."""
    x, w_gate_up, w_N, routes = problem
    S, F = routes.num_slots, w_gate_up.shape[1] // 2
    y1 = torch.full((S, 2 * F), float("nan"), dtype=x.dtype, device=x.device)
    act = torch.full((S, F), float("nan"), dtype=x.dtype, device=x.device)
    fc1_swiglu(x, w_gate_up, w_N, routes, y1, act, cfg, **kw)
    return (y1, act), gl.LAST_PLAN["fc1"]


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_warp_specialized_fc1_is_bitwise_the_triton_kernel(case):
    problem = _problem(case)
    routes = problem[-1]
    live = _live_rows(routes)
    padding = live & (routes.slot_token >= problem[0].shape[0])
    want, _ = _run(problem, TILE)
    for tile in (TILE, TILE_S3):  # asking for 4 stages (3 fit), then for 3
        got, plan = _run(problem, tile._replace(warp_specialize=True))
        torch.cuda.synchronize()
        assert plan.warp_specialize and not plan.fallback, plan
        _check(got, want, live, padding)


def _check(got, want, live, padding):
    for name, g, w in zip(("Y1", "A"), got, want):
        assert torch.isfinite(g[live]).all(), name
        assert torch.isnan(g[~live]).all(), name
        assert (g[padding] == 0).all(), name
        assert torch.equal(g[live], w[live]), (
            f"{name}: max |diff| {(g[live].float() - w[live].float()).abs().max().item():.3e}")


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
def test_cuda_warp_specialized_fc1_replays_in_a_graph_and_leaves_the_clamped_swiglu():
    """Captured once, replayed on new values: the replay equals a fresh Triton launch's. The
    clamped SwiGLU (GPT-OSS) is not this kernel's: it runs the Triton kernel."""
    x0, w_gate_up, w_N, routes = _problem(SHAPES[0])
    _, T, k, E, H, F, _ = SHAPES[0]
    # the product's tile, asking for the Gluon kernel (opt-in: gemm_config.FC1_WS)
    cfg = tile_configs(T * k, E, H, F, torch.device("cuda")).fc1._replace(warp_specialize=True)
    x = x0.clone()
    y1 = torch.empty(routes.num_slots, 2 * F, dtype=x.dtype, device=x.device)
    act = torch.empty(routes.num_slots, F, dtype=x.dtype, device=x.device)
    fc1_swiglu(x, w_gate_up, w_N, routes, y1, act, cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fc1_swiglu(x, w_gate_up, w_N, routes, y1, act, cfg)
    assert gl.LAST_PLAN["fc1"].warp_specialize
    x.copy_(x0.flip(0))
    graph.replay()
    (want_y1, want_act), _ = _run((x0.flip(0).contiguous(), w_gate_up, w_N, routes),
                                  cfg._replace(warp_specialize=False))
    torch.cuda.synchronize()
    live = _live_rows(routes)
    assert torch.equal(y1[live], want_y1[live]) and torch.equal(act[live], want_act[live])
    _, plan = _run((x0, w_gate_up, w_N, routes), cfg, clamp=(1.702, 7.0))
    assert not plan.warp_specialize, plan


def test_the_warp_specialized_fc1_takes_only_the_launches_it_fits():
    """`fits`: 2-byte X, w, Y1 and A of one dtype; 128-row tiles the size of the route block;
    F a multiple of BN, H of BK; 16-byte rows; the CPU never takes it (`available`)."""
    bf = torch.bfloat16
    x, w = torch.zeros(64, 512, dtype=bf), torch.zeros(4, 512, 512, dtype=bf)
    y1, act = torch.zeros(256, 512, dtype=bf), torch.zeros(256, 256, dtype=bf)
    assert ws.fits(x, w, y1, act, 128, 128, 64, 128)
    assert not ws.fits(x, w, y1, act, 64, 128, 64, 64)  # 64-row tiles
    assert not ws.fits(x, w, y1, act, 128, 256, 64, 128)  # 2 BN past one wgmma's 256
    assert not ws.fits(x, w, y1, act, 128, 128, 64, 256)  # tile shorter than the block
    assert not ws.fits(x, torch.zeros(4, 384, 512, dtype=bf), torch.zeros(256, 384, dtype=bf),
                       torch.zeros(256, 192, dtype=bf), 128, 128, 64, 128)  # F = 192
    assert not ws.fits(torch.zeros(64, 96, dtype=bf), torch.zeros(4, 512, 96, dtype=bf), y1,
                       act, 128, 128, 64, 128)  # H not a whole K tile
    assert not ws.fits(x.float(), w.float(), y1.float(), act.float(), 128, 128, 64, 128)
    flat = torch.zeros(1 + x.numel(), dtype=bf)  # X starting 2 bytes into its buffer
    assert not ws.fits(flat[1:].view(x.shape), w, y1, act, 128, 128, 64, 128)
    assert not gluon_hopper.available(torch.device("cpu"))


def test_the_stage_count_fits_shared_memory():
    # 128 x (2 x 128) x 64: 48 KB a stage; 3 beside the two 32 KB hand-off buffers.
    assert ws.stages_that_fit(128, 128, 64, 3) == 3
    assert ws.stages_that_fit(128, 128, 64, 4) == 3
    assert ws.stages_that_fit(128, 128, 64, 2) == 2
    assert ws.stages_that_fit(128, 64, 64, 4) == 4
    for bm, bn, bk in ((128, 128, 64), (128, 64, 64), (128, 128, 128)):
        for want in range(1, 9):
            s = ws.stages_that_fit(bm, bn, bk, want)
            assert 1 <= s <= want
            assert (bm + 2 * bn) * bk * 2 * s + 2 * bm * bn * 2 <= ws.SHARED_BYTES or s == 1


CPU_CASE = ("zipf", 64, 4, 7, 64, 32, None)


@pytest.mark.parametrize("fails", [False, True])
def test_fc1_takes_the_warp_specialized_kernel_where_asked(fails, monkeypatch):
    """On the CPU, with the GPU checks stubbed: a config asking for warp_specialize calls the
    Gluon launcher (here a stand-in that writes the Triton kernel's result, or raises), and a
    failure leaves the Triton kernel's values; a config that does not ask, one with a bias and
    one with the clamped SwiGLU never call it."""
    monkeypatch.setattr(gl, "_FAILED_VARIANTS", {})
    problem = _problem(CPU_CASE, "cpu", torch.float32, 16)
    cfg = GemmConfig(16, 32, 32, 4, 4, 1)
    want, _ = _run(problem, cfg)
    calls = []

    def stand_in(x, w, w_N, routes, y1, act, *tile):
        calls.append(1)
        if fails:
            raise RuntimeError("compile failed")
        y1.copy_(want[0])
        act.copy_(want[1])
        return 3

    monkeypatch.setattr(gluon_hopper, "available", lambda device: True)
    monkeypatch.setattr(ws, "fits", lambda *args: True)
    monkeypatch.setattr(ws, "fc1_swiglu_ws", stand_in)
    _run(problem, cfg)  # not asked: never called
    ws_cfg = cfg._replace(warp_specialize=True)
    E, F2 = problem[1].shape[:2]
    _run(problem, ws_cfg, bias_EF2=torch.zeros(E, F2))
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
