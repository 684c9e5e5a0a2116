"""Calibration files: per-run measurements that replace the memory model's formulas.

Written by `moegraph profile --calibrate FILE` on a GPU (profile.calibrate measures a one-layer
copy of the model), read by `moegraph plan --calibration FILE`. One file holds entries for
several runs; an entry is found by its key (runkey.run_key: batch, seq_len, dtype, MoE mode and
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

from ..io.documents import at, check_format, is_bytes, plain, read_document, show
from ..errors import UsageError
from .runkey import check_key, describe_key, same_run

FORMAT = 1
HINT = "write one with `moegraph profile --calibrate FILE` on a GPU"


def load_calibration(path: str | Path) -> list[dict]:
    """Every entry of a calibration file, each checked against the layout above."""
    path = Path(path)
    where = f"calibration {path}"
    raw = read_document(path, "calibration", HINT)
    check_format(raw, where, "moegraph_calibration", FORMAT, "a moegraph calibration file",
                 HINT)
    if not isinstance(raw.get("entries"), list):
        raise UsageError(f"{at(where, raw, 'entries')}: entries must be a list, got "
                         f"{show(raw.get('entries'))}")
    for i, entry in enumerate(raw["entries"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("scopes"), dict):
            line = at(where, entry, "scopes") if isinstance(entry, dict) else \
                at(where, raw, "entries")
            raise UsageError(f"{line}: entry {i} must be a mapping with a key and scopes")
        for kind, s in entry["scopes"].items():
            label = kind if isinstance(kind, str) and kind.isprintable() else show(kind)
            name = f"entry {i} scope {label}"
            if not isinstance(s, dict):
                raise UsageError(f"{at(where, entry['scopes'], kind)}: {name} must be a mapping "
                                 f"of byte counts, got {show(s)}")
            _check_scope(s, where, name)
        if not _layer_model_ok(entry.get("layer_model")):
            raise UsageError(f"{at(where, entry, 'layer_model')}: entry {i} layer_model must "
                             "hold pools (strategy: bytes) and eager_peak_reserved (bytes)")
        check_key(entry.get("key"), where, f"entry {i} key")
    return plain(raw["entries"])


def _check_scope(s: dict, where: str, name: str) -> None:
    for f in ("saved_bytes", "out_bytes", "fwd_peak_bytes", "bwd_peak_bytes"):
        if not is_bytes(s.get(f)):
            raise UsageError(f"{at(where, s, f)}: {name} lacks integer {f}")
    if "in_grad_bytes" in s and not is_bytes(s["in_grad_bytes"]):
        raise UsageError(f"{at(where, s, 'in_grad_bytes')}: {name} in_grad_bytes must be a "
                         f"byte count, got {show(s['in_grad_bytes'])}")
    if "saves_input" in s and not isinstance(s["saves_input"], bool):
        raise UsageError(f"{at(where, s, 'saves_input')}: {name} saves_input must be true or "
                         f"false, got {show(s['saves_input'])}")
    pools = s.get("private_pools")
    if pools is not None and not (isinstance(pools, list) and len(pools) == 2
                                  and all(is_bytes(v) for v in pools)):
        raise UsageError(f"{at(where, s, 'private_pools')}: {name} private_pools must be "
                         f"[forward bytes, backward bytes], got {show(pools)}")


def _layer_model_ok(layer) -> bool:
    if layer is None:
        return True
    if not isinstance(layer, dict):
        return False
    pools = layer.get("pools") or {}
    return isinstance(pools, dict) and all(is_bytes(v) for v in pools.values()) \
        and (layer.get("eager_peak_reserved") is None or is_bytes(layer["eager_peak_reserved"]))


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
    from ..io.outputs import write_text_atomically

    text = json.dumps(doc, indent=2) + "\n" if path.suffix == ".json" else \
        yaml.safe_dump(doc, sort_keys=False)
    write_text_atomically(path, text)  # the CLI checked the parent directory (--mkdir)
