"""moegraph_cli/matmul.py: 16-bit products on the CPU from fp32 copies, one rounding; torch's
own ops everywhere else. The model's training step on the CPU in bf16 runs no 16-bit GEMM
(torch's CPU bf16 GEMMs ran 5-180x slower than fp32 on an AVX2 host: the lm head's dx alone
took 49 s a step on the built-in default, benchmarks/results/cpu_gemm.json)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moegraph_cli import grads, matmul
from moegraph_cli.models import MoeCausalLM

GEMMS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm")
SMALL = ["model.vocab_size=128", "model.hidden_size=64", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=16", "model.moe_intermediate_size=32"]


class _HalfGemms(TorchDispatchMode):
    """Records every aten GEMM that gets a 16-bit float operand."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name in GEMMS and any(isinstance(a, torch.Tensor) and a.dtype in matmul.HALF
                                 for a in args):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(33, 64, generator=g).to(dtype)
    b = torch.randn(64, 17, generator=g).to(dtype)
    c = torch.randn(33, 17, generator=g).to(dtype)
    return a, b, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_products_on_the_cpu_are_the_fp32_product_rounded_once(dtype):
    a, b, c = _operands(dtype)
    exact = a.float() @ b.float()
    with _HalfGemms() as mode:
        assert torch.equal(matmul.matmul(a, b), exact.to(dtype))
        assert torch.equal(matmul.linear(a, b.t(), c[0, :]), (exact + c[0].float()).to(dtype))
        out = torch.full_like(c, float("nan"))
        assert matmul.mm_out(a, b, out) is out and torch.equal(out, exact.to(dtype))
        acc = c.clone()
        assert matmul.addmm_(acc, a, b) is acc
        assert torch.equal(acc, (c.float() + exact).to(dtype))
    assert mode.seen == []
    assert matmul.matmul(a, b).dtype == dtype


def test_other_dtypes_are_torch_own_ops():
    a, b, c = _operands(torch.float32)
    assert torch.equal(matmul.matmul(a, b), a @ b)
    assert torch.equal(matmul.linear(a, b.t(), c[0]), F.linear(a, b.t(), c[0]))
    out = torch.empty_like(c)
    assert torch.equal(matmul.mm_out(a, b, out), torch.mm(a, b))
    assert torch.equal(matmul.addmm_(c.clone(), a, b), c.clone().addmm_(a, b))
    assert not matmul.through_fp32(a.double())


def test_linear_is_differentiable_in_every_operand():
    a, b, c = _operands(torch.bfloat16)
    x, w, bias = (t.clone().requires_grad_() for t in (a, b.t().contiguous(), c[0].clone()))
    matmul.linear(x, w, bias).float().square().sum().backward()
    xf, wf, bf = (t.detach().float().requires_grad_() for t in (x, w, bias))
    y = F.linear(xf, wf, bf).to(torch.bfloat16).float()
    y.square().sum().backward()
    for got, want in ((x, xf), (w, wf), (bias, bf)):
        assert got.grad.dtype == torch.bfloat16
        assert torch.equal(got.grad, want.grad.to(torch.bfloat16))


@pytest.mark.parametrize("profile", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe",
                                     "tiny-qwen2-moe"])
@pytest.mark.parametrize("as_sinks", [False, True])
def test_a_bf16_training_step_on_the_cpu_runs_no_half_gemm(profile, as_sinks):
    """Forward and backward, with autograd's gradients and with every parameter a sink
    (grads.py: the trainers' written, then accumulated, gradients)."""
    model = MoeCausalLM.from_profile(profile, dtype=torch.bfloat16, overrides=SMALL)
    if as_sinks:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
            grads.sink(p)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with _HalfGemms() as mode:
        for accumulate in (False, True):
            with grads.backward_pass(accumulate):
                model(ids, labels=ids, keep_logits=False).loss.backward()
    assert mode.seen == [], sorted(set(mode.seen))
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 and p.grad.isfinite().all()
               for p in model.parameters() if p.requires_grad)


def test_the_cpu_gemm_benchmark_runs(tmp_path, monkeypatch):
    """benchmarks/cpu_gemm.py at a small shape, without its verify run: one record a product,
    each with both timings."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import cpu_gemm
    out = tmp_path / "cpu_gemm.json"
    monkeypatch.setattr(sys, "argv", ["cpu_gemm.py", "--tokens", "16", "--vocab", "64",
                                      "--repeats", "1", "--no-verify", "--out", str(out)])
    cpu_gemm.main()
    doc = json.loads(out.read_text())
    assert doc["gpu"] is None and "verify" not in doc
    assert [r["product"] for r in doc["records"]] == [
        "lm_head_fwd", "lm_head_dx", "lm_head_dW", "proj_fwd", "proj_dx", "proj_dW"]
    assert all(r["bf16_torch_s"] > 0 and r["fp32_copies_s"] > 0 for r in doc["records"])
