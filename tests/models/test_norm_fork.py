"""The MoE layer's post norm handing the router and the experts each its own output, with the
norm's backward kernel summing their gradients (MOEGRAPH_NORM_FORK, on by default), changes no
number: losses and every gradient of two training steps bit for bit with autograd's add, on the
norm kernels (Triton interpreter, fp32; bf16 on a GPU) with the permute-free and the reference
experts, and with a shared expert (which keeps the norm's one output)."""

from __future__ import annotations

import pytest
import torch

from moegraph_cli import models
from moegraph_cli.models.common import fused
from moegraph_cli.train.harness import GraphTrainer
from moegraph_cli.train.trainer import batches

from family_checks import SMALL


def _steps(profile, overrides, device="cpu", dtype=torch.float32, steps=2):
    torch.manual_seed(0)
    model = models.from_profile(profile, dtype=dtype, device=device,
                                overrides=[*SMALL, *overrides])
    trainer = GraphTrainer(model, lr=1e-2)
    out = []
    for s in range(steps):
        loss = trainer.step(next(batches(128, 2, 16, 1 + s, device)))
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def _fork_on_off(profile, overrides, monkeypatch, **kw):
    calls = []
    real = fused.rms_norm_fork
    monkeypatch.setattr(fused, "rms_norm_fork",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    monkeypatch.setattr(fused, "NORM_FORK", True)
    forked = _steps(profile, overrides, **kw)
    ran = bool(calls)
    calls.clear()
    monkeypatch.setattr(fused, "NORM_FORK", False)
    plain = _steps(profile, overrides, **kw)
    assert not calls
    for (la, ga), (lb, gb) in zip(forked, plain):
        assert la == lb
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name
    return ran


@pytest.mark.parametrize("profile,overrides,forks", [
    ("tiny-qwen3-moe", ["moe.backend=permute_free"], True),
    ("tiny-qwen3-moe", [], True),
    ("tiny-gpt-oss", [], True),
    ("tiny-qwen2-moe", ["model.shared_expert_intermediate_size=20"], False),
], ids=["permute_free", "reference", "topk_softmax_router", "shared_expert"])
def test_forked_norm_is_bitwise_autograds_add(profile, overrides, forks, monkeypatch):
    monkeypatch.setattr(fused, "ON_CPU", True)
    assert _fork_on_off(profile, overrides, monkeypatch) == forks


@pytest.mark.cuda
@pytest.mark.parametrize("profile", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-mixtral"])
def test_cuda_bf16_forked_norm_is_bitwise_autograds_add(profile, monkeypatch):
    """bf16 on the GPU, where the sum of the two gradients rounds: the same bits either way."""
    assert _fork_on_off(profile, [], monkeypatch, device="cuda", dtype=torch.bfloat16)
