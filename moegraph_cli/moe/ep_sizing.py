"""How many rows an expert-parallel rank sends each peer, and which exchange moves fewer bytes.

Plain arithmetic on the run's shapes (no torch), so the planner can price EP buffers with the
same numbers the dispatch uses (moe/ep.py has the exchange itself and the reasons).

P ranks in the EP group, E experts (E/P on each rank), T tokens per rank, k routes a token.
- `distinct_ranks`: d, the expected number of distinct ranks a token's k distinct experts sit
  on when the router is balanced (every k-subset of experts equally likely):
  d = P * (1 - C(E - E/P, k) / C(E, k)). The with-replacement form P * (1 - (1 - 1/P)^k)
  undercounts (top-k experts are distinct: qwen3-30b-a3b at P = 8, 5.34 against 5.25) and
  min(k, P) is no bound at all once P <= k (it sends every token to every rank).
- `peer_capacity`: C = ceil(factor * T * d / P) rows per (source, destination) pair, at most
  T (a token goes to a rank at most once). A rank receives P * C ~ factor * T * d rows: flat
  in P (d <= k).
- `dispatch_kind`: the all-to-all of C rows a peer moves P * C rows each way; the all-gather
  moves P * T rows in and the P * T partial rows back. `auto` takes the all-to-all only where
  C < T (fewer bytes: the per-row ids and weights scale the same way as the rows); at C = T
  both move the same rows and the all-gather needs no packed send copy.
"""

from __future__ import annotations

import math
from fractions import Fraction

DISPATCH_KINDS = ("auto", "all_gather", "all_to_all")


def _share(ep: int, top_k: int, num_experts: int) -> Fraction:
    """d / P exactly: the chance that a balanced token needs a given rank."""
    local = num_experts // ep
    k = min(top_k, num_experts)
    return 1 - Fraction(math.comb(num_experts - local, k), math.comb(num_experts, k))


def distinct_ranks(ep: int, top_k: int, num_experts: int) -> float:
    """d: the expected distinct destination ranks of a token under balanced routing."""
    return float(ep * _share(ep, top_k, num_experts))


def peer_capacity(tokens: int, top_k: int, ep: int, num_experts: int, factor: float) -> int:
    """C = ceil(factor * T * d / P) rows per (source, destination) pair, between 1 and T.
    Exact rational arithmetic: every rank gets the same C from the same shapes."""
    rows = math.ceil(Fraction(factor) * tokens * _share(ep, top_k, num_experts))
    return max(1, min(tokens, rows))


def dispatch_kind(ep: int, tokens: int, top_k: int, num_experts: int, factor: float,
                  requested: str = "auto") -> str:
    """`all_gather` or `all_to_all` for one MoE call (`requested` overrides `auto`)."""
    if requested not in DISPATCH_KINDS:
        raise ValueError(f"EP dispatch {requested!r} must be one of {', '.join(DISPATCH_KINDS)}")
    if requested != "auto":
        return requested
    fewer = peer_capacity(tokens, top_k, ep, num_experts, factor) < tokens
    return "all_to_all" if fewer else "all_gather"


def received_rows(ep: int, tokens: int, top_k: int, num_experts: int, factor: float,
                  requested: str = "auto") -> int:
    """Rows of H a rank receives (and keeps for the backward) in one MoE call: P * T through
    the all-gather, P * C through the all-to-all."""
    if dispatch_kind(ep, tokens, top_k, num_experts, factor, requested) == "all_gather":
        return ep * tokens
    return ep * peer_capacity(tokens, top_k, ep, num_experts, factor)
