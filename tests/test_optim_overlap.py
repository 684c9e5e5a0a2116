"""The optimizer step under the backward (train/overlap.py) on the CPU, where the early
updates run inline at the fences: a parameter read after its update would change the next
steps, so bitwise parity with the plain step is the check that no update came too early."""

import pytest
import torch

from moegraph_cli.config.run import RunConfig
from moegraph_cli.errors import UsageError
from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train import overlap as overlap_mod
from moegraph_cli.train.optim import FlatAdamW
from moegraph_cli.train.trainer import GraphTrainer, Trainer, batches

SMALL = ["model.vocab_size=256", "model.hidden_size=64", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=16", "model.moe_intermediate_size=32",
         "model.num_hidden_layers=3"]


def _pair(profile="tiny-qwen3-moe", extra=(), grad_accum=1):
    base = SMALL if profile == "tiny-qwen3-moe" else []  # the others keep their tiny shapes
    models = [MoeCausalLM.from_profile(profile, dtype=torch.float32,
                                       overrides=base + list(extra)) for _ in range(2)]
    trainers = [Trainer(m, lr=3e-3, weight_decay=0.01, grad_accum=grad_accum,
                        optim_overlap=on) for m, on in zip(models, (False, True))]
    return models, trainers


def _run(models, trainers, steps=3, batch=2):
    vocab = models[0].config.vocab_size
    its = [batches(vocab, batch, 16, 3, "cpu") for _ in trainers]
    losses = [[t.step(next(i)).item() for _ in range(steps)] for t, i in zip(trainers, its)]
    return losses


def _assert_same(models, losses):
    assert losses[0] == losses[1]
    for (n, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("profile", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gpt-oss"])
def test_overlapped_steps_are_bitwise_the_plain_steps(profile):
    models, trainers = _pair(profile)
    losses = _run(models, trainers)
    _assert_same(models, losses)
    ov = trainers[1].overlap
    # the first step learns the write counts; the later ones update most parameters early
    assert ov.early > len(ov.params) // 2 and ov.fences >= 3
    groups = trainers[1].optimizer.groups
    assert all(torch.equal(a.exp_avg_sq, b.exp_avg_sq)
               for a, b in zip(trainers[0].optimizer.groups, groups))


def test_tied_embedding_waits_for_its_second_write():
    models, trainers = _pair(extra=["model.tie_word_embeddings=true"])
    losses = _run(models, trainers)
    _assert_same(models, losses)
    emb = models[1].embed_tokens.weight
    assert trainers[1].overlap.expected[id(emb)] == 2


def test_grad_accumulation_overlaps_only_the_last_micro_batch():
    models, trainers = _pair(grad_accum=2)
    losses = _run(models, trainers, batch=4)
    _assert_same(models, losses)
    assert trainers[1].overlap.early > 0


def test_with_recompute_the_fences_still_hold():
    models, trainers = _pair()
    from moegraph_cli.models.common.recompute import set_recompute
    for m in models:
        set_recompute(m, {0: {"attn": "full", "moe": "full"}, 1: {"moe": "fc1"}})
    losses = _run(models, trainers)
    _assert_same(models, losses)
    assert trainers[1].overlap.early > 0


def test_an_update_before_the_last_read_is_caught(monkeypatch):
    """Teeth: fences that take every pending parameter as final update weights the backward
    still reads, and the parity check sees it."""
    import types

    class Written(dict):
        def get(self, key, default=None):
            return 10**6

    models, trainers = _pair()
    every = types.SimpleNamespace(write_counts=Written)
    monkeypatch.setattr(overlap_mod, "grads", every)
    losses = _run(models, trainers)
    assert losses[0][:2] == losses[1][:2]  # the first step only learns; the second's loss
    assert losses[0][2] != losses[1][2]  # is computed before its early updates apply
    assert trainers[1].overlap.early == len(trainers[1].overlap.params)


def test_a_changed_write_pattern_refuses_the_step():
    models, trainers = _pair(extra=["model.tie_word_embeddings=true"])
    it = batches(256, 2, 16, 3, "cpu")
    t = trainers[1]
    t.step(next(it))  # learns: the tied embedding is written twice
    emb = models[1].embed_tokens.weight
    t.overlap.expected[id(emb)] = 1  # as if one write were the whole pass
    with pytest.raises(RuntimeError, match="optimizer overlap"):
        t.step(next(it))


def test_scoped_graph_sessions_step_after_the_backward():
    model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32, overrides=SMALL)
    t = GraphTrainer(model, lr=1e-3, optim_overlap=True)
    assert t.overlap_allowed()

    class Scoped:
        whole_step = False

    t.session = Scoped()
    assert not t.overlap_allowed()
    t.session.whole_step = True
    assert t.overlap_allowed()


def test_partial_updates_in_any_order_equal_one_step():
    torch.manual_seed(0)
    shapes = [(3, 5), (7,), (64,), (2, 33), (1,)]
    first = [torch.randn(s) for s in shapes]
    ps = [[x.clone().requires_grad_() for x in first] for _ in range(2)]
    opts = [FlatAdamW(p, lr=1e-2, weight_decay=0.1) for p in ps]
    for step in range(3):
        g = [torch.randn(s) for s in shapes]
        for opt in opts:
            for p, x in zip(opt.params, g):
                p.grad.copy_(x)
        opts[0].step()
        opts[1].begin_step()
        order = [[4, 0], [2], [1, 3]] if step % 2 else [[1], [3, 4, 2, 0]]
        for part in order:
            opts[1].update([opts[1].params[i] for i in part])
    for a, b in zip(*ps):
        assert torch.equal(a, b)


def test_ranges_tile_each_buffer_once_and_merge_neighbours():
    ps = [torch.zeros(n, requires_grad=True) for n in (10, 64, 65, 1)]
    opt = FlatAdamW(ps, lr=1e-3)
    g = opt.groups[0]
    every = opt.ranges(opt.params)
    assert [(lo, hi) for _, lo, hi in every] == [(0, g.param.numel())]
    split = opt.ranges([opt.params[0], opt.params[2], opt.params[3]])
    assert [(lo, hi) for _, lo, hi in split] == [(0, 64), (128, g.param.numel())]
    with pytest.raises(ValueError, match="not one of the packed parameters"):
        opt.ranges([torch.zeros(3)])


def test_run_config_takes_the_switch():
    assert RunConfig().optim_overlap is False
    from moegraph_cli.config.profile import load_profile
    prof = load_profile("tiny-qwen3-moe", ["run.optim_overlap=true"])
    assert prof.run.optim_overlap is True
    with pytest.raises(UsageError):
        load_profile("tiny-qwen3-moe", ["run.optim_overlap=maybe"])
