"""The order the planner adds recompute in (models/common/recompute.py; its cost: costs.py).

The ladder. `run.recompute: auto` starts every MoE layer of the permute-free experts at
`keep` (FC1's activation kept too: nothing recomputed) and lets the planner add recompute one
layer at a time along a fixed ladder, cheapest memory first: `keep` back to `none` on each
MoE layer (dA recomputes the activation: free in the time model, costs.py); then the stage
(fc1 on every MoE layer, attn on every layer) that frees more bytes per ms of extra time
first, then the other, then full recompute of the MoE / MLP scopes (which supersedes fc1). For
any capture choice the planner takes the shortest prefix of the ladder that fits the budget:
the activation kept where the budget leaves room, recompute only where the budget needs it.
A forced `run.recompute` (attn, moe, full, fc1, attn+fc1, keep) fixes every layer's modes
instead, and `none` allows none.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.run import RECOMPUTE
from .costs import recompute_ms
from .scope_memory import recomputed
from .simulation import StepModel

@dataclass(frozen=True)
class Step:
    scope: int  # index into model.scopes
    mode: str  # the scope's mode from this step on
    ms: float  # the extra time this step adds (over the scope's previous mode)


def _freed(model: StepModel, kind: str, mode: str, before: str = "none") -> int:
    m = model.kinds[kind]
    return recomputed(m, before).saved - recomputed(m, mode).saved


def ladder(model: StepModel, request: str) -> tuple[tuple[str, ...], list[Step]]:
    """(the modes every plan starts from, the steps `auto` may add in order)."""
    scopes = model.scopes
    if request != "auto":
        forced = RECOMPUTE[request]
        return tuple(forced.get(r.kind, "none") for r in scopes), []
    kept = {i for i, r in enumerate(scopes)
            if r.kind == "moe" and model.kinds["moe"].keep_saved > 0}
    base = tuple("keep" if i in kept else "none" for i in range(len(scopes)))
    steps = [Step(i, "none", 0.0) for i in sorted(kept)]
    stages = {"fc1": [i for i, r in enumerate(scopes) if r.kind == "moe"
                      and model.kinds["moe"].fc1_saved > 0],
              "attn": [i for i, r in enumerate(scopes) if r.kind == "attn"]}

    def efficiency(name: str) -> float:
        kind, mode = ("moe", "fc1") if name == "fc1" else ("attn", "full")
        ms = recompute_ms(model, kind, mode, True)
        return _freed(model, kind, mode) / ms if ms > 0 else 0.0

    order = sorted((s for s in stages if stages[s]), key=lambda s: -efficiency(s))
    for name in order:
        for i in stages[name]:
            kind = scopes[i].kind
            mode = "fc1" if name == "fc1" else "full"
            steps.append(Step(i, mode, recompute_ms(model, kind, mode, True)))
    fc1 = set(stages["fc1"])
    for i, r in enumerate(scopes):  # full recompute of the MoE / MLP scopes, last
        if r.kind in ("moe", "mlp"):
            before = "fc1" if i in fc1 else "none"
            steps.append(Step(i, "full", recompute_ms(model, r.kind, "full", True)
                              - recompute_ms(model, r.kind, before, True)))
    return base, steps


def modes_at(base: tuple[str, ...], steps: list[Step], n: int) -> tuple[str, ...]:
    """The per-scope modes after the first `n` steps of the ladder."""
    modes = list(base)
    for s in steps[:n]:
        modes[s.scope] = s.mode
    return tuple(modes)


def cost_ms(model: StepModel, modes: tuple[str, ...], captured) -> float:
    """The extra time of these recompute modes, given which scopes are captured."""
    return sum(recompute_ms(model, r.kind, m, c)
               for r, m, c in zip(model.scopes, modes, captured))
