"""Resolve what a command runs on: a profile (by name or YAML path) or a checkpoint directory,
with `--set` overrides, and the device; then build the model from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DEFAULT_PROFILE, Profile, load_profile, profile_from_model, read_hf_config
from .errors import NotCapturableError, UsageError


@dataclass
class RunSpec:
    profile: Profile
    checkpoint: Path | None
    source: str


def resolve(profile: str | None = None, checkpoint: str | None = None,
            overrides: list[str] | None = None) -> RunSpec:
    overrides = list(overrides or [])
    if profile and checkpoint:
        raise UsageError("give either --profile or a checkpoint directory, not both")
    if checkpoint:
        path = Path(checkpoint)
        if not path.is_dir():
            raise UsageError(f"checkpoint {checkpoint}: not a directory")
        bad = [o for o in overrides if o.strip().startswith("model.")]
        if bad:
            raise UsageError(f"--set {bad[0]!r}: a checkpoint fixes the model; "
                             "override run.* or moe.* instead")
        cfg = read_hf_config(path)
        prof = profile_from_model(cfg, name=path.name, overrides=overrides)
        return RunSpec(prof, path, f"checkpoint {path}")
    name = profile or DEFAULT_PROFILE
    return RunSpec(load_profile(name, overrides), None, f"profile {name}")


def pick_device(name: str = "auto", need_cuda: bool = False) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise NotCapturableError("no CUDA device: this command needs an NVIDIA GPU")
    if need_cuda and not name.startswith("cuda"):
        raise NotCapturableError("no CUDA device: this command needs an NVIDIA GPU")
    return torch.device(name)


def build_model(spec: RunSpec, device: torch.device, seed: int | None = None, rt=None):
    """The model of this process: whole, or (distributed, `rt`) this rank's shard."""
    if rt is not None:
        from .dist.model import build_sharded_model
        return build_sharded_model(spec, rt, seed)
    from .model import Qwen3MoeModel

    prof = spec.profile
    if spec.checkpoint is not None:
        return Qwen3MoeModel.from_pretrained(spec.checkpoint, dtype=prof.run.dtype,
                                             device=device, moe=prof.moe)
    return Qwen3MoeModel.from_config(prof.model, prof.moe,
                                     prof.run.seed if seed is None else seed,
                                     prof.run.dtype, device)
