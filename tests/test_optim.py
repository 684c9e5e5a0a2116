"""FlatAdamW against torch.optim.AdamW(foreach=False), bitwise in fp32 on CPU.

Two paths: the Triton kernel (under the interpreter) and the pure-torch reference. torch's CPU
`sqrt` is MKL's vsSqrt, which is not IEEE-rounded (about 1 value in 5 is 1 ulp off on an AVX512
host); the kernel uses the IEEE sqrt, so its parameters are compared with torch run under an
IEEE sqrt (`IEEESqrt`), and its exp_avg / exp_avg_sq (which never see the sqrt) with plain
torch. The reference path is compared with plain torch throughout.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from moegraph_cli.train.optim import ALIGN, FlatAdamW
from moegraph_kernels.adamw import adamw_step, bias_correction_, interpreting

SHAPES = [(1,), (7,), (33,), (1000,), (20, 13), (4, 1, 9)]
IMPLS = [pytest.param("triton", marks=pytest.mark.skipif(
    not interpreting(), reason="the kernel on CPU needs TRITON_INTERPRET=1")), "reference"]


class IEEESqrt(TorchFunctionMode):
    """torch with its CPU sqrt replaced by the correctly rounded one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.sqrt, torch.sqrt):
            return torch.from_numpy(np.sqrt(args[0].numpy()))
        return func(*args, **(kwargs or {}))


def _values(shape, gen, zero_frac=0.05):
    """Signs, magnitudes from 1e-20 to 1e5, some exact zeros."""
    n = int(np.prod(shape))
    mag = 10.0 ** (torch.rand(n, generator=gen, dtype=torch.float64) * 25 - 20)
    sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    x = (mag * sign).float()
    x[torch.rand(n, generator=gen) < zero_frac] = 0
    return x.view(shape)


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def _assert_bitwise(got, want, what):
    bad = (_bits(got) != _bits(want)).sum().item()
    assert bad == 0, f"{what}: {bad} of {got.numel()} elements differ"


def _run_pair(impl, lrs, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, seed=0,
              ieee_sqrt=None):
    """FlatAdamW(impl) and torch.optim.AdamW(foreach=False) stepped with the same gradients,
    one step per lr in `lrs` (set between steps); torch runs under `IEEESqrt` when ieee_sqrt
    (default: for the kernel). After each step yields (initial values, FlatAdamW's params,
    FlatAdamW, torch's params, torch's optimizer)."""
    gen = torch.Generator().manual_seed(seed)
    init = [_values(s, gen) for s in SHAPES]
    mine = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    ieee_sqrt = impl == "triton" if ieee_sqrt is None else ieee_sqrt
    opt = FlatAdamW(mine, lr=lrs[0], betas=betas, eps=eps, weight_decay=weight_decay, impl=impl)
    ref_opt = torch.optim.AdamW(ref, lr=lrs[0], betas=betas, eps=eps,
                                weight_decay=weight_decay, foreach=False)
    for lr in lrs:
        opt.set_lr(lr)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        for p, r in zip(mine, ref):
            g = _values(p.shape, gen)
            p.grad.copy_(g)
            r.grad = g.clone()
        opt.step()
        if ieee_sqrt:
            with IEEESqrt():
                ref_opt.step()
        else:
            ref_opt.step()
        yield init, mine, opt, ref, ref_opt


CONFIGS = {
    "plain": dict(lrs=[1e-3] * 5),
    "weight_decay": dict(lrs=[3e-3] * 5, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    "big_lerp_weight": dict(lrs=[1e-2] * 4, betas=(0.3, 0.9), weight_decay=0.01),
    "lr_schedule": dict(lrs=[1e-3, 5e-4, 2e-3, 0.0, 1e-3], weight_decay=0.05),
}


def _assert_matches(opt, mine, ref, ref_opt, what, params=True):
    group = opt.groups[0]
    for i, (p, r) in enumerate(zip(mine, ref)):
        sl = slice(group.offsets[i], group.offsets[i] + p.numel())
        state = ref_opt.state[r]
        if params:
            _assert_bitwise(p, r, f"{what}: param {i}")
        _assert_bitwise(group.exp_avg[sl], state["exp_avg"].view(-1), f"{what}: exp_avg {i}")
        _assert_bitwise(group.exp_avg_sq[sl], state["exp_avg_sq"].view(-1),
                        f"{what}: exp_avg_sq {i}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bitwise_torch_adamw_every_step(impl, config):
    for step, (_, mine, opt, ref, ref_opt) in enumerate(_run_pair(impl, **CONFIGS[config]), 1):
        _assert_matches(opt, mine, ref, ref_opt, f"step {step}")
        assert int(opt.step_count) == step


@pytest.mark.parametrize("impl", IMPLS)
def test_lr_zero_keeps_params_and_updates_states(impl):
    for init, mine, opt, ref, ref_opt in _run_pair(impl, [0.0] * 3, weight_decay=0.1):
        _assert_matches(opt, mine, ref, ref_opt, "lr 0")
        for i, (p, p0) in enumerate(zip(mine, init)):
            _assert_bitwise(p, p0, f"param {i} at lr 0")
    assert (opt.groups[0].exp_avg != 0).any() and (opt.groups[0].exp_avg_sq != 0).any()


@pytest.mark.skipif(not interpreting(), reason="the kernel on CPU needs TRITON_INTERPRET=1")
def test_kernel_differs_from_plain_torch_only_through_sqrt():
    """Against torch with its own (MKL) sqrt: the states, which never see the sqrt, bitwise;
    the params within an ulp-sized share of the update (denom is 1 ulp off at most)."""
    lr = 1e-3
    for _, mine, opt, ref, ref_opt in _run_pair("triton", [lr] * 3, weight_decay=0.01, seed=3,
                                                 ieee_sqrt=False):
        _assert_matches(opt, mine, ref, ref_opt, "plain torch", params=False)
        for p, r in zip(mine, ref):
            torch.testing.assert_close(p, r, rtol=2**-22, atol=lr * 2**-20)


def _fma32(a, b, c):
    """Correctly rounded fp32 a * b + c, elementwise, in exact rational arithmetic."""
    out = []
    for x, y, z in zip(a.tolist(), b.tolist(), c.tolist()):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        guess = np.float32(float(exact))
        near = [guess, np.nextafter(guess, np.float32(np.inf)),
                np.nextafter(guess, np.float32(-np.inf))]
        out.append(min(near, key=lambda f: (abs(Fraction(float(f)) - exact),
                                            int(np.array(f).view(np.int32)) & 1)))
    return torch.from_numpy(np.array(out, dtype=np.float32))


def _fused_formulas(p, g, m, v, lr, betas, eps, weight_decay, step):
    """torch's fused CUDA AdamW (2.11) on fp32 CPU tensors: its double expressions in fp64, its
    float ones in fp32, exact fmas, an IEEE sqrt."""
    b1, b2 = (torch.full_like(g, beta) for beta in betas)
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    if weight_decay != 0:
        p64 = p.double()
        p = (p64 - (lr * weight_decay) * p64).float()
    g2 = g * g
    m = _fma32(b1, m, _fma32(-b1, g, g))
    v = _fma32(b2, v, _fma32(-b2, g2, g2))
    bc1, bc2 = (1 - torch.pow(torch.tensor(betas), torch.tensor([step]))).tolist()  # fp32 powf
    step_size = f32(f32(lr) / bc1)
    bc2_sqrt = f32(math.sqrt(bc2))  # correctly rounded, as sqrtf
    denom = ((torch.from_numpy(np.sqrt(v.numpy())) / bc2_sqrt).double() + eps).float()
    return p - step_size * m / denom, m, v


@pytest.mark.skipif(not interpreting(), reason="the kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_kernel_fused_formulas_bitwise(weight_decay):
    """The bf16 / fp16 formulas (torch's fused CUDA ones), run here on fp32 buffers."""
    gen = torch.Generator().manual_seed(6)
    n, lr, betas, eps = 600, 2e-3, (0.9, 0.95), 1e-8
    p, m, v = (_values((n,), gen) for _ in range(3))
    v = v.abs()
    bufs = [p.clone(), None, m.clone(), v.clone()]
    consts = torch.tensor([*betas, 0.5], dtype=torch.float64)
    consts32 = torch.tensor([*betas, 0.0, 0.0])
    bias = torch.empty(5, dtype=torch.float64)
    lr_t = torch.tensor([lr], dtype=torch.float64)
    for step in range(1, 4):
        g = _values((n,), gen)
        bufs[1] = g
        bias_correction_(torch.tensor([step]), consts, consts32, bias)
        adamw_step(*bufs, lr_t, bias, *betas, eps, weight_decay, fused_math=True)
        p, m, v = _fused_formulas(p, g, m, v, lr, betas, eps, weight_decay, float(step))
        for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), bufs[::2] + bufs[3:],
                                   (p, m, v)):
            _assert_bitwise(got, want, f"step {step} {name}")


@pytest.mark.parametrize("impl", IMPLS)
def test_params_and_grads_are_views_of_the_flat_buffers(impl):
    gen = torch.Generator().manual_seed(1)
    init = [_values(s, gen) for s in SHAPES]
    params = [p.clone().requires_grad_() for p in init]
    params[2].grad = torch.full_like(params[2], 3.0)  # an existing .grad is kept
    opt = FlatAdamW(params, lr=1e-3, impl=impl)
    (group,) = opt.groups
    assert opt.flat_buffers() == group.buffers()
    for i, (p, p0) in enumerate(zip(params, init)):
        off = group.offsets[i]
        assert off % ALIGN == 0
        assert p.data_ptr() == group.param.data_ptr() + off * 4
        assert p.grad.data_ptr() == group.grad.data_ptr() + off * 4
        _assert_bitwise(p, p0, "packed value")
        assert p.is_contiguous() and p.grad.is_contiguous() and p.grad.shape == p.shape
    assert (params[2].grad == 3).all() and (params[1].grad == 0).all()

    params[3].grad.copy_(torch.arange(1000.0))  # writing .grad writes the flat buffer
    off = group.offsets[3]
    assert torch.equal(group.grad[off:off + 1000], torch.arange(1000.0))
    grad_before = group.grad.clone()
    opt.step()
    _assert_bitwise(group.grad, grad_before, "grad after step (step must only read it)")
    assert group.param.data_ptr() == params[0].data_ptr()  # step re-points nothing

    # state_bytes: grad + exp_avg + exp_avg_sq, fp32, padding included
    padded = sum(-(-p.numel() // ALIGN) * ALIGN for p in params)
    assert group.param.numel() == padded
    assert opt.state_bytes() == 3 * 4 * padded


def _padding_mask(group):
    mask = torch.ones(group.param.numel(), dtype=torch.bool)
    for p, off in zip(group.params, group.offsets):
        mask[off:off + p.numel()] = False
    return mask


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_grad_and_nan_padding_stay_put(impl):
    """A NaN in one parameter's gradient, and NaN in the padding of every buffer, reach no
    other parameter: the others are bitwise what they are without any NaN."""
    gen = torch.Generator().manual_seed(2)
    init = [_values(s, gen) for s in SHAPES]
    grads = [_values(s, gen) for s in SHAPES]
    runs = []
    for poison in (False, True):
        params = [p.clone().requires_grad_() for p in init]
        opt = FlatAdamW(params, lr=1e-3, weight_decay=0.01, impl=impl)
        (group,) = opt.groups
        pad = _padding_mask(group)
        assert pad.any()
        for p, g in zip(params, grads):
            p.grad.copy_(g)
        if poison:
            for buf in group.buffers():
                buf[pad] = float("nan")
            params[3].grad[17] = float("nan")
        for _ in range(2):
            opt.step()
        runs.append(params)
    clean, poisoned = runs
    for i, (c, p) in enumerate(zip(clean, poisoned)):
        if i != 3:
            assert torch.isfinite(p).all(), f"param {i} got a NaN"
            _assert_bitwise(p, c, f"param {i}")
    assert torch.isnan(poisoned[3].view(-1)[17])
    others = torch.ones(1000, dtype=torch.bool)
    others[17] = False
    _assert_bitwise(poisoned[3].view(-1)[others], clean[3].view(-1)[others], "param 3 others")


def test_reference_path_bitwise_in_bf16():
    """The pure-torch path is torch's op sequence in any dtype (bf16 here)."""
    gen = torch.Generator().manual_seed(4)
    init = [_values(s, gen).clamp(-1e3, 1e3).bfloat16() for s in SHAPES]
    mine = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = FlatAdamW(mine, lr=1e-2, weight_decay=0.1, impl="reference")
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for p, r in zip(mine, ref):
            p.grad.copy_(_values(p.shape, gen).bfloat16())
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(mine, ref):
        assert torch.equal(p.view(torch.int16), r.detach().view(torch.int16))


def test_groups_by_dtype_and_rejects_bad_params():
    a = torch.zeros(5, requires_grad=True)
    b = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = FlatAdamW([a, b, a], lr=1e-3, impl="reference")
    assert [g.param.dtype for g in opt.groups] == [torch.float32, torch.float64]
    assert opt.groups[0].params == [a]
    lr_ptr = opt.lr.data_ptr()
    opt.set_lr(0.5)
    assert opt.lr.data_ptr() == lr_ptr and opt.lr.item() == 0.5
    with pytest.raises(ValueError, match="does not require grad"):
        FlatAdamW([torch.zeros(2)], lr=1e-3)
    with pytest.raises(TypeError, match="parameter groups"):
        FlatAdamW([{"params": [a]}], lr=1e-3)
    with pytest.raises(ValueError, match="impl must be one of"):
        FlatAdamW([a], lr=1e-3, impl="fused")


def _ulps_bf16(a, b):
    """|a - b| in bf16 ulps (ordered bit patterns, so +0 == -0 and signs cross correctly)."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


@pytest.mark.cuda
@pytest.mark.parametrize("shapes", [[(128, 2048), (4096,)], [(100_000_000,)]])
def test_cuda_bf16_within_one_ulp_of_fused(shapes):
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = [torch.randn(s, device="cuda", generator=gen).bfloat16() * 0.02 for s in shapes]
    mine = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = FlatAdamW(mine, lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, fused=True)
    for _ in range(3):
        for p, r in zip(mine, ref):
            g = torch.randn(p.shape, device="cuda", generator=gen).bfloat16()
            p.grad.copy_(g)
            r.grad = g.clone()
        opt.step()
        ref_opt.step()
    group = opt.groups[0]
    for i, (p, r) in enumerate(zip(mine, ref)):
        sl = slice(group.offsets[i], group.offsets[i] + p.numel())
        state = ref_opt.state[r]
        worst = {name: (d.max().item(), (d != 0).sum().item()) for name, d in (
            ("param", _ulps_bf16(p.detach(), r.detach())),
            ("exp_avg", _ulps_bf16(group.exp_avg[sl], state["exp_avg"].view(-1))),
            ("exp_avg_sq", _ulps_bf16(group.exp_avg_sq[sl], state["exp_avg_sq"].view(-1))))}
        assert max(most for most, _ in worst.values()) <= 1, \
            f"tensor {i} {list(p.shape)}: (max ulps, elements differing) {worst}"


@pytest.mark.cuda
def test_cuda_fp32_bitwise_cpu_and_graph_replay_reads_new_lr():
    """fp32 on the GPU gives the interpreter's bits (torch on CPU with an IEEE sqrt), and a
    captured step replays with the lr written after capture."""
    gen = torch.Generator().manual_seed(5)
    init = [_values(s, gen) for s in SHAPES]
    grads = [[_values(s, gen) for s in SHAPES] for _ in range(4)]
    lrs = [1e-3, 2e-3, 5e-4, 1e-3]
    ref = [p.clone().requires_grad_() for p in init]
    ref_opt = torch.optim.AdamW(ref, lr=lrs[0], weight_decay=0.1, foreach=False)
    mine = [p.cuda().requires_grad_() for p in init]
    opt = FlatAdamW(mine, lr=lrs[0], weight_decay=0.1)
    graph = None
    for step, (lr, gs) in enumerate(zip(lrs, grads)):
        for p, r, g in zip(mine, ref, gs):
            p.grad.copy_(g)
            r.grad = g.clone()
        for group in ref_opt.param_groups:
            group["lr"] = lr
        with IEEESqrt():
            ref_opt.step()
        opt.set_lr(lr)
        if step < 2:
            opt.step()
        else:
            if graph is None:  # capturing records the step without running it
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    opt.step()
            graph.replay()
        torch.cuda.synchronize()
        for i, (p, r) in enumerate(zip(mine, ref)):
            _assert_bitwise(p.cpu(), r, f"step {step} param {i}")
