"""The warp-specialized FC2 / dX (kernels/slot_gemm_ws.py) against slot_gemm's Triton kernel,
on a Hopper GPU.

Same tile, same K order, same wgmma shapes: bitwise equal on every row of a live block; the
rows of dead blocks (no expert) are never written (outputs start full of NaN). Where the
kernel does not take a launch (`slot_gemm_ws.fits`), the Triton kernel runs instead. On the
CPU only that choice, the stage cap and the fallback of a failed launch are checked, with the
GPU checks stubbed: Gluon has no interpreter. (tests/kernels/test_compile_report_script.py
lowers the kernel for sm_90a.)
"""

from __future__ import annotations

import pytest
import torch
from routing_cases import moe_inputs

import moegraph_kernels.gemm_launch as gl
import moegraph_kernels.slot_gemm_ws as ws
from moegraph_cli.moe.experts import build_routes, tile_configs
from moegraph_kernels import gluon_hopper
from moegraph_kernels.gemm_config import GemmConfig
from moegraph_kernels.slot_gemm import slot_gemm

SHAPES = [  # (routing, T, k, E, H, F, capacity factor)
    ("zipf", 8192, 8, 128, 2048, 768, None),  # the Qwen3 shape at load, skewed
    ("uniform", 8192, 8, 128, 2048, 768, None),
    ("one_expert", 640, 1, 5, 512, 256, None),  # every token to one expert
    ("sparse_experts", 2048, 8, 33, 1024, 384, None),  # empty experts
    ("zipf", 4096, 4, 16, 512, 256, 1.0),  # capacity: dead blocks between live ones
]


# The product's FC2 / dX tile at 128-row blocks (moe/experts.tile_configs); the Gluon kernel
# runs it at the 3 stages that fit beside its store buffer, the same K order.
TILE = GemmConfig(128, 256, 64, 8, 8, 4, tma=True, persistent=True)


def _hopper() -> bool:
    return torch.cuda.is_available() and gluon_hopper.available(torch.device("cuda"))


def _problem(case, device="cuda", dtype=torch.bfloat16, block=128):
    kind, T, k, E, H, F, capacity = case
    x, ids, w, w_gate_up, w_down, _ = [t.to(device) for t in moe_inputs(kind, T, k, E, H, F)]
    routes = build_routes(ids, w, E, block, capacity)
    gen = torch.Generator().manual_seed(1)
    S = routes.num_slots
    act = torch.randn(S, F, generator=gen).to(device, dtype)
    dy1 = torch.randn(S, 2 * F, generator=gen).to(device, dtype)
    return act, dy1, w_gate_up.to(dtype), w_down.to(dtype), routes


def _both(problem, cfg):
    """(FC2's, dX's) outputs under cfg, each into a NaN-filled buffer, and their plans."""
    act, dy1, w_gate_up, w_down, routes = problem
    S, H = routes.num_slots, w_down.shape[1]
    out = []
    for a, w, w_nk in ((act, w_down, True), (dy1, w_gate_up, False)):
        c = torch.full((S, H), float("nan"), dtype=a.dtype, device=a.device)
        slot_gemm(a, w, routes, c, w_nk, cfg)
        out.append((c, gl.LAST_PLAN["fc2" if w_nk else "dx"]))
    return out


def _live_rows(routes):
    return (routes.block_expert >= 0).repeat_interleave(routes.block_m)


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_warp_specialized_slot_gemm_is_bitwise_the_triton_kernel(case):
    problem = _problem(case)
    live = _live_rows(problem[-1])
    want = _both(problem, TILE)
    got = _both(problem, TILE._replace(warp_specialize=True))
    torch.cuda.synchronize()
    for name, (g, plan), (w, _) in zip(("fc2", "dx"), got, want):
        assert plan.warp_specialize and not plan.fallback, (name, plan)
        assert torch.isfinite(g[live]).all(), name
        assert torch.isnan(g[~live]).all(), name
        assert torch.equal(g[live], w[live]), (
            f"{name}: max |diff| {(g[live].float() - w[live].float()).abs().max().item():.3e}")


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
def test_cuda_product_tiles_take_the_warp_specialized_kernel_at_load():
    _, T, k, E, H, F, _ = SHAPES[0]
    cfgs = tile_configs(T * k, E, H, F, torch.device("cuda"))
    assert cfgs.route_block == 128
    assert cfgs.fc2.warp_specialize and cfgs.dx.warp_specialize
    got = _both(_problem(SHAPES[0]), cfgs.fc2)
    assert got[0][1].warp_specialize


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
def test_cuda_warp_specialized_slot_gemm_replays_in_a_graph():
    """Captured once, replayed on new values: the replay equals a fresh Triton launch's."""
    act, dy1, w_gate_up, w_down, routes = _problem(SHAPES[0])
    H = w_down.shape[1]
    cfg = TILE._replace(warp_specialize=True)
    a = act.clone()
    out = torch.full((routes.num_slots, H), float("nan"), dtype=a.dtype, device=a.device)
    slot_gemm(a, w_down, routes, out, True, cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slot_gemm(a, w_down, routes, out, True, cfg)
    assert gl.LAST_PLAN["fc2"].warp_specialize
    a.copy_(act * 0.5)
    graph.replay()
    want = torch.empty_like(out)
    slot_gemm(act * 0.5, w_down, routes, want, True, cfg._replace(warp_specialize=False))
    torch.cuda.synchronize()
    live = _live_rows(routes)
    assert torch.equal(out[live], want[live])


def test_the_warp_specialized_slot_gemm_takes_only_the_launches_it_fits():
    """`fits`: 2-byte A, w and out of one dtype; 128-row tiles the size of the route block;
    whole N and K tiles; 16-byte rows; the CPU never takes it (`available`)."""
    bf = torch.bfloat16
    a, w, out = torch.zeros(256, 768, dtype=bf), torch.zeros(4, 512, 768, dtype=bf), \
        torch.zeros(256, 512, dtype=bf)
    assert ws.fits(a, w, out, True, 128, 256, 64, 128)
    assert ws.fits(torch.zeros(256, 512, dtype=bf), torch.zeros(4, 512, 768, dtype=bf),
                   torch.zeros(256, 768, dtype=bf), False, 128, 256, 64, 128)  # dX: [E, K, N]
    assert not ws.fits(a, w, out, True, 64, 256, 64, 64)  # 64-row tiles
    assert not ws.fits(a, w, out, True, 128, 256, 64, 256)  # tile shorter than the block
    assert not ws.fits(a, torch.zeros(4, 384, 768, dtype=bf), torch.zeros(256, 384, dtype=bf),
                       True, 128, 256, 64, 128)  # N not a whole tile
    assert not ws.fits(torch.zeros(256, 96, dtype=bf), torch.zeros(4, 512, 96, dtype=bf), out,
                       True, 128, 256, 64, 128)  # K not a whole tile
    assert not ws.fits(a.float(), w.float(), out.float(), True, 128, 256, 64, 128)
    flat = torch.zeros(1 + out.numel(), dtype=bf)  # out starting 2 bytes into its buffer
    assert not ws.fits(a, w, flat[1:].view(out.shape), True, 128, 256, 64, 128)
    assert not ws.fits(a, w.transpose(1, 2).contiguous().transpose(1, 2), out, True, 128, 256,
                       64, 128)  # w not contiguous
    assert not gluon_hopper.available(torch.device("cpu"))


def test_the_stage_count_fits_shared_memory():
    # 128 x 256 x 64: 48 KB a stage beside a 64 KB store buffer -> 3 stages of a config's 4.
    assert ws.stages_that_fit(128, 256, 64, 4) == 3
    assert ws.stages_that_fit(128, 128, 64, 4) == 4
    assert ws.stages_that_fit(128, 256, 64, 2) == 2
    for bm, bn, bk in ((128, 256, 64), (128, 128, 64), (128, 256, 128)):
        s = ws.stages_that_fit(bm, bn, bk, 8)
        assert (bm + bn) * bk * 2 * s + bm * bn * 2 <= ws.SHARED_BYTES


CPU_CASE = ("zipf", 64, 4, 7, 64, 32, None)


@pytest.mark.parametrize("fails", [False, True])
def test_slot_gemm_takes_the_warp_specialized_kernel_where_asked(fails, monkeypatch):
    """On the CPU, with the GPU checks stubbed: a config asking for warp_specialize calls the
    Gluon launcher (here a stand-in that writes the Triton kernel's result, or raises), and a
    failure leaves the Triton kernel's values; a config that does not ask, or one with FC2's
    bias, never calls it."""
    monkeypatch.setattr(gl, "_FAILED_VARIANTS", {})
    problem = _problem(CPU_CASE, "cpu", torch.float32, 16)
    cfg = GemmConfig(16, 32, 32, 4, 4, 1)
    want = _both(problem, cfg)
    calls = []

    def stand_in(a_SK, w_E, block_expert, starts, counts, out, w_nk, *tile):
        calls.append(w_nk)
        if fails:
            raise RuntimeError("compile failed")
        out.copy_(want[0 if w_nk else 1][0])
        return 3

    monkeypatch.setattr(gluon_hopper, "available", lambda device: True)
    monkeypatch.setattr(ws, "fits", lambda *args: True)
    monkeypatch.setattr(ws, "slot_gemm_ws", stand_in)
    _both(problem, cfg)  # not asked: never called
    act, _, _, w_down, routes = problem
    bias = torch.zeros(w_down.shape[0], w_down.shape[1])
    slot_gemm(act, w_down, routes, torch.empty(routes.num_slots, w_down.shape[1]), True,
              cfg._replace(warp_specialize=True), bias_EN=bias,
              topk_weights_N=torch.ones(routes.token_slots.numel()))
    assert calls == []
    if fails:
        with pytest.warns(RuntimeWarning, match="warp-specialized kernel failed"):
            got = _both(problem, cfg._replace(warp_specialize=True))
    else:
        got = _both(problem, cfg._replace(warp_specialize=True))
    assert calls == [True, False]
    for (g, plan), (w, _) in zip(got, want):
        assert plan.warp_specialize == (not fails), plan
        assert plan.grid == 3 or fails, plan
        live = _live_rows(problem[-1])
        assert torch.equal(g[live], w[live])


class _Recorder:
    """Stands in for a Gluon kernel: kernel[grid](*args, **kwargs) records the call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.mark.skipif(not gluon_hopper.GLUON, reason="needs Gluon")
def test_the_launchers_pass_every_kernel_argument(monkeypatch):
    """On the CPU, with the kernels recorded instead of launched: slot_gemm_ws and
    fc1_swiglu_ws name every argument of their kernel once, the constexprs as
    `launch_constants` gives them (what compile_report.py lowers)."""
    import moegraph_kernels.fc1_swiglu_ws as fc1_ws
    act, dy1, w_gate_up, w_down, routes = _problem(SHAPES[2], "cpu")
    S, H, F = routes.num_slots, w_down.shape[1], w_down.shape[2]
    for module, name, call in (
            (ws, "_slot_gemm_ws_kernel", lambda: ws.slot_gemm_ws(
                act, w_down, routes.block_expert, routes.expert_starts, routes.expert_counts,
                torch.empty(S, H, dtype=act.dtype), True, 128, 256, 64, 8, 4, 132)),
            (fc1_ws, "_fc1_swiglu_ws_kernel", lambda: fc1_ws.fc1_swiglu_ws(
                torch.zeros(640, H, dtype=act.dtype), w_gate_up, torch.ones(640, dtype=act.dtype),
                routes, torch.empty(S, 2 * F, dtype=act.dtype), torch.empty(S, F, dtype=act.dtype),
                128, 128, 64, 4, 4, 132))):
        rec = _Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, rec)
        call()
        (_, args, kwargs), = rec.calls
        kwargs.pop("enable_fp_fusion")
        assert len(args) + len(kwargs) == len(rec.fn.arg_names), name
        assert set(kwargs) == set(rec.fn.arg_names[len(args):]), (name, sorted(kwargs))
        cfg = (128, 256, 64, 8, 4) if module is ws else (128, 128, 64, 4, 4)
        assert kwargs.items() >= module.launch_constants(*cfg).items()
