"""FSDP2's units outside the decoder layers (distributed/model.py), on CPU ranks (gloo): with an
untied head the embedding is a unit resharded after its forward, the final norm and the lm head
one unit kept from its forward to its backward, whose gradients are reduce-scattered before
the layers' backward begins; the root holds no parameter. A tied head stays in the root.

The moments are what plan/parallel.py charges: a unit's parameters are registered unsharded
(plain tensors) while gathered and sharded (DTensors) otherwise, and a reduce-scatter has run
once the sharded gradient holds something (the trainer zeroes it before every step).
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

from gloo_util import run_gloo

SMALL = ["model.vocab_size=128", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16",
         "model.intermediate_size=48", "model.num_hidden_layers=2", "run.device=cpu",
         "run.dtype=float32", "run.batch=2", "run.seq_len=16"]


def _sharded(module) -> bool:
    return isinstance(module.weight, DTensor)


def _reduced(module) -> bool:
    """The unit's reduce-scatter has written this rank's gradient shard."""
    if not _sharded(module):  # gathered: any gradient is the unsharded one
        return False
    grad = module.weight.grad
    return grad is not None and bool(grad.to_local().abs().sum() > 0)


def _build(world, ep, extra=()):
    from moegraph_cli.distributed.runtime import setup
    from moegraph_cli.train.harness import make_trainer
    from moegraph_cli.train.runspec import build_model, resolve

    spec = resolve("tiny-qwen3-moe", None, SMALL + list(extra))
    rt = setup(ep, spec.profile.model.num_experts, "cpu", 60)
    model = build_model(spec, rt.device, rt=rt)
    return model, make_trainer(model, 1e-2, 0.1, rt)


def _untied_moments(rank, world, ep):
    from torch.distributed.fsdp import FSDPModule

    from moegraph_cli.train.trainer import batches

    model, trainer = _build(world, ep)
    assert isinstance(model.embed_tokens, FSDPModule) and isinstance(model.norm, FSDPModule)
    assert model.norm._get_fsdp_state() is model.lm_head._get_fsdp_state()  # one unit
    seen: dict[str, tuple] = {}

    def first_layer(module, args):
        seen["layer 0 forward"] = (_sharded(model.embed_tokens), _sharded(model.lm_head))

    def after_forward(module, args, out):
        seen["after forward"] = (_sharded(model.embed_tokens), _sharded(model.lm_head),
                                 _sharded(model.norm))

    def head_input(module, args, out):
        def probe(grad):  # the lm head's backward done, the final norm's not yet
            seen["lm-head backward"] = (_sharded(model.lm_head), _reduced(model.lm_head),
                                        _sharded(model.embed_tokens))
        out.register_hook(probe)

    def last_layer_out(module, args, out):
        def probe(grad):
            seen["last layer backward"] = (_sharded(model.lm_head), _sharded(model.norm),
                                           _reduced(model.lm_head), _reduced(model.norm),
                                           _reduced(model.embed_tokens))
        out[0].register_hook(probe)

    handles = [model.layers[0].register_forward_pre_hook(first_layer),
               model.register_forward_hook(after_forward),
               model.norm.register_forward_hook(head_input),
               model.layers[-1].register_forward_hook(last_layer_out)]
    mine = batches(128, 2, 16, 2, "cpu", rank=rank, world=world)
    for _ in range(2):  # the second step: after a first step's resharding and zeroing
        seen.clear()
        trainer.step(next(mine))
        # the embedding gathered for its forward only; the head not before the final norm
        assert seen["layer 0 forward"] == (True, True), seen
        # the head kept gathered into its backward, the embedding not
        assert seen["after forward"] == (True, False, False), seen
        # the head still gathered through its backward, its reduce-scatter not yet run
        # (FSDP2's prefetch of the last layer issues an all-gather here, but only that
        # layer's pre-backward registers its parameters unsharded: the plan charges it)
        assert seen["lm-head backward"] == (False, False, True), seen
        # the head's reduce-scatter done and its weights resharded before the last layer's
        # backward; the embedding's gradient not yet there
        assert seen["last layer backward"] == (True, True, True, True, False), seen
        assert _sharded(model.embed_tokens) and _sharded(model.lm_head)
    for h in handles:
        h.remove()
    root = [p for p in model.parameters(recurse=False)]
    assert not root


def _tied_in_root(rank, world, ep):
    from torch.distributed.fsdp import FSDPModule

    from moegraph_cli.train.trainer import batches

    model, trainer = _build(world, ep, ["model.tie_word_embeddings=true"])
    assert model.lm_head is None
    assert not isinstance(model.embed_tokens, FSDPModule)
    assert not isinstance(model.norm, FSDPModule)
    trainer.step(next(batches(128, 2, 16, 1, "cpu", rank=rank, world=world)))
    assert _sharded(model.embed_tokens) and _reduced(model.embed_tokens)


@pytest.mark.parametrize("world,ep", [(2, 1), (4, 2)])
def test_untied_head_and_embedding_are_units_of_their_own(world, ep):
    run_gloo(_untied_moments, world, ep)


def test_tied_head_stays_in_the_root():
    run_gloo(_tied_in_root, 2, 1)


def _chunked_head_trains_alike(rank, world, ep):
    """The loss head in row chunks (loss_chunked.py) under FSDP2: its dW, computed in the
    forward and returned in the backward, is reduce-scattered as the whole head's is; the
    steps match the whole head's to rounding."""
    from moegraph_cli.train.trainer import batches

    runs = {}
    for chunk in (0, 12):  # 32 rows a rank: chunks of 12, 12 and 8
        model, trainer = _build(world, ep, [f"run.loss_chunk={chunk}"])
        assert model.loss_chunk == chunk
        mine = batches(128, 2, 16, 3, "cpu", rank=rank, world=world)
        losses = [trainer.step(next(mine)).item() for _ in range(2)]
        runs[chunk] = (losses, [p.full_tensor().detach().clone() for p in model.parameters()])
    assert runs[12][0] == pytest.approx(runs[0][0], rel=1e-5)
    for a, b in zip(runs[12][1], runs[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_chunked_head_under_fsdp_trains_like_the_whole_head(world):
    run_gloo(_chunked_head_trains_alike, world, 1)
