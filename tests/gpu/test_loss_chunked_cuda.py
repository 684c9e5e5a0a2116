"""The loss-only head in row chunks on the GPU (bf16, Triton kernels): close to the whole
head, holding less memory than the whole head's logits. (The whole-step graph with it
against eager, bitwise: test_step_cuda.py.)"""

import pytest
import torch

from moegraph_cli.models.common.loss import linear_cross_entropy
from moegraph_cli.models.common.loss_chunked import chunked_linear_cross_entropy

pytestmark = pytest.mark.cuda


def test_chunked_head_close_to_whole_and_smaller():
    T, V, H = 4096, 32000, 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.05).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=gen)
    labels[::7] = -100
    out = {}
    for rows in (0, 1024):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if rows:
            loss = chunked_linear_cross_entropy(xa, wa, labels, rows, use_triton=True)
        else:
            loss, _ = linear_cross_entropy(xa, wa, labels, inplace_backward=True)
        loss.backward()
        torch.cuda.synchronize()
        out[rows] = (loss.detach(), xa.grad, wa.grad, torch.cuda.max_memory_allocated() - base)
    (l0, dx0, dw0, peak0), (l1, dx1, dw1, peak1) = out[0], out[1024]
    assert abs(l1.item() - l0.item()) < 1e-4 * abs(l0.item())
    for name, a, b in (("dx", dx1, dx0), ("dw", dw1, dw0)):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * b.float().abs().max().item(), f"{name}: {err}"
    assert peak1 < peak0 - T * V  # at least half the whole head's bf16 logits saved
