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
