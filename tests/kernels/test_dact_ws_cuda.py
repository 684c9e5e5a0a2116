"""The warp-specialized dA (kernels/dact_ws.py) against the Triton paired dA, on a Hopper GPU.

dY1 and A bitwise; dp_part (each 64-column group's sum, in another order) to fp32 rounding;
every row of a live block written (outputs start full of NaN); the clamped activation too.
Where the kernel does not take a launch (`dact_ws.fits`, the route block), the Triton kernel
runs instead. On the CPU only that choice is checked: Gluon has no interpreter.
"""

from __future__ import annotations

import functools

import pytest
import torch
from routing_cases import moe_inputs

import moegraph_kernels.dact_swiglu as ds
import moegraph_kernels.wgrad_ws as ws
from moegraph_cli.moe.experts import build_routes, tile_configs
from moegraph_kernels import dact_ws
from moegraph_kernels.fc1_swiglu import fc1_swiglu
from moegraph_kernels.gemm_config import fc1_config, route_block_m

SHAPES = [  # (routing, T, k, E, H, F)
    ("zipf", 2048, 8, 16, 512, 256),  # skewed, a few experts, 128-row route blocks
    ("one_expert", 4096, 1, 5, 256, 512),  # every token to one expert
    ("sparse_experts", 4096, 8, 33, 1024, 384),  # empty experts; F = 384: no pair, no WS
    ("uniform", 8192, 8, 128, 2048, 768),  # the Qwen3 shape at load
    ("zipf", 16384, 8, 128, 2048, 768),  # the loaded step's tokens a layer, skewed
]


def _hopper() -> bool:
    return torch.cuda.is_available() and ws.available(torch.device("cuda"))


@functools.lru_cache(maxsize=None)
def _inputs(case):
    kind, T, k, E, H, F = case
    cuda = torch.device("cuda")
    x, ids, w, w_gate_up, w_down, dout = [t.to(cuda) for t in
                                          moe_inputs(kind, T, k, E, H, F, seed=T + E)]
    x, w_gate_up, w_down, dout = (t.to(torch.bfloat16) for t in (x, w_gate_up, w_down, dout))
    block = route_block_m(T * k, E, cuda)
    routes = build_routes(ids, w, E, block, None)
    S = routes.num_slots
    y1 = torch.full((S, 2 * F), float("nan"), dtype=torch.bfloat16, device=cuda)
    fc1_swiglu(x, w_gate_up, w.reshape(-1).contiguous(), routes, y1,
               torch.empty((S, F), dtype=torch.bfloat16, device=cuda),
               fc1_config(F, block, cuda))
    return dout, w_down, y1, w.reshape(-1).float().contiguous(), routes


def _dact(case, cfg, clamp=None):
    dout, w_down, y1, w_N, routes = _inputs(case)
    S, F = routes.num_slots, w_down.shape[2]
    nan = functools.partial(torch.full, fill_value=float("nan"), device=dout.device)
    outs = (nan((S, 2 * F), dtype=dout.dtype), nan((S, F), dtype=dout.dtype),
            nan((S, ds.dp_tiles(F, cfg)), dtype=torch.float32))
    ds.dact_swiglu(dout, w_down, y1, w_N, routes, *outs, cfg, clamp=clamp)
    return outs, ds.LAST_WS[0], routes


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("clamp", [None, (1.702, 7.0)], ids=["swiglu", "clamped"])
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_warp_specialized_dact_matches_the_triton_kernel(case, clamp):
    _, T, k, E, H, F = case
    cfg = tile_configs(T * k, E, H, F, torch.device("cuda")).dact
    if not cfg.paired:
        pytest.skip("the paired tile applies only at 128-row route blocks")
    want, ran_want, routes = _dact(case, cfg._replace(warp_specialize=False), clamp)
    got, ran, _ = _dact(case, cfg._replace(warp_specialize=True), clamp)
    torch.cuda.synchronize()
    assert not ran_want
    assert ran == (F % 256 == 0 and H % 64 == 0), (ran, case)
    live = torch.repeat_interleave(routes.block_expert >= 0, routes.block_m)
    for name, g, w in zip(("dY1", "A", "dp_part"), got, want):
        g, w = g[live], w[live]
        assert torch.isfinite(g).all(), f"{name}: a live row left unwritten"
        if name == "dp_part":
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(g, w), (
                f"{name}: max |diff| {(g.float() - w.float()).abs().max().item():.3e}")


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
def test_cuda_warp_specialized_dact_replays_in_a_graph():
    case = SHAPES[3]
    _, T, k, E, H, F = case
    dout, w_down, y1, w_N, routes = _inputs(case)
    cfg = tile_configs(T * k, E, H, F, torch.device("cuda")).dact._replace(
        warp_specialize=True)
    S = routes.num_slots
    d_in = dout.clone()
    outs = (torch.empty((S, 2 * F), dtype=dout.dtype, device=dout.device),
            torch.empty((S, F), dtype=dout.dtype, device=dout.device),
            torch.empty((S, ds.dp_tiles(F, cfg)), dtype=torch.float32, device=dout.device))
    ds.dact_swiglu(d_in, w_down, y1, w_N, routes, *outs, cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ds.dact_swiglu(d_in, w_down, y1, w_N, routes, *outs, cfg)
    assert ds.LAST_WS[0]
    d_in.copy_(dout * -0.5)
    graph.replay()
    want = tuple(torch.empty_like(o) for o in outs)
    ds.dact_swiglu(dout * -0.5, w_down, y1, w_N, routes, *want, cfg)
    torch.cuda.synchronize()
    live = torch.repeat_interleave(routes.block_expert >= 0, routes.block_m)
    for g, w in zip(outs, want):
        assert torch.equal(g[live], w[live])


def test_the_warp_specialized_dact_takes_only_the_launches_it_fits():
    bf = torch.bfloat16
    dout, w, y1 = torch.zeros(8, 512, dtype=bf), torch.zeros(2, 512, 256, dtype=bf), \
        torch.zeros(16, 512, dtype=bf)
    assert dact_ws.fits(dout, w, y1, 128)
    assert not dact_ws.fits(dout, w, y1, 64)  # route block
    assert not dact_ws.fits(dout, torch.zeros(2, 512, 192, dtype=bf), y1, 128)  # F % 128
    assert not dact_ws.fits(dout, torch.zeros(2, 480, 256, dtype=bf), y1, 128)  # H % 64
    assert not dact_ws.fits(dout.float(), w.float(), y1.float(), 128)
    assert not ws.available(torch.device("cpu"))
