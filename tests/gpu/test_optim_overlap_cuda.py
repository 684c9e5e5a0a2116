"""The optimizer step under the backward on the GPU (train/overlap.py): the early updates run
on a side stream, eager and inside the whole-step graph, and the parameters and losses stay
bitwise those of the plain step (the Triton AdamW, bf16)."""

import pytest
import torch

from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.harness import GraphTrainer, capture_into, step_graph
from moegraph_cli.train.trainer import batches

pytestmark = pytest.mark.cuda


def _models(n=2, overrides=()):
    return [MoeCausalLM.from_profile("tiny-qwen3-moe", device="cuda", overrides=list(overrides))
            for _ in range(n)]


def _same(a, b):
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), n


@pytest.mark.parametrize("tied", [False, True])
def test_eager_overlap_is_bitwise_the_plain_step(tied):
    models = _models(overrides=["model.tie_word_embeddings=true"] if tied else [])
    plain = GraphTrainer(models[0], lr=1e-3, weight_decay=0.01)
    over = GraphTrainer(models[1], lr=1e-3, weight_decay=0.01, optim_overlap=True)
    ia, ib = batches(32000, 2, 256, 1, "cuda"), batches(32000, 2, 256, 1, "cuda")
    for _ in range(4):
        assert plain.step(next(ia)).item() == over.step(next(ib)).item()
    torch.cuda.synchronize()
    _same(models[0], models[1])
    assert over.overlap.early > 0


def test_whole_step_graph_with_overlap_matches_plain_eager():
    models = _models()
    plain = GraphTrainer(models[0], lr=1e-3)
    over = GraphTrainer(models[1], lr=1e-3, optim_overlap=True)
    graph = step_graph(over)
    assert capture_into(models[1], graph, next(batches(32000, 2, 256, 7, "cuda"))), graph.failure
    assert over.overlap.early > 0  # the captured step forked the side stream
    over.session = graph
    ia, ib = batches(32000, 2, 256, 1, "cuda"), batches(32000, 2, 256, 1, "cuda")
    for _ in range(3):
        assert plain.step(next(ia)).item() == over.step(next(ib)).item()
    torch.cuda.synchronize()
    _same(models[0], models[1])
    assert graph.stats()["totals"]["fallback"] == 0
