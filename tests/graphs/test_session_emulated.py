"""The graph session's logic on the CPU through the emulated backend: chaining, counters,
pool-group fallback, re-entry, rollback, and eager-vs-graph bitwise equality at lr 0."""

import pytest
import torch

from moegraph_cli.graphs import GraphSession
from moegraph_cli.graphs.backend import EmulatedGraphs
from moegraph_cli.train.harness import GraphTrainer, scope_specs
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.trainer import batches

SMALL = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "model.num_hidden_layers=3"]


def _model(extra=()):
    return MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32,
                                    overrides=SMALL + list(extra))


def _session(model, scopes=("attn", "moe"), strategy="shared", seq=16):
    s = GraphSession(scope_specs(model, list(scopes)), strategy=strategy,
                     backend=EmulatedGraphs(), warmup_iters=1)
    ids = next(batches(128, 2, seq, 0, "cpu"))
    s.record(lambda: model(ids, labels=ids))
    assert s.capture(), s.failure
    s.install()
    return s


@pytest.mark.parametrize("strategy", ["shared", "per_scope", "per_entry"])
@pytest.mark.parametrize("extra", [[], ["moe.mode=capacity", "moe.capacity_factor=0.5"],
                                   ["model.mlp_only_layers=[1]"]])
def test_lr0_losses_and_grads_bitwise_equal(strategy, extra):
    eager, graphed = _model(extra), _model(extra)
    te, tg = GraphTrainer(eager, lr=0.0), GraphTrainer(graphed, lr=0.0)
    session = _session(graphed, strategy=strategy)
    tg.session = session
    ie, ig = batches(128, 2, 16, 1, "cpu"), batches(128, 2, 16, 1, "cpu")
    for _ in range(3):
        le, lg = te.step(next(ie)), tg.step(next(ig))
        assert le.item() == lg.item()
        for (n, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
            assert torch.equal(a.grad, b.grad), n
    tot = session.stats()["totals"]
    n = len(session.scopes)
    assert n == 6
    assert tot["captured"] == n and tot["replayed"] == 3 * n
    assert tot["backward_replayed"] == 3 * n and tot["fallback"] == 0
    # only the first scope's input (the embedding output) is copied in; the rest are chained
    rows = session.stats()["scopes"]
    assert rows[0]["input_copies"] == 3
    assert all(r["input_copies"] == 0 for r in rows[1:])
    # backward: hidden-state grads are chained too; only the last layer's output grad (from
    # the eager final norm) and each MoE layer's aux-statistics grad are copied in
    moe_layers = sum(1 for r in rows if r["kind"] == "moe")
    assert tot["grad_copies"] == 3 * (1 + moe_layers)


def test_lr_positive_tracks_eager():
    eager, graphed = _model(), _model()
    te, tg = GraphTrainer(eager, lr=1e-2), GraphTrainer(graphed, lr=1e-2)
    tg.session = _session(graphed)
    ie, ig = batches(128, 2, 16, 1, "cpu"), batches(128, 2, 16, 1, "cpu")
    for _ in range(3):
        assert te.step(next(ie)).item() == tg.step(next(ig)).item()


def test_seq_len_change_falls_back_alone_when_unpooled():
    model = _model()
    tr = GraphTrainer(model, lr=0.0)
    session = _session(model, strategy="per_entry")
    tr.session = session
    tr.step(next(batches(128, 2, 16, 0, "cpu")))
    tr.step(next(batches(128, 2, 24, 0, "cpu")))  # new seq_len: contract breaks
    rows = session.stats()["scopes"]
    assert all(r["fallback"] == 1 for r in rows)
    assert "input 0 shape [2, 24, 32] != captured [2, 16, 32]" in rows[0]["fallback_reason"]
    tr.step(next(batches(128, 2, 16, 0, "cpu")))  # back to the captured shape: replays again
    assert all(r["replayed"] == 2 for r in session.stats()["scopes"])


def test_shared_group_goes_eager_together():
    model = _model()
    tr = GraphTrainer(model, lr=0.0)
    session = _session(model, strategy="shared")
    tr.session = session
    # Break only layer 1's attention contract: grad buffer moved for one of its params.
    layer1 = model.layers[1].attn
    layer1.q_proj.weight.grad = torch.zeros_like(layer1.q_proj.weight)
    tr.step(next(batches(128, 2, 16, 0, "cpu")))
    rows = {r["name"]: r for r in session.stats()["scopes"]}
    assert rows["layers.0.attn"]["replayed"] == 1 and rows["layers.0.moe"]["replayed"] == 1
    assert "grad buffer moved" in rows["layers.1.attn"]["fallback_reason"]
    for name in ("layers.1.moe", "layers.2.attn", "layers.2.moe"):
        assert rows[name]["fallback"] == 1
        assert "pool group shared is eager this step" in rows[name]["fallback_reason"]


def test_unpooled_violation_stays_alone():
    model = _model()
    tr = GraphTrainer(model, lr=0.0)
    session = _session(model, strategy="per_entry")
    tr.session = session
    layer1 = model.layers[1].attn
    layer1.q_proj.weight.grad = torch.zeros_like(layer1.q_proj.weight)
    tr.step(next(batches(128, 2, 16, 0, "cpu")))
    rows = {r["name"]: r for r in session.stats()["scopes"]}
    assert rows["layers.1.attn"]["fallback"] == 1
    assert sum(r["fallback"] for r in rows.values()) == 1


def test_reentry_before_backward_runs_eager():
    model = _model()
    session = _session(model, strategy="per_entry")
    ids = next(batches(128, 2, 16, 0, "cpu"))
    session.new_step()
    model(ids, labels=ids)
    model(ids, labels=ids).loss.backward()
    rows = session.stats()["scopes"]
    assert all(r["replayed"] == 1 and r["fallback"] == 1 for r in rows)
    assert rows[0]["fallback_reason"] == "called again before its backward ran"


def test_no_grad_and_eval_fall_back():
    model = _model()
    session = _session(model, strategy="per_entry")
    ids = next(batches(128, 2, 16, 0, "cpu"))
    session.new_step()
    with torch.no_grad():
        model(ids)
    assert "grad mode disabled" in session.stats()["scopes"][0]["fallback_reason"]


def test_failed_capture_rolls_back_and_stays_eager():
    model = _model()
    boom = {"n": 0}
    backend = EmulatedGraphs()
    real = backend.capture

    def failing(body, pool):
        boom["n"] += 1
        if boom["n"] == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(body, pool)

    backend.capture = failing
    s = GraphSession(scope_specs(model, ["attn", "moe"]), backend=backend, warmup_iters=1)
    ids = next(batches(128, 2, 16, 0, "cpu"))
    s.record(lambda: model(ids, labels=ids))
    assert not s.capture()
    assert s.failure.startswith("OutOfMemoryError during fwd of layers.2.attn (layer 2)")
    assert not s.captured and all(sc.fwd_graph is None for sc in s.scopes)
    assert all("forward" not in sc.module.__dict__ for sc in s.scopes)
    loss = model(ids, labels=ids).loss  # still trains eagerly
    loss.backward()
    assert loss.item() == loss.item()


def test_uninstall_restores_eager_forward():
    model = _model()
    session = _session(model)
    assert all("forward" in s.module.__dict__ for s in session.scopes)
    session.uninstall()
    assert all("forward" not in s.module.__dict__ for s in session.scopes)
