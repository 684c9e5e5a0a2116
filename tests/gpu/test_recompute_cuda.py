"""Recompute on the GPU in bf16 (the permute-free experts): the same losses and gradients as
without it, bit for bit, eager, under per-layer graphs and under the whole-step graph; a
recomputed scope's backward graph holds the re-run (one replay, no fallback); the allocator
sees the saved activations go."""

import pytest
import torch

from moegraph_cli.commands.verify import verify_command
from moegraph_cli.graphs import GraphSession
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.models.common.recompute import set_recompute
from moegraph_cli.train.harness import GraphTrainer, capture_into, scope_specs, step_graph
from moegraph_cli.train.runspec import resolve
from moegraph_cli.train.trainer import batches

pytestmark = pytest.mark.cuda

MODES = {"full": {"attn": "full", "moe": "full", "mlp": "full"}, "fc1": {"moe": "fc1"},
         "attn+fc1": {"attn": "full", "moe": "fc1"}, "keep": {"moe": "keep"}}


def _model(mode=None, profile="tiny-qwen3-moe", overrides=()):
    model = MoeCausalLM.from_profile(profile, device="cuda", overrides=list(overrides))
    if mode:
        set_recompute(model, {i: MODES[mode] for i in range(len(model.layers))})
    return model


def _run(trainer, model, steps=3, seq=256):
    out = []
    it = batches(model.config.vocab_size, 2, seq, 1, "cuda")
    for _ in range(steps):
        loss = trainer.step(next(it))
        out.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    return out


def _same(a, b):
    for (la, ga), (lb, gb) in zip(a, b):
        assert la == lb
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))


@pytest.mark.parametrize("mode", ["full", "fc1", "attn+fc1", "keep"])
def test_eager_recompute_bitwise_bf16(mode):
    base, rec = _model(), _model(mode)
    _same(_run(GraphTrainer(base, lr=1e-4), base), _run(GraphTrainer(rec, lr=1e-4), rec))


@pytest.mark.parametrize("mode", ["full", "attn+fc1", "keep"])
@pytest.mark.parametrize("strategy", ["shared", "per_entry"])
def test_graphed_recompute_bitwise_bf16(mode, strategy):
    base, rec = _model(), _model(mode)
    tg = GraphTrainer(rec, lr=0.0)
    session = GraphSession(scope_specs(rec, ["attn", "moe"]), strategy=strategy)
    assert capture_into(rec, session, next(batches(32000, 2, 256, 0, "cuda"))), session.failure
    tg.session = session
    _same(_run(GraphTrainer(base, lr=0.0), base), _run(tg, rec))
    tot = session.stats()["totals"]
    assert tot["fallback"] == 0 and tot["replayed"] == 3 * len(session.scopes)
    session.uninstall()


def test_step_graph_with_recompute_bitwise_bf16():
    base, rec = _model(), _model("full")
    tg = GraphTrainer(rec, lr=1e-4)
    graph = step_graph(tg)
    assert capture_into(rec, graph, next(batches(32000, 2, 256, 7, "cuda"))), graph.failure
    tg.session = graph
    te = GraphTrainer(base, lr=1e-4)
    ie, ig = batches(32000, 2, 256, 1, "cuda"), batches(32000, 2, 256, 1, "cuda")
    for _ in range(3):
        assert te.step(next(ie)).item() == tg.step(next(ig)).item()
    for a, b in zip(base.parameters(), rec.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recompute", ["full", "fc1", "keep"])
@pytest.mark.parametrize("scopes", ["attn,moe", "step"])
def test_verify_lr0_bitwise_with_recompute(recompute, scopes):
    spec = resolve("tiny-qwen3-moe", None, [f"run.recompute={recompute}",
                                            f"run.scopes={scopes}"])
    r = verify_command(spec, lr0=True, steps=3, progress=False)
    assert r["bitwise_equal"] and r["passed"], r["verdict"]
    assert r["counters"]["fallback"] == 0


def test_recompute_frees_saved_activations():
    """The allocator's peak of a forward+backward falls under recompute (qwen3 shape, one
    layer, 4 x 1024 tokens): fc1 frees Y1 [S, 2F] per MoE layer, full nearly everything; keep
    holds FC1's activation [S, F] per MoE layer more."""
    over = ["model.num_hidden_layers=2", "run.batch=4", "run.seq_len=1024"]
    peaks = {}
    for mode in (None, "fc1", "full", "keep"):
        model = _model(mode, "qwen3-30b-a3b-4layer", over)
        tr = GraphTrainer(model, lr=0.0)
        ids = next(batches(model.config.vocab_size, 4, 1024, 0, "cuda"))
        tr.step(ids)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        tr.step(ids)
        peaks[mode] = torch.cuda.max_memory_allocated() - before
        del model, tr
        torch.cuda.empty_cache()
    assert peaks["full"] < peaks["fc1"] < peaks[None] < peaks["keep"], peaks
