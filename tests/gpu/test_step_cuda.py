"""The whole-step graph on the GPU: replays equal eager steps bit for bit (losses and the
parameters after the Triton AdamW), with grad accumulation too, and with the loss head in
row chunks; the step pool is measured."""

import pytest
import torch

from moegraph_cli.train.harness import GraphTrainer, capture_into, step_graph
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.trainer import batches

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("loss_chunk", [0, 192])  # 192: two chunks of 512 rows and a part
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_whole_step_graph_matches_eager_bitwise(grad_accum, loss_chunk):
    models = [MoeCausalLM.from_profile("tiny-qwen3-moe", device="cuda") for _ in range(2)]
    for m in models:
        m.loss_chunk = loss_chunk  # the loss-only head in row chunks (loss_chunked.py)
    te = GraphTrainer(models[0], lr=1e-4, grad_accum=grad_accum)
    tg = GraphTrainer(models[1], lr=1e-4, grad_accum=grad_accum)
    graph = step_graph(tg)
    assert capture_into(models[1], graph, next(batches(32000, 2, 256, 7, "cuda"))), graph.failure
    tg.session = graph
    ie, ig = batches(32000, 2, 256, 1, "cuda"), batches(32000, 2, 256, 1, "cuda")
    for _ in range(3):
        assert te.step(next(ie)).item() == tg.step(next(ig)).item()
    for (n, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a, b), n
    c = graph.stats()["totals"]
    assert c["replayed"] == 3 and c["fallback"] == 0
    assert graph.pools()[0]["bytes"] > 0
    tg.optimizer.set_lr(0.0)  # a captured step reads the lr from the device
    before = [p.detach().clone() for p in models[1].parameters()]
    tg.step(next(ig))
    assert all(torch.equal(a, p) for a, p in zip(before, models[1].parameters()))
