import torch

from moegraph_cli.models import MoeCausalLM
from moegraph_cli.train.trainer import batches, train

SMALL = ["model.vocab_size=256", "model.hidden_size=64", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.head_dim=16", "model.moe_intermediate_size=32"]


def test_thirty_steps_on_a_fixed_batch_bring_the_loss_down():
    model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32, overrides=SMALL)
    it = batches(256, 2, 32, seed=0, device="cpu", fixed=True)
    losses = train(model, it, steps=30, lr=3e-3)
    assert losses[-1] < 0.5 * losses[0], losses


def test_lr0_leaves_every_parameter_bit_identical():
    model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.bfloat16, overrides=SMALL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = train(model, batches(256, 2, 32, seed=0, device="cpu"), steps=3, lr=0.0)
    assert all(l == l for l in losses)
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(before[k].view(torch.int16), after[k].view(torch.int16)) for k in before)


def test_synthetic_batches_repeat_per_seed_and_step():
    a = [next(it) for it in [batches(100, 2, 8, 5, "cpu")] for _ in range(3)]
    b = [next(it) for it in [batches(100, 2, 8, 5, "cpu")] for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])


def test_token_file_batches(tmp_path):
    tokens = torch.arange(200) % 97
    torch.save(tokens, tmp_path / "t.pt")
    it = batches(100, 2, 8, 0, "cpu", data=str(tmp_path / "t.pt"))
    first = next(it)
    assert first.shape == (2, 8) and torch.equal(first.reshape(-1), tokens[:16])
    import struct
    (tmp_path / "t.bin").write_bytes(struct.pack(f"<{tokens.numel()}H", *tokens.tolist()))
    second = next(batches(100, 2, 8, 0, "cpu", data=str(tmp_path / "t.bin")))
    assert torch.equal(second, first)


def test_the_trainers_one_pass_loss_gives_the_two_pass_gradients_bit_for_bit(monkeypatch):
    """Trainer passes loss_grad = 1 / grad_accum (the loss's dlogits in its forward); the
    gradients are those of the two-pass loss the model computes without it."""
    from moegraph_cli import grads
    from moegraph_cli.train.trainer import Trainer
    from moegraph_kernels import cross_entropy as ce

    scales = []
    fused = ce.cross_entropy_fused_ref
    monkeypatch.setattr(ce, "cross_entropy_fused_ref",
                        lambda *a: scales.append(a[3]) or fused(*a))
    ids = next(batches(256, 4, 16, seed=1, device="cpu"))
    for accum in (1, 2):
        model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.bfloat16,
                                         overrides=SMALL)
        trainer = Trainer(model, lr=0.0, grad_accum=accum)
        scales.clear()
        loss = trainer.forward_backward(ids)
        assert scales == [1.0 / accum] * accum, scales
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=False)
        total = 0.0
        for i, micro in enumerate(ids.chunk(accum)):
            part = model(micro, labels=micro, keep_logits=False).loss / accum
            with grads.backward_pass(accumulate=i > 0):
                part.backward()
            total = total + part.detach()
        assert torch.equal(loss, total)
        for n, p in model.named_parameters():
            assert torch.equal(got[n], p.grad), (accum, n)


def test_loss_grad_needs_keep_logits_off():
    import pytest

    model = MoeCausalLM.from_profile("tiny-qwen3-moe", dtype=torch.float32, overrides=SMALL)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="loss_grad needs keep_logits=False"):
        model(ids, labels=ids, loss_grad=1.0)
