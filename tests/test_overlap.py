"""The optimizer update overlapped with the backward (train/overlap.py) gives the same bits as
the update after it: parameters, optimizer states and losses after several steps, for every
family, with recompute, with grad accumulation, and through the whole-step graph (emulated);
the chunks really start inside the backward; a second gradient write after a chunk's update
is refused; scope graphs turn it off."""

from __future__ import annotations

import pytest
import torch

from moegraph_cli import grads, models
from moegraph_cli.models.common.recompute import set_recompute
from moegraph_cli.train.harness import GraphTrainer
from moegraph_cli.train.optim import FlatAdamW
from moegraph_cli.train.overlap import OverlappedUpdate
from moegraph_cli.train.trainer import Trainer, batches

from family_checks import SMALL

FAMILIES = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe",
            "tiny-deepseek-v3", "tiny-gpt-oss"]
FAMILY_EXTRA = {"tiny-deepseek-v3": [
    "model.num_key_value_heads=4", "model.head_dim=4", "model.qk_rope_head_dim=4",
    "model.qk_nope_head_dim=8", "model.v_head_dim=6", "model.q_lora_rank=12",
    "model.kv_lora_rank=10", "model.max_position_embeddings=256",
    "moe.bias_update_rate=0.001"],
    "tiny-qwen2-moe": ["model.shared_expert_intermediate_size=20"]}


def _build(profile, overrides=()):
    return models.from_profile(profile, dtype=torch.float32,
                               overrides=[*SMALL, *FAMILY_EXTRA.get(profile, []), *overrides])


def _run(trainer, steps=3, batch=2):
    it = batches(128, batch, 16, 7, "cpu")
    return [trainer.step(next(it)).item() for _ in range(steps)]


def _state(trainer):
    return [t.clone() for t in trainer.optimizer.flat_buffers()]


def _assert_same(a, b):
    la, sa = a
    lb, sb = b
    assert la == lb
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert torch.equal(x, y)


def _both(profile, overrides=(), cls=Trainer, setup=None, **kw):
    out = []
    for overlap in (False, True):
        model = _build(profile, overrides)
        if setup is not None:
            setup(model)
        trainer = cls(model, lr=1e-2, weight_decay=0.1, overlap=overlap, **kw)
        losses = _run(trainer, batch=2 * kw.get("grad_accum", 1))
        out.append((losses, _state(trainer)))
        if overlap:
            # every layer and the head started inside the backward, not at its end
            assert trainer.overlap.early == len(model.layers) + 1, trainer.overlap.early
    return out


@pytest.mark.parametrize("profile", FAMILIES)
def test_overlapped_update_is_bitwise_the_plain_one(profile):
    _assert_same(*_both(profile))


def test_tied_embeddings_and_grad_accum_and_recompute():
    _assert_same(*_both("tiny-qwen3-moe", ["model.tie_word_embeddings=true"]))
    _assert_same(*_both("tiny-mixtral", grad_accum=2))
    modes = {"attn": "full", "moe": "fc1"}
    _assert_same(*_both("tiny-olmoe", setup=lambda m: set_recompute(
        m, {i: modes for i in range(len(m.layers))})))


def test_chunks_cover_every_parameter_once():
    model = _build("tiny-qwen3-moe")
    opt = FlatAdamW([p for p in model.parameters()], lr=1e-3)
    ov = OverlappedUpdate(opt, model.update_chunks())
    assert len(ov.chunks) == len(model.layers) + 1
    seen = torch.zeros(opt.groups[0].param.numel(), dtype=torch.int32)
    for _, a, b in [r for c in ov.chunks for r in c.ranges] + ov.rest:
        seen[a:b] += 1
    assert bool((seen == 1).all())
    # the embedding is in no chunk: it is the rest
    emb = model.embed_tokens.weight
    (g, a, b), = opt.ranges_of([emb])
    assert (g, a, b) in ov.rest


def test_non_consecutive_or_overlapping_chunks_are_left_to_the_end():
    model = _build("tiny-qwen3-moe")
    opt = FlatAdamW([p for p in model.parameters()], lr=1e-3)
    layers = list(model.layers)
    split = [list(layers[0].parameters())[:1] + list(layers[1].parameters())[:1]]
    assert opt.ranges_of(split[0]) is None
    ov = OverlappedUpdate(opt, split + [list(layers[1].parameters())] * 2)
    assert len(ov.chunks) == 1  # the second copy overlaps the first: dropped
    assert opt.ranges_of([torch.nn.Parameter(torch.zeros(3))]) is None


def test_a_write_after_the_chunks_update_is_refused():
    model = _build("tiny-qwen3-moe")
    trainer = Trainer(model, lr=1e-2, overlap=True)
    w = model.layers[1].attn.o_proj.weight if hasattr(model.layers[1].attn, "o_proj") else \
        next(model.layers[1].parameters())
    ids = next(batches(128, 2, 16, 7, "cpu"))
    with trainer.overlap.armed():
        loss = model(ids, labels=ids, keep_logits=False).loss
        with grads.backward_pass(accumulate=False):
            loss.backward()
            with pytest.raises(RuntimeError, match="written after its optimizer update"):
                grads.target(w)
    trainer.overlap.finish()


def test_scope_graphs_turn_it_off_and_the_whole_step_keeps_it():
    from types import SimpleNamespace

    from moegraph_cli.graphs.backend import EmulatedGraphs
    from moegraph_cli.train.harness import capture_into, step_graph

    model = _build("tiny-qwen3-moe")
    trainer = GraphTrainer(model, lr=1e-2, overlap=True)
    assert trainer.may_overlap()
    trainer.session = SimpleNamespace(whole_step=False)
    assert not trainer.may_overlap()
    trainer.session = None
    # the whole step, captured and replayed (emulated), with the update inside its backward
    graph = step_graph(trainer)
    graph.backend = EmulatedGraphs()
    plain_model = _build("tiny-qwen3-moe")
    plain = GraphTrainer(plain_model, lr=1e-2)
    assert capture_into(model, graph, next(batches(128, 2, 16, 9, "cpu")))
    trainer.session = graph
    assert trainer.may_overlap()
    assert _run(trainer) == _run(plain)
    assert graph.stats()["totals"]["replayed"] == 3
    _assert_same(([], _state(trainer)), ([], _state(plain)))


def test_unarmed_boundaries_add_no_node():
    x = torch.randn(3, requires_grad=True) * 2
    assert grads.boundary(x) is x
