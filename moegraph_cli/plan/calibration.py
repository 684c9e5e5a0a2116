"""Calibration files: per-run measurements that replace the memory model's formulas.

Written by `moegraph profile --calibrate FILE` on a GPU (profile.calibrate measures a one-layer
copy of the model), read by `moegraph plan --calibration FILE`. One file holds entries for
several runs; an entry is found by its key (memory.run_key: batch, seq_len, dtype, MoE mode and
the model's config hash). `.json` files are JSON, anything else YAML.

    moegraph_calibration: 1
    entries:
    - key: {profile, batch, seq_len, dtype, moe_mode, capacity_factor, model_hash}
      gpu: NVIDIA H200   torch: ...   date: ...
      scopes:                       # one layer's scopes, eager fwd+bwd around each
        attn: {saved_bytes, out_bytes, in_grad_bytes, saves_input,
               fwd_peak_bytes,      # max_memory_allocated over the forward, above before
               bwd_peak_bytes,      # over autograd.grad of every input and parameter
               private_pools: [fwd, bwd]}   # per_entry pool bytes of its two graphs
        moe: {...}
      layer_model:                  # the one-layer model
        pools: {shared: B, per_scope: B, per_entry: B}   # pool bytes, memory_snapshot
        eager_peak_reserved: B      # one eager step, peak reserved
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ..errors import UsageError
from .documents import read_document
from .memory import describe_key, same_run

FORMAT = 1


def load_calibration(path: str | Path) -> list[dict]:
    path = Path(path)
    raw = read_document(path, "calibration",
                        "write one with `moegraph profile --calibrate FILE` on a GPU")
    if not isinstance(raw, dict) or raw.get("moegraph_calibration") != FORMAT \
            or not isinstance(raw.get("entries"), list):
        raise UsageError(f"calibration {path}: not a moegraph calibration file "
                         f"(expected moegraph_calibration: {FORMAT} and a list of entries)")
    for i, entry in enumerate(raw["entries"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict) \
                or not isinstance(entry.get("scopes"), dict):
            raise UsageError(f"calibration {path}: entry {i} has no key or scopes")
        for kind, s in entry["scopes"].items():
            for f in ("saved_bytes", "out_bytes", "fwd_peak_bytes", "bwd_peak_bytes"):
                if not isinstance(s, dict) or not isinstance(s.get(f), int):
                    raise UsageError(f"calibration {path}: entry {i} scope {kind} lacks "
                                     f"integer {f}")
    return raw["entries"]


def find_entry(entries: list[dict], key: dict) -> dict | None:
    for entry in entries:
        if same_run(entry["key"], key):
            return entry
    return None


def lookup(path: str | Path | None, key: dict) -> tuple[dict | None, str]:
    """(entry or None, a note saying where the memory numbers come from)."""
    if path is None:
        return None, "analytical"
    entry = find_entry(load_calibration(path), key)
    if entry is None:
        return None, f"analytical ({path} has no entry for {describe_key(key)})"
    return entry, f"calibration {path}"


def write_entry(path: str | Path, entry: dict) -> None:
    """Add `entry` to the file (replacing one for the same run); other runs are kept."""
    path = Path(path)
    entries = load_calibration(path) if path.is_file() else []
    entries = [e for e in entries if not same_run(e["key"], entry["key"])] + [entry]
    doc = {"moegraph_calibration": FORMAT, "entries": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(doc, indent=2) + "\n")
    else:
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
