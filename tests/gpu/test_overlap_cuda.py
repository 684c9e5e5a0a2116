"""The AdamW update inside the backward (train/overlap.py) on the GPU, on its side stream: the
same bits as the update after the backward (losses, parameters and optimizer states after
several steps, the Triton AdamW), eager and through the whole-step graph, with grad
accumulation too; every chunk starts before the backward ends."""

import pytest
import torch

from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.harness import GraphTrainer, capture_into, step_graph
from moegraph_cli.train.trainer import batches

pytestmark = pytest.mark.cuda


def _trainer(overlap, grad_accum=1, whole_step=False):
    model = MoeCausalLM.from_profile("tiny-qwen3-moe", device="cuda")
    tr = GraphTrainer(model, lr=1e-3, weight_decay=0.1, grad_accum=grad_accum, overlap=overlap)
    if whole_step:
        graph = step_graph(tr)
        ok = capture_into(model, graph, next(batches(32000, 2 * grad_accum, 256, 7, "cuda")))
        assert ok, graph.failure
        tr.session = graph
    return model, tr


@pytest.mark.parametrize("whole_step", [False, True])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_overlapped_update_is_bitwise_the_plain_one(whole_step, grad_accum):
    (m0, plain), (m1, over) = (_trainer(o, grad_accum, whole_step) for o in (False, True))
    assert over.overlap is not None and over.overlap.stream is not None
    i0, i1 = (batches(32000, 2 * grad_accum, 256, 1, "cuda") for _ in range(2))
    for _ in range(4):
        assert plain.step(next(i0)).item() == over.step(next(i1)).item()
    torch.cuda.synchronize()
    for a, b in zip(plain.optimizer.flat_buffers(), over.optimizer.flat_buffers()):
        assert torch.equal(a, b)
    if whole_step:
        assert over.session.stats()["totals"]["replayed"] == 4
    else:
        assert over.overlap.early == len(m1.layers) + 1
