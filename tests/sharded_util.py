"""Sharded models on a CPU: a tiny config with uneven sizes, a model whose expert stacks hold
only some experts, the FSDP2 model a gloo rank builds (processes: gloo_util.run_gloo), and
gathering a model back whole."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moegraph_cli.config import ModelConfig
from moegraph_cli.models import MoeCausalLM


def tiny_cfg(**overrides) -> ModelConfig:
    """3 layers, layer 1 dense, 8 experts. Sizes chunk unevenly: vocab 67 rows -> 34/33 on two
    ranks; head_dim 4 (q_norm, k_norm) -> 2/2/0 on three, so one rank holds an empty chunk."""
    fields = dict(vocab_size=67, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                  num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1])
    fields.update(overrides)
    return ModelConfig(**fields).validate()


def expert_ranges(num_experts: int, world: int) -> list[tuple[int, int]]:
    """Contiguous expert ranges, torch.chunk style (8 over 3 -> 0..2, 3..5, 6..7)."""
    step = -(-num_experts // world)
    return [(min(r * step, num_experts), min((r + 1) * step, num_experts)) for r in range(world)]


def meta_model(cfg: ModelConfig, expert_range: tuple[int, int] | None = None,
               dtype=torch.float32) -> MoeCausalLM:
    """The model on the meta device; with expert_range its stacks hold only those experts."""
    with torch.device("meta"):
        model = MoeCausalLM(cfg).to(dtype)
        if expert_range is not None:
            lo, hi = expert_range
            for layer in model.layers:
                if layer.is_moe:
                    moe = layer.moe
                    moe.w_gate_up = nn.Parameter(torch.empty(hi - lo, *moe.w_gate_up.shape[1:],
                                                             dtype=dtype))
                    moe.w_down = nn.Parameter(torch.empty(hi - lo, *moe.w_down.shape[1:],
                                                          dtype=dtype))
    return model


def fsdp_model(cfg: ModelConfig, expert_range: tuple[int, int] | None = None) -> MoeCausalLM:
    """The units the multi-GPU path builds with experts at ep == world, on CPU: meta,
    fully_shard every layer (expert stacks left out), an untied head's embedding and final
    norm + lm head, and the root over a 1-D mesh of the world, then to_empty. Values are
    garbage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = meta_model(cfg, expert_range)
    for layer in model.layers:
        ignored = {layer.moe.w_gate_up, layer.moe.w_down} if layer.is_moe else None
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    if model.lm_head is not None:
        fully_shard(model.embed_tokens, mesh=mesh)
        fully_shard([model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model.to_empty(device="cpu")


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> value, DTensors gathered whole (a collective: every rank must call it)."""
    return {name: p.full_tensor() if isinstance(p, DTensor) else p.detach()
            for name, p in model.named_parameters()}
