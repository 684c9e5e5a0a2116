"""Which gated activation the experts apply (an immutable value both expert paths take), and
the check of the optional expert extras (biases, activation) both paths run.

- `swiglu` (the default, `SWIGLU`): act = silu(gate) * up (Qwen3-MoE, Mixtral, OLMoE, ...).
- `clamped_swiglu` (GPT-OSS): gate = min(gate, limit); up = clamp(up, -limit, limit);
  act = (up + 1) * gate * sigmoid(alpha * gate). Backward follows torch's clamp: the gradient
  passes where min <= x <= max (the gate has only a max).
gate and up are the first and last F columns of FC1's output (the [gate | up] halves layout;
a checkpoint loader de-interleaves GPT-OSS's interleaved columns into it). The math lives in
kernels/gated_act.py (Triton) and moe/reference.gated_act (torch); this is only the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("swiglu", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertAct:
    """kind 'swiglu' takes no parameters; 'clamped_swiglu' needs alpha and limit (> 0)."""
    kind: str = "swiglu"
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"ExpertAct: kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "swiglu":
            if self.alpha is not None or self.limit is not None:
                raise ValueError("ExpertAct: kind 'swiglu' takes no alpha or limit")
            return
        if self.alpha is None or self.limit is None:
            raise ValueError("ExpertAct: kind 'clamped_swiglu' needs both alpha and limit")
        if not math.isfinite(self.alpha) or not (math.isfinite(self.limit) and self.limit > 0):
            raise ValueError(f"ExpertAct: clamped_swiglu needs a finite alpha and a finite "
                             f"limit > 0, got alpha={self.alpha}, limit={self.limit}")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "limit", float(self.limit))

    @property
    def clamp(self) -> tuple[float, float] | None:
        """(alpha, limit) for the kernels' clamped variant, None for plain SwiGLU."""
        return None if self.kind == "swiglu" else (self.alpha, self.limit)


SWIGLU = ExpertAct()


def check_expert_extras(w_gate_up_EFH, w_down_EHF, b_gate_up_EF2, b_down_EH, act) -> None:
    """The optional biases must be [E, 2F] and [E, H] on the weights' device; act an ExpertAct."""
    if not isinstance(act, ExpertAct):
        raise TypeError(f"experts: act must be an ExpertAct, got {type(act).__name__}")
    num_experts, two_f, hidden = w_gate_up_EFH.shape
    for name, b, want in (("b_gate_up", b_gate_up_EF2, (num_experts, two_f)),
                          ("b_down", b_down_EH, (num_experts, hidden))):
        if b is None:
            continue
        if tuple(b.shape) != want:
            raise ValueError(f"experts: {name} has shape {list(b.shape)}, the expert weights "
                             f"need {list(want)}")
        if b.device != w_gate_up_EFH.device or not b.is_floating_point():
            raise ValueError(f"experts: {name} must be a floating tensor on "
                             f"{w_gate_up_EFH.device}, got {b.dtype} on {b.device}")


def clamped_swiglu(limit: float = 7.0, alpha: float = 1.702) -> ExpertAct:
    """GPT-OSS's activation (transformers' GptOssExperts defaults: limit 7.0, alpha 1.702)."""
    return ExpertAct("clamped_swiglu", alpha=alpha, limit=limit)
