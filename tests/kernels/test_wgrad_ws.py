"""The warp-specialized dW (kernels/wgrad_ws.py) against the Triton dW kernel, on a Hopper GPU.

Same tile, same K order, same wgmma shapes: bitwise equal, every element written (outputs
start full of NaN), empty experts exact zeros; where the kernel does not take a launch
(`wgrad_ws.fits`), the Triton kernel runs instead. On the CPU only that choice and the
fallback of a failed launch are checked, with the GPU checks stubbed: Gluon has no
interpreter. (tests/kernels/test_compile_report_script.py lowers the kernel for sm_90a.)
"""

from __future__ import annotations

import pytest
import torch
from test_wgrad_variants import CASES, CPU_CFG, _both_dw, _problem

import moegraph_kernels.gemm_launch as gl
import moegraph_kernels.wgrad as wg
import moegraph_kernels.wgrad_ws as ws
from moegraph_kernels.gemm_config import route_block_m

SHAPES = [  # (routing, T, k, E, H, F)
    ("zipf", 512, 4, 16, 512, 256),  # skewed, a few experts
    ("one_expert", 640, 1, 5, 256, 256),  # every token to one expert: long K loops
    ("sparse_experts", 2048, 8, 33, 1024, 384),  # empty experts; dW_down's N = 384 does not fit
    ("uniform", 1024, 8, 128, 2048, 768),  # the Qwen3 expert shape, 64 slots an expert
    ("zipf", 8192, 8, 128, 2048, 768),  # the Qwen3 shape at load, skewed
]


def _hopper() -> bool:
    return torch.cuda.is_available() and ws.available(torch.device("cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_warp_specialized_dw_is_bitwise_the_triton_kernel(case, monkeypatch):
    _, T, k, E, H, F = case
    cuda = torch.device("cuda")
    block = route_block_m(T * k, E, cuda)
    problem = _problem(case, None, "cuda", torch.bfloat16, block)
    empty = problem[4].expert_counts == 0
    for slot_order_l, n in ((False, F), (True, H)):  # dW_down's tile, then dW_gate_up's
        tile = wg.wgrad_config(n, cuda, 1024.0, slot_order_l=slot_order_l)
        want = _both_dw(problem, tile, True, monkeypatch)
        got = _both_dw(problem, tile._replace(warp_specialize=True), True, monkeypatch)
        ran = dict(wg.LAST_WGRAD_WS)
        torch.cuda.synchronize()
        for gather_l, (g, _), (w, _) in zip((True, False), got, want):
            m_, n_ = (H, F) if gather_l else (2 * F, H)
            fits = m_ % tile.block_m == 0 and n_ % tile.block_n == 0
            assert ran[gather_l] == fits, (gather_l, tile, ran)
            assert torch.isfinite(g).all(), (gather_l, tile)
            assert (g[empty] == 0).all(), (gather_l, tile)
            assert torch.equal(g, w), (
                f"gather_l={gather_l} {tile[:6]}: max |diff| "
                f"{(g.float() - w.float()).abs().max().item():.3e}")


@pytest.mark.cuda
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon")
def test_cuda_warp_specialized_dw_replays_in_a_graph(monkeypatch):
    """Captured once, replayed on new values of the same routing: the replay's dW equals a
    fresh eager launch's."""
    case = SHAPES[4]
    _, T, k, E, H, F = case
    cuda = torch.device("cuda")
    x, dout, dy1, act, routes, _ = _problem(case, None, "cuda", torch.bfloat16, 128)
    tile = wg.wgrad_config(H, cuda, T * k / E, slot_order_l=True)._replace(
        warp_specialize=True)
    l_rows, r_rows = dy1.clone(), x.clone()
    out = torch.full((E, 2 * F, H), float("nan"), dtype=torch.bfloat16, device=cuda)
    wg.expert_wgrad(l_rows, r_rows, routes, out, False, True, tile)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wg.expert_wgrad(l_rows, r_rows, routes, out, False, True, tile)
    assert wg.LAST_WGRAD_WS[False]
    l_rows.copy_(dy1 * 0.5)
    r_rows.copy_(x.flip(1))
    graph.replay()
    want = torch.empty_like(out)
    wg.expert_wgrad(dy1 * 0.5, x.flip(1).contiguous(), routes, want, False, True,
                    tile._replace(warp_specialize=False))
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_the_warp_specialized_dw_takes_only_the_launches_it_fits():
    """`fits`: one operand gathered, 2-byte operands and dW, no accumulation, M and N whole
    tiles, 16-byte rows; the CPU never takes it (`available`)."""
    bf = torch.bfloat16
    l, r = torch.zeros(64, 512, dtype=bf), torch.zeros(64, 256, dtype=bf)
    out = torch.zeros(4, 512, 256, dtype=bf)
    assert ws.fits(l, r, out, True, False, 128, 256, 64, False)
    assert not ws.fits(l, r, out, True, True, 128, 256, 64, False)  # both gathered
    assert not ws.fits(l, r, out, False, False, 128, 256, 64, False)  # neither
    assert not ws.fits(l, r, out, True, False, 128, 256, 64, True)  # accumulate
    assert not ws.fits(l, r, torch.zeros(4, 384, 256, dtype=bf), True, False, 256, 256, 64,
                       False)  # M not a multiple of BLOCK_M
    assert not ws.fits(l.float(), r.float(), out.float(), True, False, 128, 256, 64, False)
    flat = torch.zeros(1 + out.numel(), dtype=bf)  # dW starting 2 bytes into its buffer
    assert not ws.fits(l, r, flat[1:].view(out.shape), True, False, 128, 256, 64, False)
    assert not ws.available(torch.device("cpu"))


def test_a_failed_gluon_launch_falls_back_once_and_is_remembered(monkeypatch):
    """gemm_launch.gluon_launch: a launch that raises is warned of once, not tried again for
    that key, and the caller told to run its Triton kernel; with FALLBACK_ON_ERROR off it
    raises."""
    monkeypatch.setattr(gl, "_FAILED_VARIANTS", {})
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("no such instruction")

    with pytest.warns(RuntimeWarning, match="warp-specialized kernel failed"):
        assert not gl.gluon_launch("wgrad", ("a",), broken)
    assert not gl.gluon_launch("wgrad", ("a",), broken)
    assert calls == [1]
    assert gl.gluon_launch("wgrad", ("b",), lambda: None)
    monkeypatch.setattr(gl, "FALLBACK_ON_ERROR", False)
    with pytest.raises(RuntimeError, match="no such instruction"):
        gl.gluon_launch("wgrad", ("c",), broken)


@pytest.mark.parametrize("fails", [False, True])
def test_expert_wgrad_takes_the_warp_specialized_kernel_where_asked(fails, monkeypatch):
    """On the CPU, with the GPU checks stubbed: a config asking for warp_specialize calls the
    Gluon launcher (here a stand-in that writes the Triton kernel's result, or raises), and a
    failure leaves the Triton kernel's values; a config that does not ask never calls it."""
    monkeypatch.setattr(gl, "_FAILED_VARIANTS", {})
    problem = _problem(CASES[1], None, "cpu", torch.float32, 16)
    want = _both_dw(problem, CPU_CFG, True, monkeypatch)
    calls = []

    def stand_in(l_rows, r_rows, slot_token, starts, counts, num_tokens, num_slots, out,
                 gather_l, *tile):
        calls.append(gather_l)
        if fails:
            raise RuntimeError("compile failed")
        out.copy_(want[0 if gather_l else 1][0])

    monkeypatch.setattr(ws, "available", lambda device: True)
    monkeypatch.setattr(ws, "fits", lambda *args: True)
    monkeypatch.setattr(ws, "expert_wgrad_ws", stand_in)
    _both_dw(problem, CPU_CFG, True, monkeypatch)  # not asked: never called
    assert calls == []
    if fails:
        with pytest.warns(RuntimeWarning):
            got = _both_dw(problem, CPU_CFG._replace(warp_specialize=True), True, monkeypatch)
    else:
        got = _both_dw(problem, CPU_CFG._replace(warp_specialize=True), True, monkeypatch)
    assert calls == [True, False]
    assert wg.LAST_WGRAD_WS == {True: not fails, False: not fails}
    for (g, _), (w, _) in zip(got, want):
        assert torch.equal(g, w)
