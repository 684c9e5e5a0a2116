"""The whole-step graph (`--scopes step`) and gradient accumulation through graphed scopes, on
the CPU through the emulated backend: replays equal eager steps (losses, gradients, parameters
after AdamW), a batch of another shape falls back with the reason, a failing capture rolls
back, and the planner prices the step pool and refuses what cannot be captured whole."""

import pytest
import torch

from moegraph_cli.errors import NotCapturableError
from moegraph_cli.graphs import GraphSession
from moegraph_cli.graphs.backend import EmulatedGraphs
from moegraph_cli.train.harness import GraphTrainer, capture_into, scope_specs, step_graph
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.trainer import batches

from test_session_emulated import SMALL as SMALL3  # noqa: E402 - tests/graphs is on sys.path

SMALL = [o for o in SMALL3 if not o.startswith("model.num_hidden_layers")] + \
    ["model.num_hidden_layers=2"]


def _model(extra=()):
    return MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32,
                                    overrides=SMALL + list(extra))


def _step_trainer(lr, grad_accum=1, extra=()):
    model = _model(extra)
    tr = GraphTrainer(model, lr=lr, grad_accum=grad_accum)
    graph = step_graph(tr)
    graph.backend = EmulatedGraphs()
    return model, tr, graph


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_step_graph_replays_equal_eager_steps(grad_accum):
    eager, te = _model(), None
    te = GraphTrainer(eager, lr=1e-2, grad_accum=grad_accum)
    graphed, tg, graph = _step_trainer(1e-2, grad_accum)
    ie, ig = batches(128, 4, 16, 1, "cpu"), batches(128, 4, 16, 1, "cpu")
    assert capture_into(graphed, graph, next(batches(128, 4, 16, 9, "cpu")))
    tg.session = graph
    for _ in range(3):
        le, lg = te.step(next(ie)), tg.step(next(ig))
        assert le.item() == lg.item()
    for (n, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
        assert torch.equal(a, b), n
        assert torch.equal(a.grad, b.grad), n
    stats = graph.stats()
    assert stats["totals"]["replayed"] == 3 and stats["totals"]["fallback"] == 0
    assert stats["scopes"][0]["kind"] == "step"


def test_step_graph_falls_back_on_another_shape_with_the_reason():
    model, tr, graph = _step_trainer(0.0)
    assert capture_into(model, graph, next(batches(128, 2, 16, 0, "cpu")))
    tr.session = graph
    tr.step(next(batches(128, 2, 8, 0, "cpu")))
    c = graph.stats()["totals"]
    assert c["fallback"] == 1 and c["replayed"] == 0
    assert "differs from the captured" in graph.stats()["scopes"][0]["fallback_reason"]


def test_step_graph_capture_failure_rolls_back():
    model, tr, graph = _step_trainer(0.0)

    def broken(_ids):
        raise RuntimeError("boom")
    graph.warm_up = broken
    assert not capture_into(model, graph, next(batches(128, 2, 16, 0, "cpu")))
    assert "boom" in graph.failure and not graph.captured


def test_step_graph_refused_on_several_processes():
    class Rt:
        world = 2
    with pytest.raises(NotCapturableError, match="several processes"):
        step_graph(object(), Rt())


def test_accumulation_through_graphed_scopes_equals_eager():
    """grad_accum = 2 with attn+moe graphs: each scope's accumulate-mode backward graph adds,
    the write-mode one writes; gradients and losses equal the eager trainer's."""
    eager, graphed = _model(), _model()
    te = GraphTrainer(eager, lr=0.0, grad_accum=2)
    tg = GraphTrainer(graphed, lr=0.0, grad_accum=2)
    session = GraphSession(scope_specs(graphed, ["attn", "moe"]), strategy="shared",
                           backend=EmulatedGraphs(), warmup_iters=1, accumulate=True)
    assert capture_into(graphed, session, next(batches(128, 4, 16, 0, "cpu")), grad_accum=2)
    tg.session = session
    ie, ig = batches(128, 4, 16, 1, "cpu"), batches(128, 4, 16, 1, "cpu")
    for _ in range(2):
        assert te.step(next(ie)).item() == tg.step(next(ig)).item()
        for (n, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
            assert torch.equal(a.grad, b.grad), n
    tot = session.stats()["totals"]
    assert tot["fallback"] == 0 and tot["replayed"] == 2 * 2 * len(session.scopes)


def test_planner_prices_the_step_pool():
    from moegraph_cli.config import load_profile
    from moegraph_cli.plan.memory import step_model

    model = step_model(load_profile("qwen3-30b-a3b-4layer"))
    step = model.predict_step()
    none = model.predict((False,) * len(model.scopes), "shared")
    # the step pool holds the eager step's dynamic peak: within the allocator slack of it
    assert step.static_bytes == none.static_bytes
    dynamic, _ = model._eager_dynamic((False,) * len(model.scopes))
    assert dynamic * (1 + model.fragmentation) <= step.pool_bytes <= dynamic * 1.2
    assert step.peak >= none.eager_phase_peak
    assert step.pools == {"step": step.pool_bytes}
