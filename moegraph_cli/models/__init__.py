"""Model families over shared parts.

- registry.py: `model_type` -> Family; every other module here is one family (config.json
  fields, checkpoint key map, layer shapes, decoder layer): qwen3_moe.py, mixtral.py, ...
- common/: the shared parts: attention variants, norms, rope, linear, MoE and dense scopes,
  seeded init, key-map pieces, parameter shapes (shapes.py: `param_shapes`, torch-free), and
  the decoder-only model (`MoeCausalLM`) all families share.

`from_pretrained(path)` picks the family from config.json's model_type, `from_profile(name)`
from the profile's `model.model_type`. This package imports torch only when a model is built.
"""

from __future__ import annotations

from .registry import Family, families, family_of, supported_types

__all__ = ["Family", "families", "family_of", "supported_types", "from_pretrained",
           "from_profile", "MoeCausalLM", "ModelOutput", "DTYPES", "causal_lm_loss"]


def from_pretrained(path, dtype=None, device="cpu", moe=None, check_finite=False):
    """The model of an HF checkpoint directory (any supported family); `check_finite` refuses
    NaN or infinite weights."""
    from .common.decoder import MoeCausalLM

    return MoeCausalLM.from_pretrained(path, dtype=dtype, device=device, moe=moe,
                                       check_finite=check_finite)


def from_profile(name: str | None = None, seed: int | None = None, dtype=None, device="cpu",
                 overrides: list[str] | None = None):
    """The seeded model of a profile (any supported family)."""
    from ..config import DEFAULT_PROFILE
    from .common.decoder import MoeCausalLM

    return MoeCausalLM.from_profile(name or DEFAULT_PROFILE, seed=seed, dtype=dtype,
                                    device=device, overrides=overrides)


def __getattr__(name: str):
    if name in ("MoeCausalLM", "ModelOutput", "DTYPES", "causal_lm_loss"):
        from .common import decoder

        return getattr(decoder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
