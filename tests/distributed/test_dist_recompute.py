"""Recompute under FSDP2 + expert parallelism on CPU ranks (gloo, emulated graph backend): the
same losses and gradient shards as without it, bit for bit, eager and graphed (the re-run
reads FSDP2's re-gathered parameters and hands their gradients to its reduce-scatter)."""

import torch

from gloo_util import run_gloo

SMALL = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "model.num_hidden_layers=2", "run.device=cpu",
         "run.dtype=float32", "run.batch=2", "run.seq_len=16"]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _same_as_without(rank, world, ep, recompute):
    from moegraph_cli.distributed.runtime import setup
    from moegraph_cli.train.harness import build_session, capture_into, make_trainer
    from moegraph_cli.train.runspec import build_model, resolve
    from moegraph_cli.train.trainer import batches

    base = resolve("tiny-qwen3-moe", None, SMALL)
    rec = resolve("tiny-qwen3-moe", None, SMALL + [f"run.recompute={recompute}"])
    rt = setup(ep, base.profile.model.num_experts, "cpu", 60)
    plain, recomputed, graphed = (build_model(s, rt.device, rt=rt) for s in (base, rec, rec))
    trainers = [make_trainer(m, 0.0, 0.0, rt) for m in (plain, recomputed, graphed)]
    session = build_session(graphed, ["attn", "moe"], "shared", rt=rt)
    assert capture_into(graphed, session, next(batches(128, 2, 16, 0, "cpu", rank=rank,
                                                       world=world)), rt), session.failure
    trainers[2].session = session
    iters = [batches(128, 2, 16, 1, "cpu", rank=rank, world=world) for _ in trainers]
    for _ in range(2):
        losses = [t.step(next(it)).item() for t, it in zip(trainers, iters)]
        assert losses[0] == losses[1] == losses[2], losses
        for (n, a), (_, b), (_, c) in zip(plain.named_parameters(), recomputed.named_parameters(),
                                          graphed.named_parameters()):
            assert torch.equal(_local(a.grad), _local(b.grad)), n
            assert torch.equal(_local(a.grad), _local(c.grad)), n
    tot = session.stats()["totals"]
    assert tot["fallback"] == 0 and tot["replayed"] == 2 * 4


def test_recompute_full_ep2_bitwise():
    run_gloo(_same_as_without, 2, 2, "full")


def test_recompute_attn_fc1_ep2_bitwise():
    run_gloo(_same_as_without, 2, 2, "attn+fc1")
