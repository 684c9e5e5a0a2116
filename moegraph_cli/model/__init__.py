"""Qwen3-MoE model: decoder layers built from graphable scopes."""

from .qwen3_moe import DTYPES, ModelOutput, Qwen3MoeModel, causal_lm_loss

__all__ = ["DTYPES", "ModelOutput", "Qwen3MoeModel", "causal_lm_loss"]
