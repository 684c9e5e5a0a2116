"""The gated activation's FAST path (kernels/gated_act.py) against its plain one.

FAST drops the range fix-ups of Triton's fp32 exp and division. The claim: the same bits for
every gate input x with 1 + exp(-x) <= 2**126 (x >= -87.33; alpha * min(g, limit) for the
clamped SwiGLU), and below that the sigmoid and silu flush to zero where the plain path gives
values under 1e-35. The CUDA test runs both paths over every bf16 gate value and a sweep of
the edge, elementwise; the CPU tests pin the config plumbing (the interpreter has no inline
assembly, so CPU launches always take the plain path).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import moegraph_kernels.gemm_config as gc
from moegraph_kernels.fp_fusion import FUSED
from moegraph_kernels.gated_act import gated_backward, gated_forward

ALPHA, LIMIT = 1.702, 7.0  # GPT-OSS's clamped SwiGLU
EDGE = -87.33  # below: 1 + exp(-x) > 2**126 may hold


@triton.jit
def _act_kernel(g_ptr, u_ptr, da_ptr, out_ptr, n, alpha, limit, CLAMPED: tl.constexpr,
                FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0)[:, None]
    u = tl.load(u_ptr + offs, mask=ok, other=0.0)[:, None]
    da = tl.load(da_ptr + offs, mask=ok, other=0.0)[:, None]
    p = tl.full((BLOCK, 1), 0.75, tl.float32)
    act = gated_forward(g, u, p, alpha, limit, CLAMPED, FAST)
    dg, du, dp = gated_backward(da, g, u, p, alpha, limit, CLAMPED, FAST)
    tl.store(out_ptr + offs, tl.reshape(act, (BLOCK,)), mask=ok)
    tl.store(out_ptr + n + offs, tl.reshape(dg, (BLOCK,)), mask=ok)
    tl.store(out_ptr + 2 * n + offs, tl.reshape(du, (BLOCK,)), mask=ok)
    tl.store(out_ptr + 3 * n + offs, dp, mask=ok)


def _run(g, u, da, clamped: bool, fast: bool) -> torch.Tensor:
    n = g.numel()
    out = torch.full((4, n), float("nan"), device=g.device)
    _act_kernel[(triton.cdiv(n, 256),)](g, u, da, out, n, ALPHA, LIMIT, CLAMPED=clamped,
                                        FAST=fast, BLOCK=256, enable_fp_fusion=FUSED)
    return out


def test_fast_act_is_a_config_variant_on_by_default():
    cfg = gc.GemmConfig(128, 128, 64, 8, 8, 3)
    assert cfg.fast_act and cfg.variant == "base"
    exact = cfg.with_variant("tma+exact")
    assert not exact.fast_act and exact.variant == "tma+exact"
    assert exact.with_variant(exact.variant) == exact
    assert gc.dact_config(768, 128, torch.device("cuda")).fast_act
    assert gc.fc1_config(768, 128, torch.device("cuda")).fast_act


def test_interpreter_launches_take_the_plain_path():
    """fc1 / dact on the CPU give the same values whatever fast_act says (no inline asm
    there): the launchers pass FAST only for CUDA tensors."""
    from routing_cases import moe_inputs

    from moegraph_cli.moe.experts import build_routes
    from moegraph_kernels.dact_swiglu import dact_swiglu, dp_tiles
    from moegraph_kernels.fc1_swiglu import fc1_swiglu
    x, ids, w, w_gate_up, w_down, dout = moe_inputs("zipf", 24, 2, 5, 32, 32, seed=3)
    routes = build_routes(ids, w, 5, 16, None)
    S, F = routes.num_slots, 32
    outs = []
    for fast in (True, False):
        cfg = gc.GemmConfig(16, 32, 32, 4, 4, 1, fast_act=fast)
        y1, act = torch.zeros(S, 2 * F), torch.zeros(S, F)
        fc1_swiglu(x, w_gate_up, w.reshape(-1), routes, y1, act, cfg)
        dy1, act2, dp = torch.zeros(S, 2 * F), torch.zeros(S, F), torch.zeros(S, dp_tiles(F, cfg))
        dact_swiglu(dout, w_down, y1, w.reshape(-1), routes, dy1, act2, dp, cfg)
        outs.append((y1, act, dy1, act2, dp))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("clamped", [False, True])
def test_cuda_fast_path_is_bitwise_the_plain_one_above_the_edge(clamped):
    # Every finite bf16 value as the gate (the stored Y1 is bf16), then a dense fp32 sweep
    # across the edge, infinities and NaN; u and dA from a fixed draw.
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    every_bf16 = bits.view(torch.bfloat16).float()
    sweep = torch.linspace(-100.0, 100.0, 200_001)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40,
                            -1e-40, EDGE, EDGE - 1e-3, -88.72, -88.73, -89.0])
    g = torch.cat([every_bf16, sweep, special]).cuda()
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(g.numel(), generator=gen).cuda() * 3
    da = torch.randn(g.numel(), generator=gen).cuda()
    fast, plain = _run(g, u, da, clamped, True), _run(g, u, da, clamped, False)
    torch.cuda.synchronize()
    x = ALPHA * torch.clamp(g, max=LIMIT) if clamped else g
    above = ~(x < EDGE)  # NaN counts as above: both paths must give the same NaN
    for row, name in enumerate(("act", "dg", "du", "dp")):
        f, p = fast[row], plain[row]
        same = (f == p) | (torch.isnan(f) & torch.isnan(p))
        bad = above & ~same
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} elements differ above the edge, first at gate "
            f"{g[bad][0].item()!r}: fast {f[bad][0].item()!r} plain {p[bad][0].item()!r}")
        below = ~above
        assert torch.equal(torch.isfinite(f[below]), torch.isfinite(p[below])), name
        fin = torch.isfinite(p[below])
        assert (f[below][fin] - p[below][fin]).abs().max().item() <= 1e-30, name
