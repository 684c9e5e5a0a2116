"""Run keys: what a plan, a calibration or a savings file is valid for (the run's profile,
batch, seq_len, dtype, MoE mode and capacity factor, the model's config hash, and its ranks),
how one read from a file is checked, and how two are compared and described."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from ..config import Profile
from ..io.documents import at, is_int, is_number, show
from ..errors import UsageError


def model_hash(prof: Profile) -> str:
    """Identity of the model architecture (every config.json field), 16 hex digits."""
    text = json.dumps(dataclasses.asdict(prof.model), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_key(prof: Profile, world: int = 1, ep: int = 1) -> dict:
    """What a plan, a calibration or a savings file is valid for: the run, and its ranks
    (`world` processes, `ep`-way expert parallel; batch is per rank)."""
    return {"profile": prof.name, "batch": prof.run.batch, "seq_len": prof.run.seq_len,
            "dtype": prof.run.dtype, "moe_mode": prof.moe.mode,
            "capacity_factor": prof.moe.capacity, "model_hash": model_hash(prof),
            "world": world, "ep": ep}


def check_key(key, where: str, field: str = "key") -> dict:
    """A key read from a plan, savings or calibration file (`where`, e.g. "plan p.yaml"; the
    key is its `field`), checked field by field against run_key's types. world and ep may be
    absent: files written before distributed runs are one process."""
    if not isinstance(key, dict):
        raise UsageError(f"{where}: {field} must be a mapping of the run's batch, seq_len, "
                         f"dtype, moe_mode and model_hash, got {show(key)}")
    positive = (lambda v: is_int(v) and v > 0, "a positive integer")
    text = (lambda v: isinstance(v, str) and v.isprintable(), "a one-line string")
    rules = {"batch": positive, "seq_len": positive, "dtype": text, "moe_mode": text,
             "model_hash": text, "profile": text,
             "capacity_factor": (lambda v: v is None or is_number(v), "a number or null"),
             "world": (lambda v: v is None or positive[0](v), "a positive integer"),
             "ep": (lambda v: v is None or positive[0](v), "a positive integer")}
    for name, (ok, what) in rules.items():
        if name not in key:
            if name in ("batch", "seq_len", "dtype", "moe_mode", "model_hash"):
                raise UsageError(f"{at(where, key)}: {field} has no {name!r}")
        elif not ok(key[name]):
            raise UsageError(f"{at(where, key, name)}: {field}.{name} must be {what}, got "
                             f"{show(key[name])}")
    return key


def ranks_of(key: dict) -> tuple[int, int]:
    """(world, ep) of a key; files written before distributed runs have neither: (1, 1)."""
    return int(key.get("world") or 1), int(key.get("ep") or 1)


def same_run(a: dict, b: dict) -> bool:
    """Keys equal except the profile name (a checkpoint's name is its directory)."""
    fields = ("batch", "seq_len", "dtype", "moe_mode", "capacity_factor", "model_hash")
    return all(a.get(f) == b.get(f) for f in fields) and ranks_of(a) == ranks_of(b)


def describe_ranks(key: dict) -> str:
    world, ep = ranks_of(key)
    return "one process" if (world, ep) == (1, 1) else f"--nproc {world} --ep {ep}"


def describe_key(key: dict) -> str:
    mode = key.get("moe_mode")
    if key.get("capacity_factor") is not None:
        mode = f"{mode} {key['capacity_factor']}"
    ranks = "" if ranks_of(key) == (1, 1) else f", {describe_ranks(key)}"
    return (f"{key.get('profile')} (batch {key.get('batch')}, seq_len {key.get('seq_len')}, "
            f"{key.get('dtype')}, {mode}, model {key.get('model_hash')}{ranks})")
