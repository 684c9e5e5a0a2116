"""kernels/wgrad.py's AdamW epilogue (`expert_wgrad(..., adamw=)`): the dW tiles update the
expert weights and their moments in place instead of being stored, with the same values as
the unfused path (dW stored, then kernels/adamw.adamw_step over it): bitwise, in fp32 under
the interpreter (both formula sets) and in bf16 on a GPU. Empty experts take an AdamW step
with a zero gradient, as the unfused path gives them."""

from __future__ import annotations

import pytest
import torch
from test_wgrad_variants import CASES, CPU_CFG, _problem

import moegraph_kernels.wgrad as wg
from moegraph_kernels.adamw import adamw_step, bias_correction_


def _optimizer_state(E, m, n, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(E, m, n, generator=gen).to(device, dtype)
    mom = (torch.randn(E, m, n, generator=gen) * 0.1).to(device, dtype)
    v = (torch.rand(E, m, n, generator=gen) * 0.01).to(device, dtype)
    return p, mom, v


def _device_scalars(device, step=3, lr=1e-3, beta1=0.9, beta2=0.95):
    lr_t = torch.tensor([lr], dtype=torch.float32, device=device)
    bias = torch.empty(5, dtype=torch.float64, device=device)
    bias_correction_(torch.tensor([step], device=device),
                     torch.tensor([beta1, beta2, 0.5], dtype=torch.float64, device=device),
                     torch.tensor([beta1, beta2, 0, 0], dtype=torch.float32, device=device),
                     bias)
    return lr_t, bias


def _both(problem, cfg, fused_math, device, dtype):
    x, dout, dy1, act, routes, (E, H, F) = problem
    lr, bias = _device_scalars(device)
    hp = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    hyper = wg.adamw_hyper(**hp, device=device)
    out = []
    for seed, (gather_l, (l_rows, r_rows, m, n)) in enumerate(
            ((True, (dout, act, H, F)), (False, (dy1, x, 2 * F, H)))):
        state = _optimizer_state(E, m, n, dtype, device, seed)
        ref = [t.clone() for t in state]
        g = torch.full_like(ref[0], float("nan"))
        wg.expert_wgrad(l_rows, r_rows, routes, g, gather_l, not gather_l, cfg)
        adamw_step(*(t.view(-1) for t in (ref[0], g, ref[1], ref[2])), lr, bias,
                   fused_math=fused_math, **hp)
        fused = [t.clone() for t in state]
        wg.expert_wgrad(l_rows, r_rows, routes, fused[0], gather_l, not gather_l, cfg,
                        adamw=wg.AdamWEpilogue(*fused, lr, bias, hyper, fused_math))
        out.append((fused, ref, state))
    return out


@pytest.mark.parametrize("fused_math", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_adamw_epilogue_is_the_unfused_update_bitwise(case, fused_math):
    problem = _problem(case, None, "cpu", torch.float32, 16)
    for fused, ref, before in _both(problem, CPU_CFG, fused_math, "cpu", torch.float32):
        for name, a, b, s in zip(("param", "exp_avg", "exp_avg_sq"), fused, ref, before):
            assert torch.equal(a, b), (name, (a - b).abs().max().item())
            assert not torch.equal(a, s), f"{name} was not updated"


def test_adamw_epilogue_rejects_accumulation_and_other_buffers():
    problem = _problem(CASES[2], None, "cpu", torch.float32, 16)
    x, dout, dy1, act, routes, (E, H, F) = problem
    p, m, v = _optimizer_state(E, H, F, torch.float32, "cpu", 0)
    lr, bias = _device_scalars("cpu")
    ep = wg.AdamWEpilogue(p, m, v, lr, bias, wg.adamw_hyper(0.9, 0.95, 1e-8, 0.0, "cpu"))
    with pytest.raises(ValueError, match="cannot accumulate"):
        wg.expert_wgrad(dout, act, routes, p, True, False, CPU_CFG, accumulate=True, adamw=ep)
    with pytest.raises(ValueError, match="must be adamw.p"):
        wg.expert_wgrad(dout, act, routes, p.clone(), True, False, CPU_CFG, adamw=ep)
    with pytest.raises(ValueError, match="exp_avg is"):
        wg.expert_wgrad(dout, act, routes, p, True, False, CPU_CFG,
                        adamw=ep._replace(m=m[:, :, :-1].contiguous()))


@pytest.mark.cuda
@pytest.mark.parametrize("case", [("zipf", 512, 4, 16, 512, 256),
                                  ("uniform", 1024, 8, 128, 2048, 768),
                                  ("sparse_experts", 2048, 8, 33, 1024, 384)],
                         ids=lambda c: "-".join(map(str, c)))
def test_cuda_adamw_epilogue_is_bitwise_the_unfused_update(case):
    kind, T, k, E, H, F = case
    from moegraph_kernels.gemm_config import route_block_m
    block = route_block_m(T * k, E, torch.device("cuda"))
    problem = _problem(case, None, "cuda", torch.bfloat16, block)
    for tile in (wg.wgrad_config(F, torch.device("cuda"), T * k / E),
                 wg.wgrad_config(H, torch.device("cuda"), T * k / E, slot_order_l=True)):
        for fused, ref, before in _both(problem, tile, None, "cuda", torch.bfloat16):
            torch.cuda.synchronize()
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), fused, ref):
                assert torch.equal(a, b), (name, tile, (a.float() - b.float()).abs().max())
