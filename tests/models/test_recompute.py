"""Recompute changes memory, never numbers: the same losses and gradients as without it, bit for
bit (CPU fp32), for every family, both MoE modes and both expert backends, eager and through the
emulated graph backend; side effects (drop counts) counted once; nothing but the inputs kept."""

from __future__ import annotations

import functools

import pytest
import torch

from moegraph_cli import models
from moegraph_cli.graphs import GraphSession
from moegraph_cli.graphs.backend import EmulatedGraphs
from moegraph_cli.models.common.recompute import layer_modes, recomputing, set_recompute
from moegraph_cli.train.harness import GraphTrainer, dropped_routes, scope_specs
from moegraph_cli.train.trainer import batches

from family_checks import SMALL

FAMILIES = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe",
            "tiny-deepseek-v3", "tiny-gpt-oss"]
MODES = {  # run.recompute-like choices, as per-scope modes of every layer
    "attn": {"attn": "full"},
    "moe": {"moe": "full", "mlp": "full"},
    "full": {"attn": "full", "moe": "full", "mlp": "full"},
    "fc1": {"moe": "fc1"},
    "attn+fc1": {"attn": "full", "moe": "fc1"},
    "keep": {"moe": "keep"},  # less than none: the experts keep FC1's activation too
}


# Each family's own small-shape fields on top of SMALL (as its tests/models/test_*.py use).
FAMILY_EXTRA = {"tiny-deepseek-v3": [
    "model.num_key_value_heads=4", "model.head_dim=4", "model.qk_rope_head_dim=4",
    "model.qk_nope_head_dim=8", "model.v_head_dim=6", "model.q_lora_rank=12",
    "model.kv_lora_rank=10", "model.max_position_embeddings=256",
    "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 16, "
    "mscale: 1.0, mscale_all_dim: 0.5}"],
    "tiny-qwen2-moe": ["model.shared_expert_intermediate_size=20"]}


def _build(profile, overrides):
    model = models.from_profile(profile, dtype=torch.float32,
                                overrides=[*SMALL, *FAMILY_EXTRA.get(profile, []), *overrides])
    dropped_routes(model, reset=True)  # the counters start at zero, as the commands do
    return model


def _recomputed(model, modes):
    set_recompute(model, {i: modes for i in range(len(model.layers))})
    return model


def _steps(trainer, model, steps=2, seed=1):
    out = []
    for ids in [next(batches(128, 2, 16, seed + s, "cpu")) for s in range(steps)]:
        loss = trainer.step(ids)
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


@functools.lru_cache(maxsize=None)
def _without_recompute(profile, overrides: tuple, lr: float, steps: int):
    """(losses and gradients of each step, routes dropped) of the model without recompute:
    a function of its arguments (seeded build, fixed batches), so each runs once per module
    and every recompute mode and graph strategy is compared with the same run."""
    base = _build(profile, list(overrides))
    return _steps(GraphTrainer(base, lr=lr), base, steps=steps), dropped_routes(base)


def _assert_same(a, b):
    for (la, ga), (lb, gb) in zip(a, b):
        assert la == lb
        for n in ga:
            assert torch.equal(ga[n], gb[n]), n


@pytest.mark.parametrize("profile", FAMILIES)
@pytest.mark.parametrize("mode", ["full", "fc1"])
def test_eager_recompute_is_bitwise(profile, mode):
    rec = _recomputed(_build(profile, []), MODES[mode])
    _assert_same(_without_recompute(profile, (), 1e-2, 2)[0],
                 _steps(GraphTrainer(rec, lr=1e-2), rec))


@pytest.mark.parametrize("overrides", [
    ["moe.mode=capacity", "moe.capacity_factor=0.5"],
    ["moe.backend=permute_free"],
    ["moe.backend=permute_free", "moe.mode=capacity", "moe.capacity_factor=0.5"],
], ids=["capacity", "permute_free", "permute_free-capacity"])
@pytest.mark.parametrize("mode", ["attn", "moe", "fc1", "keep"])
def test_recompute_modes_and_backends(overrides, mode):
    base_steps, base_dropped = _without_recompute("tiny-qwen3-moe", tuple(overrides), 1e-2, 2)
    rec = _recomputed(_build("tiny-qwen3-moe", overrides), MODES[mode])
    _assert_same(base_steps, _steps(GraphTrainer(rec, lr=1e-2), rec))
    # Drops are counted by the forward once, not again by the re-run.
    assert base_dropped == dropped_routes(rec)


@pytest.mark.parametrize("profile", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gpt-oss"])
@pytest.mark.parametrize("mode", ["full", "attn+fc1"])
@pytest.mark.parametrize("strategy", ["shared", "per_entry"])
def test_graphed_recompute_matches_eager(profile, mode, strategy):
    """Captured scopes with recompute (the re-run inside the backward graph) against eager
    without it: losses and every gradient bitwise, every scope replayed, no fallback."""
    graphed = _recomputed(_build(profile, []), MODES[mode])
    tg = GraphTrainer(graphed, lr=0.0)
    session = GraphSession(scope_specs(graphed, ["attn", "moe"]), strategy=strategy,
                           backend=EmulatedGraphs(), warmup_iters=1)
    ids = next(batches(128, 2, 16, 0, "cpu"))
    session.record(lambda: graphed(ids, labels=ids))
    assert session.capture(), session.failure
    session.install()
    tg.session = session
    _assert_same(_without_recompute(profile, (), 0.0, 3)[0], _steps(tg, graphed, steps=3))
    tot = session.stats()["totals"]
    assert tot["fallback"] == 0 and tot["replayed"] == 3 * len(session.scopes)


def _kept_activations(model, x):
    """Tensors the autograd graph of one layer keeps past its forward that are neither
    parameters nor the layer's inputs/outputs. Saved-tensor hooks pack a detached alias of
    every saved tensor and watch it weakly: it lives exactly as long as the graph node that
    saved it (the alias has no grad_fn, so no reference cycle keeps it), so what a dropped
    inner graph packed is gone by the time the forward returns."""
    import gc
    import weakref

    refs = []

    def pack(t):
        alias = t.detach()
        refs.append(weakref.ref(alias))
        return alias

    layer = model.layers[1]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer.attn(x)
        out, stats = layer.ffn(y)
    gc.collect()
    known = {p.untyped_storage().data_ptr() for p in model.parameters()}
    known |= {t.untyped_storage().data_ptr() for t in (x, y, out, stats)}
    known |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    kept = [r() for r in refs if r() is not None]
    kept = [t for t in kept if t.untyped_storage().data_ptr() not in known]
    return kept, (out, stats)


def test_full_recompute_keeps_only_inputs():
    """A recomputed scope's autograd node holds its inputs alone; without recompute the same
    layer keeps its activations."""
    for modes, expect_none in ((MODES["full"], True), ({}, False)):
        model = _recomputed(_build("tiny-qwen3-moe", []), modes)
        model.rope_tables(16, torch.float32, "cpu")
        x = torch.randn(2, 16, 32, requires_grad=True)
        kept, (out, stats) = _kept_activations(model, x)
        assert (len(kept) == 0) == expect_none, [tuple(t.shape) for t in kept]
        (out.sum() + stats.sum()).backward()
        assert x.grad is not None and not recomputing()


def test_layer_modes_and_bad_values():
    model = _build("tiny-qwen3-moe", [])
    set_recompute(model, {0: {"attn": "full", "moe": "fc1"}})
    assert layer_modes(model.layers[0]) == {"attn": "full", "moe": "fc1"}
    assert layer_modes(model.layers[1]) == {"attn": "none", "moe": "none"}
    with pytest.raises(ValueError, match="recompute 'fc1' is not one of"):
        set_recompute(model, {0: {"attn": "fc1"}})
