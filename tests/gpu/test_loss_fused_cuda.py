"""kernels/cross_entropy_fused.py on the GPU, bf16 at Qwen3's vocabulary: dlogits bitwise the
backward kernel's given the fused lse, at the default tile and each tuning knob; the loss read
from the logits before the row is overwritten; the scale kernel; the head with dlogits in the
forward against the two-kernel head. (The whole-step graph against eager, bitwise, with this
head: test_step_cuda.py.)"""

import pytest
import torch

from moegraph_cli.models.common.loss import linear_cross_entropy
from moegraph_kernels.cross_entropy import cross_entropy_backward, cross_entropy_forward
from moegraph_kernels.cross_entropy_fused import cross_entropy_fused_, scale_by_grad_

pytestmark = pytest.mark.cuda
V = 151936


def _logits(T, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(T, V, device="cuda", generator=gen) * 4).to(dtype)
    labels = torch.randint(0, V, (T,), device="cuda", generator=gen)
    labels[0], labels[1], labels[5] = V - 1, 0, -100
    logits[5] = float("nan")  # an ignored row: never read
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("knobs", [
    {}, {"reverse": False}, {"per_sm": 2}, {"evict_last": True},
    {"block_v": 4096, "num_warps": 8}, {"block_v": 2048, "num_warps": 4},
    {"stages": 4}, {"block_v": 4096, "num_warps": 8, "per_sm": 2, "stages": 3},
])
def test_fused_matches_backward_kernel_bitwise(knobs, dtype):
    logits, labels = _logits(300, dtype)
    n_valid = (labels != -100).sum()
    buf = logits.clone()
    lse, loss = cross_entropy_fused_(buf, labels, n_valid, **knobs)
    want = cross_entropy_backward(logits, labels, lse, torch.ones((), device="cuda"), n_valid)
    assert torch.equal(buf, want)
    assert not buf[5].any() and lse[5] == 0 and loss[5] == 0
    lse2, loss2 = cross_entropy_forward(logits, labels)
    torch.testing.assert_close(lse, lse2, rtol=0, atol=2e-5)
    # the label's logit was read before the row became dlogits (|dlogit| < 1 there)
    torch.testing.assert_close(loss, loss2, rtol=0, atol=2e-5)
    again = logits.clone()
    assert torch.equal(cross_entropy_fused_(again, labels, n_valid, **knobs)[0], lse)
    assert torch.equal(again, buf)  # deterministic


def test_scale_by_grad_bf16():
    x = torch.randn(3, 1 << 20, device="cuda").bfloat16()
    for g in (1.0, 0.3):
        y = x.clone()
        scale_by_grad_(y, torch.tensor(g, device="cuda"))
        assert torch.equal(y, x if g == 1.0 else (x.float() * g).bfloat16())


def test_head_with_dlogits_in_forward_matches_two_kernel_head():
    T, H, V_small = 2048, 512, 32000
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V_small, H, device="cuda", generator=gen) * 0.05).bfloat16()
    labels = torch.randint(0, V_small, (T,), device="cuda", generator=gen)
    labels[::9] = -100
    out = {}
    for fused in (False, True):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, logits = linear_cross_entropy(xa, wa, labels, inplace_backward=True,
                                            dlogits_in_forward=fused)
        assert (logits is None) == fused
        loss.backward()
        out[fused] = (loss.detach(), xa.grad, wa.grad)
    (l0, dx0, dw0), (l1, dx1, dw1) = out[False], out[True]
    assert abs(l1.item() - l0.item()) <= 1e-5 * abs(l0.item())
    for name, a, b in (("dx", dx1, dx0), ("dw", dw1, dw0)):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 1e-2 * b.float().abs().max().item(), f"{name}: {err}"
