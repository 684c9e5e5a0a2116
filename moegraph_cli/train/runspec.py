"""Resolve what a command runs on: a profile (by name or YAML path) or a checkpoint directory,
with `--set` overrides, and the device; then build the model from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.run import RECOMPUTE
from ..config import DEFAULT_PROFILE, Profile, load_profile, profile_from_model, read_hf_config
from ..errors import NotCapturableError, UsageError

if TYPE_CHECKING:
    import torch


@dataclass
class RunSpec:
    profile: Profile
    checkpoint: Path | None
    source: str
    warnings: list[str] = field(default_factory=list)  # one line each, for stderr


def resolve(profile: str | None = None, checkpoint: str | None = None,
            overrides: list[str] | None = None) -> RunSpec:
    """A checkpoint gives the architecture (its config.json); the profile (default: the
    built-in one) gives the run and moe settings. When both are named and the profile's model
    section disagrees with config.json, the spec carries a one-line warning saying where."""
    overrides = list(overrides or [])
    if checkpoint:
        path = Path(checkpoint)
        if not path.is_dir():
            raise UsageError(f"checkpoint {checkpoint}: not a directory")
        bad = [o for o in overrides if o.strip().startswith("model.")]
        if bad:
            raise UsageError(f"--set {bad[0]!r}: a checkpoint fixes the model; "
                             "override run.* or moe.* instead")
        cfg = read_hf_config(path)
        prof = profile_from_model(cfg, name=path.name, overrides=overrides,
                                  base=profile or DEFAULT_PROFILE)
        if not profile:
            return RunSpec(prof, path, f"checkpoint {path}")
        differ = _model_differences(load_profile(profile).model, cfg)
        warnings = [] if not differ else [
            f"profile {profile}'s model section differs from {path / 'config.json'} on "
            + ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
            + "; the architecture is the checkpoint's, the run settings the profile's"]
        return RunSpec(prof, path, f"checkpoint {path}, run settings of profile {profile}",
                       warnings)
    name = profile or DEFAULT_PROFILE
    return RunSpec(load_profile(name, overrides), None, f"profile {name}")


def _model_differences(from_profile, from_checkpoint) -> list[str]:
    return [f"{f.name} (profile {getattr(from_profile, f.name)!r}, checkpoint "
            f"{getattr(from_checkpoint, f.name)!r})"
            for f in dataclasses.fields(from_profile)
            if getattr(from_profile, f.name) != getattr(from_checkpoint, f.name)]


def pick_device(name: str = "auto", need_cuda: bool = False) -> torch.device:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise NotCapturableError("no CUDA device: this command needs an NVIDIA GPU")
    if need_cuda and not name.startswith("cuda"):
        raise NotCapturableError("no CUDA device: this command needs an NVIDIA GPU")
    return torch.device(name)


def build_model(spec: RunSpec, device: torch.device, seed: int | None = None, rt=None,
                plan=None):
    """The model of this process: whole, or (distributed, `rt`) this rank's shard, with
    run.recompute set on every layer, or, with a plan (plan/planfile.Plan), each layer's, and
    the loss head's chunk rows (run.loss_chunk, or the plan's).
    Weights from a checkpoint are refused if any is NaN or infinite (one line naming the HF
    tensor): capture, profile and verify all build their model here."""
    from ..models.common.recompute import set_recompute

    prof = spec.profile
    if rt is not None:
        from ..distributed.model import build_sharded_model
        model = build_sharded_model(spec, rt, seed)
    elif spec.checkpoint is not None:
        from ..models import MoeCausalLM
        model = MoeCausalLM.from_pretrained(spec.checkpoint, dtype=prof.run.dtype,
                                            device=device, moe=prof.moe, check_finite=True)
    else:
        from ..models import MoeCausalLM
        model = MoeCausalLM.from_config(prof.model, prof.moe,
                                        prof.run.seed if seed is None else seed,
                                        prof.run.dtype, device)
    modes = RECOMPUTE[prof.run.recompute]
    if plan is not None:
        set_recompute(model, plan.layer_recompute())
    elif modes:
        set_recompute(model, {i: modes for i in range(len(model.layers))})
    model.loss_chunk = loss_chunk_rows(prof.run.loss_chunk, plan)
    return model


def loss_chunk_rows(setting, plan=None) -> int:
    """Rows a chunk of the loss-only head (0: the logits whole): a plan's choice, else
    run.loss_chunk, where `auto` without a plan is 0."""
    if plan is not None:
        return plan.loss_chunk()
    return 0 if setting == "auto" else int(setting)
