"""The decoder-only MoE language model every family shares; the family builds its layers.

Layer i (built by `cfg.family.decoder_layer`): `h = attn(x)` (input norm + attention +
residual) then `y = ffn(h)` (post norm + MoE or dense MLP + residual). `layers[i].attn` and
`layers[i].ffn` are the graphable scopes; everything else (embedding, final norm, lm head,
loss) stays eager, and is the same for every family.

Loss: next-token cross-entropy in fp32 over labels shifted by one (as HF's ForCausalLMLoss;
computed by loss.linear_cross_entropy without materialising fp32 logits),
plus `router_aux_loss_coef * aux_loss`, where aux_loss pools every MoE layer's statistics
(HF's `load_balancing_loss_func` with `output_router_logits=True`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...config import DEFAULT_PROFILE, ModelConfig, MoeConfig, load_profile, read_hf_config
from .loss import LmHead, causal_shift, head_loss
from ...moe.routing import aux_loss_from_stats
from .embedding import Embedding
from .norm import RMSNorm
from .rope import rope_cos_sin

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class ModelOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None
    aux_loss: torch.Tensor | None


class DecoderLayer(nn.Module):
    """One layer: the `attn` scope, then the `moe` scope (`is_moe`) or the dense `mlp` scope;
    the attribute names are the state dict's (`layers.{i}.moe.w_gate_up`)."""

    def __init__(self, layer_idx: int, attn: nn.Module, ffn: nn.Module, is_moe: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = is_moe
        self.attn = attn
        if is_moe:
            self.moe = ffn
        else:
            self.mlp = ffn

    @property
    def ffn(self) -> nn.Module:
        """The layer's second scope: `moe`, or `mlp` for a dense layer."""
        return self.moe if self.is_moe else self.mlp

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(layer output, the MoE layer's [2, E] router statistics or None). The statistics
        are an output, not a side channel: FSDP2 re-gathers a layer's parameters when a
        gradient reaches one of its outputs, and the aux loss's gradient reaches the router
        through them."""
        h_BSH = self.attn(x_BSH)
        if self.is_moe:
            return self.ffn(h_BSH)
        return self.ffn(h_BSH), None


class MoeCausalLM(nn.Module):
    """The model of any family (`cfg.model_type`). `ep` (moe/ep.EpGroup): build only this expert-parallel rank's experts. `aux_reduce`, when
    set (distributed data parallel), sums the pooled router statistics over all ranks
    (differentiably) and `aux_world` scales the token count, so the aux loss is the one of the
    global batch, as a single process computes it."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig | None = None, ep=None):
        super().__init__()
        self.config = cfg.validate()
        self.moe_config = (moe or MoeConfig()).validate()
        self.aux_reduce = None
        self.aux_world = 1
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        family = cfg.family
        self.layers = nn.ModuleList(family.decoder_layer(cfg, self.moe_config, i, ep)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else \
            LmHead(cfg.hidden_size, cfg.vocab_size)
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # Rows a chunk of the loss-only head (loss_chunked.py) when no logits are kept; 0: the
        # whole [T, V] logits at once. Set from run.loss_chunk (train/runspec.build_model).
        self.loss_chunk = 0

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: ModelConfig, moe: MoeConfig | None = None, seed: int = 0,
                    dtype: torch.dtype | str = torch.bfloat16, device="cpu") -> "MoeCausalLM":
        """Seeded random weights (HF's init: N(0, initializer_range), norms at one), the same
        values a sharded model gets from `seeded_init_` (drawn in fp32, cast to dtype)."""
        from .init import seeded_init_

        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        with torch.device("meta"):
            model = cls(cfg, moe).to(dtype)
        model.to_empty(device=device)
        seeded_init_(model, seed, cfg.initializer_range)
        return model

    @classmethod
    def from_profile(cls, name: str = DEFAULT_PROFILE, seed: int | None = None,
                     dtype: torch.dtype | str | None = None, device="cpu",
                     overrides: list[str] | None = None) -> "MoeCausalLM":
        prof = load_profile(name, overrides)
        return cls.from_config(prof.model, prof.moe, prof.run.seed if seed is None else seed,
                               dtype or prof.run.dtype, device)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device="cpu", moe: MoeConfig | None = None,
                        check_finite: bool = False) -> "MoeCausalLM":
        """The model of an HF checkpoint; `check_finite` refuses NaN or infinite weights
        (io/checkpoint.py load_state_dict)."""
        from ...io.checkpoint import load_state_dict

        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        cfg = read_hf_config(path)
        state = load_state_dict(path, cfg, dtype=dtype, device=device,
                                check_finite=check_finite)
        with torch.device("meta"):
            model = cls(cfg, moe)
        model.load_state_dict(state, assign=True, strict=True)
        for module in model.modules():  # non-persistent buffers (counters) are not loaded
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_meta:
                    module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype,
                                                        device=device)
        return model

    # -- forward ----------------------------------------------------------------------------
    def rope_tables(self, seq_len: int, dtype: torch.dtype, device) -> None:
        """Give each attention scope cos/sin for this length. Tables are cached per length and
        never freed, so a graph captured at one length keeps reading valid tables."""
        key = (seq_len, dtype, str(device))
        if key not in self._rope_cache:
            c = self.config
            self._rope_cache[key] = rope_cos_sin(seq_len, c.head_dim, c.rope_theta, dtype,
                                                 device, c.rope_scaling,
                                                 c.max_position_embeddings)
        for layer in self.layers:
            layer.attn.rope = self._rope_cache[key]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                keep_logits: bool = True) -> ModelOutput:
        """Logits, and with `labels` the loss (loss.linear_cross_entropy: the lm head and the
        fp32 cross-entropy without fp32 [tokens, vocab] logits) plus the weighted aux loss.
        `keep_logits=False` (the trainers): the loss's backward overwrites the logits' buffer
        with their gradient, or with `loss_chunk` > 0 the head runs in chunks of that many
        rows and holds no [T, V] logits (loss_chunked.py); no logits are returned."""
        x_BSH = self.embed_tokens(input_ids)
        self.rope_tables(input_ids.shape[1], x_BSH.dtype, x_BSH.device)
        aux_stats: list[torch.Tensor] = []
        for layer in self.layers:
            x_BSH, stats_2E = layer(x_BSH)
            if stats_2E is not None:
                aux_stats.append(stats_2E)
        x_BSH = self.norm(x_BSH)
        aux = None
        if aux_stats:
            aux = aux_loss_from_stats(aux_stats, input_ids.numel() * self.aux_world,
                                      self.aux_reduce)
        shifted = None if labels is None else causal_shift(labels.to(x_BSH.device))
        chunk = 0 if keep_logits else self.loss_chunk
        if self.lm_head is None:  # tied: the embedding's weight
            loss, logits = head_loss(x_BSH, self.embed_tokens.weight, shifted,
                                     inplace_backward=not keep_logits, chunk_rows=chunk)
        else:
            loss, logits = self.lm_head(x_BSH, shifted, inplace_backward=not keep_logits,
                                        chunk_rows=chunk)
        if loss is not None:
            if not keep_logits:
                logits = None
            if aux is not None:
                loss = loss + self.config.router_aux_loss_coef * aux
        return ModelOutput(logits=logits, loss=loss, aux_loss=aux)

    def scopes(self) -> list[tuple[str, int, str, nn.Module]]:
        """(name, layer, kind, module) of every graphable scope, in execution order."""
        out = []
        for layer in self.layers:
            i = layer.layer_idx
            out.append((f"layers.{i}.attn", i, "attn", layer.attn))
            out.append((f"layers.{i}.{'moe' if layer.is_moe else 'mlp'}", i,
                        "moe" if layer.is_moe else "mlp", layer.ffn))
        return out


def causal_lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                   ignore_index: int = -100) -> torch.Tensor:
    """HF's ForCausalLMLoss: fp32 logits, labels shifted left by one, mean over kept tokens."""
    shift = F.pad(labels_BS, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(logits_BSV.float().reshape(-1, logits_BSV.shape[-1]),
                           shift.reshape(-1).to(logits_BSV.device), ignore_index=ignore_index)
