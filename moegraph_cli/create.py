"""`moegraph init`: write a Hugging Face-format checkpoint of seeded random weights."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import UsageError
from .runspec import RunSpec, build_model


def create_checkpoint(spec: RunSpec, out_dir: str | Path, seed: int | None = None,
                      max_shard_bytes: int | None = None, force: bool = False) -> dict:
    from .checkpoint import save_checkpoint

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        raise UsageError(f"init: {out} exists and is not empty (use --force to overwrite)")
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(spec, torch.device("cpu"), seed=seed)
    state = model.state_dict()
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    save_checkpoint(state, spec.profile.model, out, **kwargs)
    files = sorted(p.name for p in out.iterdir())
    return {"dir": str(out), "profile": spec.profile.name, "dtype": spec.profile.run.dtype,
            "seed": spec.profile.run.seed if seed is None else seed,
            "params": sum(t.numel() for t in state.values()),
            "bytes": sum(p.stat().st_size for p in out.iterdir()), "files": files}
