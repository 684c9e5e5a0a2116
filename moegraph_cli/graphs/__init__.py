"""CUDA-graph engine: captures any module scope with a declared contract (knows nothing of MoE)."""

from .contract import Contract, TensorSpec
from .pools import STRATEGIES, PoolGroup, capture_order, group_names
from .scope import Counters, GraphedScope
from .session import GraphSession, ScopeSpec

__all__ = ["Contract", "TensorSpec", "STRATEGIES", "PoolGroup", "capture_order", "group_names",
           "Counters", "GraphedScope", "GraphSession", "ScopeSpec"]
