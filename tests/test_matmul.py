"""moegraph_cli/matmul.py: 16-bit products on the CPU from fp32 copies, one rounding; torch's
own ops everywhere else. The model's training step on the CPU in bf16 runs no 16-bit GEMM
(torch's CPU bf16 GEMMs ran 5-180x slower than fp32 on an AVX2 host: the lm head's dx alone
took 49 s a step on the built-in default, benchmarks/results/cpu_gemm.json)."""

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from moegraph_cli import grads, matmul
from moegraph_cli.models import MoeCausalLM

GEMMS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm")
SMALL = ["model.vocab_size=128", "model.hidden_size=64", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=16", "model.moe_intermediate_size=32"]


@contextlib.contextmanager
def _half_gemms():
    """Yields a list that, after the block, names every aten GEMM the block ran with a 16-bit
    float operand (the profiler's recorded input dtypes). They are read from the profiler's
    own event records: its FunctionEvent carries them (`input_dtypes`) only from torch 2.13
    on, the records' `dtypes()` on 2.11 too."""
    seen = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield seen
    seen += [e.name() for e in prof.profiler.kineto_results.events()
             if e.name().split("::")[-1].rstrip("_") in GEMMS
             and any(t in ("c10::BFloat16", "c10::Half") for t in e.dtypes())]


def test_the_recorder_sees_a_half_gemm():
    a = torch.ones(4, 4, dtype=torch.bfloat16)
    with _half_gemms() as seen:
        a @ a, torch.addmm(a, a, a)
    assert {"aten::mm", "aten::addmm"} <= set(seen)
    w = torch.ones(4, 4, dtype=torch.bfloat16, requires_grad=True)
    loss = (a @ w).float().sum()
    with _half_gemms() as seen:  # the backward's GEMM, run by autograd's engine
        loss.backward()
    assert "aten::mm" in seen


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
    with _half_gemms() as seen:
        assert torch.equal(matmul.matmul(a, b), exact.to(dtype))
        assert torch.equal(matmul.linear(a, b.t(), c[0, :]), (exact + c[0].float()).to(dtype))
        out = torch.full_like(c, float("nan"))
        assert matmul.mm_out(a, b, out) is out and torch.equal(out, exact.to(dtype))
        acc = c.clone()
        assert matmul.addmm_(acc, a, b) is acc
        assert torch.equal(acc, (c.float() + exact).to(dtype))
    assert seen == []
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


# MLA's own head sizes (tests/models/test_deepseek_v3.py's, without the yarn scaling).
MLA = ["model.num_key_value_heads=4", "model.head_dim=4", "model.qk_rope_head_dim=4",
       "model.qk_nope_head_dim=8", "model.v_head_dim=6", "model.q_lora_rank=12",
       "model.kv_lora_rank=10", "model.max_position_embeddings=256"]


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe",
                                    "tiny-qwen2-moe", "tiny-deepseek-v3", "tiny-gpt-oss"])
def test_a_bf16_training_step_on_the_cpu_runs_no_half_gemm(family):
    """Forward and backward with autograd's gradients, then with every parameter a sink
    (grads.py: the trainers' gradients, written and then accumulated)."""
    extra = MLA if family == "tiny-deepseek-v3" else []
    model = MoeCausalLM.from_profile(family, dtype=torch.bfloat16, overrides=[*SMALL, *extra])
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with _half_gemms() as seen:
        model(ids, labels=ids, keep_logits=False).loss.backward()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
            grads.sink(p)
        for accumulate in (False, True):
            with grads.backward_pass(accumulate):
                model(ids, labels=ids, keep_logits=False).loss.backward()
    assert seen == [], sorted(set(seen))
    assert all(p.grad.dtype == torch.bfloat16 and p.grad.isfinite().all()
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
