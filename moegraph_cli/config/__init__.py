"""Configs: the model (HF config.json fields), the run, the MoE settings, and profiles.

A profile is a YAML file in profiles/ with three sections: `model` (HF config.json field
names), `run` (batch, seq_len, steps, dtype, seed, ...), and `moe` (dispatch mode and backend).
`--set section.field=value` overrides any field with type checking.

`model.model_type` names the architecture family (models/<family>.py); config.json is read
through that family, which maps its HF field names to ModelConfig's and back: both spellings
transformers 4.x and 5.x write (`num_experts` / `num_local_experts`, `rope_theta` /
`rope_parameters`). The rope fields, which every family spells alike, are read in model.py.

The parts: model.py (ModelConfig and config.json), run.py (the run and moe sections),
profile.py (profiles and `--set`), fields.py (field types, type checks, numeric bounds).
"""

from .fields import MAX_INT, MAX_SEED
from .model import ModelConfig, read_hf_config
from .profile import (DEFAULT_PROFILE, SECTIONS, Profile, apply_overrides, load_profile,
                      profile_from_model, profile_names)
from .run import MoeConfig, RunConfig

__all__ = [
    "DEFAULT_PROFILE", "MAX_INT", "MAX_SEED", "SECTIONS", "ModelConfig", "MoeConfig", "Profile",
    "RunConfig", "apply_overrides", "load_profile", "profile_from_model", "profile_names",
    "read_hf_config",
]
