"""seeded_init_: one full model for a seed, whatever the world size, FSDP sharding or expert
range; from_config gives the same values."""

from __future__ import annotations

import hashlib

import pytest
import torch
from gloo_util import run_gloo
from sharded_util import expert_ranges, fsdp_model, gathered, meta_model, tiny_cfg

from moegraph_cli.models import MoeCausalLM
from moegraph_cli.models.common.init import is_expert_stack, seeded_init_

STD = 0.02


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def test_same_seed_same_weights_other_seed_other_weights_norms_one():
    cfg = tiny_cfg()
    a = params(MoeCausalLM.from_config(cfg, seed=3, dtype=torch.float32))
    b = params(MoeCausalLM.from_config(cfg, seed=3, dtype=torch.float32))
    c = params(MoeCausalLM.from_config(cfg, seed=4, dtype=torch.float32))
    norms = [n for n in a if n.endswith("norm.weight")]
    assert len(norms) == 1 + 4 * cfg.num_hidden_layers  # final; input, q, k, post per layer
    for name in a:
        assert torch.equal(bits(a[name]), bits(b[name])), name
        if name in norms:
            assert torch.equal(a[name], torch.ones_like(a[name])), name
        else:
            assert not torch.equal(a[name], c[name]), name
            assert 0.01 < a[name].std().item() < 0.03, name


def test_a_parameter_draws_from_its_own_documented_generator():
    """embed_tokens.weight is N(0, std) from sha256('{seed}/embed_tokens.weight'), and expert e
    of a stack from sha256('{seed}/{name}/{e}'): reproducible outside moegraph."""
    model = params(MoeCausalLM.from_config(tiny_cfg(), seed=11, dtype=torch.float32))

    def drawn(shape, key: str) -> torch.Tensor:
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)
        gen = torch.Generator().manual_seed(seed)
        return torch.empty(shape).normal_(0.0, STD, generator=gen)

    embed = model["embed_tokens.weight"]
    assert torch.equal(embed, drawn(embed.shape, "11/embed_tokens.weight"))
    stack = model["layers.2.moe.w_down"]
    assert torch.equal(stack[5], drawn(stack.shape[1:], "11/layers.2.moe.w_down/5"))


def test_values_do_not_depend_on_the_other_parameters():
    """Making layer 0 dense and tying the head leaves every parameter both models have as is."""
    a = params(MoeCausalLM.from_config(tiny_cfg(), seed=5, dtype=torch.float32))
    b = params(MoeCausalLM.from_config(tiny_cfg(mlp_only_layers=[0, 1],
                                                tie_word_embeddings=True),
                                       seed=5, dtype=torch.float32))
    shared = set(a) & set(b)
    assert "layers.2.moe.w_gate_up" in shared and "lm_head.weight" not in shared
    assert "layers.0.moe.w_gate_up" in a and "layers.0.mlp.up_proj.weight" in b
    for name in shared:
        assert torch.equal(bits(a[name]), bits(b[name])), name


def test_bf16_is_the_rounded_fp32_model():
    cfg = tiny_cfg()
    fp32 = params(MoeCausalLM.from_config(cfg, seed=2, dtype=torch.float32))
    bf16 = params(MoeCausalLM.from_config(cfg, seed=2, dtype=torch.bfloat16))
    for name, p in bf16.items():
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(bits(p), bits(fp32[name].to(torch.bfloat16))), name


@pytest.mark.parametrize("expert_range", [(2, 6), (0, 1), (7, 8)])
def test_local_experts_are_the_full_models_slice(expert_range):
    cfg = tiny_cfg()
    full = params(MoeCausalLM.from_config(cfg, seed=9, dtype=torch.float32))
    local = meta_model(cfg, expert_range).to_empty(device="cpu")
    seeded_init_(local, 9, cfg.initializer_range, expert_range=expert_range)
    lo, hi = expert_range
    for name, p in local.named_parameters():
        want = full[name][lo:hi] if is_expert_stack(name) else full[name]
        assert p.shape == want.shape and torch.equal(bits(p), bits(want)), name


def test_meta_parameters_and_a_wrong_expert_count_are_refused():
    cfg = tiny_cfg()
    with pytest.raises(ValueError, match="embed_tokens.weight is on the meta device"):
        seeded_init_(meta_model(cfg), 0, STD)
    local = meta_model(cfg, (2, 6)).to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"layers.0.moe.w_gate_up holds 4 experts but "
                                         r"expert_range is \(2, 5\)"):
        seeded_init_(local, 0, STD, expert_range=(2, 5))


def _fsdp_init_equals_full_model(rank: int, world: int, seed: int) -> None:
    from torch.distributed.tensor import DTensor

    cfg = tiny_cfg()
    lo, hi = expert_ranges(cfg.num_experts, world)[rank]
    model = fsdp_model(cfg, expert_range=(lo, hi))
    seeded_init_(model, seed, cfg.initializer_range, expert_range=(lo, hi))
    sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    local_rows = {n: p.to_local().shape[0] for n, p in model.named_parameters() if n in sharded}
    got = gathered(model)  # collective: before any assert
    full = params(MoeCausalLM.from_config(cfg, seed=seed, dtype=torch.float32))
    assert sharded == {n for n in full if not is_expert_stack(n)}
    if world == 3:  # the uneven chunks the config is built for, as FSDP2 laid them out
        assert local_rows["embed_tokens.weight"] == [23, 23, 21][rank]
        assert local_rows["layers.0.attn.q_norm.weight"] == [2, 2, 0][rank]
    for name, p in got.items():
        want = full[name][lo:hi] if is_expert_stack(name) else full[name]
        assert p.shape == want.shape and torch.equal(bits(p), bits(want)), (rank, name)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_shards_and_expert_ranges_give_the_full_model(world):
    run_gloo(_fsdp_init_equals_full_model, world, 13)
