"""The MoE layer's residual add inside the experts' combine (MOEGRAPH_COMBINE_RESIDUAL, on by
default) changes no number: losses and every gradient of two training steps bit for bit with
the add after the experts, on the permute-free experts (Triton interpreter, fp32) and the
reference ones, with and without a shared expert (which keeps the add outside)."""

from __future__ import annotations

import pytest
import torch

from moegraph_cli import models
from moegraph_kernels import combine
from moegraph_cli.models.common import ffn
from moegraph_cli.train.harness import GraphTrainer
from moegraph_cli.train.trainer import batches

from family_checks import SMALL


def _steps(profile, overrides, steps=2):
    torch.manual_seed(0)
    model = models.from_profile(profile, dtype=torch.float32, overrides=[*SMALL, *overrides])
    trainer = GraphTrainer(model, lr=1e-2)
    out = []
    for s in range(steps):
        loss = trainer.step(next(batches(128, 2, 16, 1 + s, "cpu")))
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


@pytest.mark.parametrize("profile,overrides", [
    ("tiny-qwen3-moe", ["moe.backend=permute_free"]),
    ("tiny-qwen3-moe", []),
    ("tiny-qwen2-moe", ["moe.backend=permute_free", "model.shared_expert_intermediate_size=20"]),
], ids=["permute_free", "reference", "shared_expert"])
def test_folded_residual_is_bitwise_the_add_after(profile, overrides, monkeypatch):
    from moegraph_cli.moe import experts as pf
    based = []

    def spy(src, slots, out, base=None):
        based.append(base is not None)
        return combine.gather_combine(src, slots, out, base)

    monkeypatch.setattr(pf, "gather_combine", spy)
    monkeypatch.setattr(ffn, "COMBINE_RESIDUAL", True)
    folded = _steps(profile, overrides)
    # The fold ran where it applies: the permute-free experts without a shared expert.
    assert any(based) == ((profile, overrides) == ("tiny-qwen3-moe",
                                                   ["moe.backend=permute_free"]))
    based.clear()
    monkeypatch.setattr(ffn, "COMBINE_RESIDUAL", False)
    plain = _steps(profile, overrides)
    assert not any(based)
    for (la, ga), (lb, gb) in zip(folded, plain):
        assert la == lb
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name
