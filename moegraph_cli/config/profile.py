"""Profiles: profiles/NAME.yaml or a YAML path, read section by section with every field
type-checked (errors name the file and line), and `--set section.field=value` overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..io.documents import at, kind_of, parse_yaml, read_text, show
from ..errors import UsageError
from .fields import coerce, field_types
from .model import ModelConfig
from .run import MoeConfig, RunConfig

DEFAULT_PROFILE = "tiny-qwen3-moe"


@dataclass
class Profile:
    name: str
    model: ModelConfig
    run: RunConfig
    moe: MoeConfig
    description: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description,
                "model": dataclasses.asdict(self.model), "run": dataclasses.asdict(self.run),
                "moe": dataclasses.asdict(self.moe)}


SECTIONS = {"model": ModelConfig, "run": RunConfig, "moe": MoeConfig}


def profile_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("moegraph_cli.profiles").iterdir()
                  if p.name.endswith(".yaml"))


def load_profile(name_or_path: str = DEFAULT_PROFILE, overrides: list[str] | None = None) -> Profile:
    """A profile by name (profiles/NAME.yaml) or by path to a YAML file, with overrides."""
    if _is_path(name_or_path):
        path = Path(name_or_path)
        text, source, stem = read_text(path, "profile"), f"profile {path}", path.stem
    else:
        res = resources.files("moegraph_cli.profiles").joinpath(f"{name_or_path}.yaml")
        if not res.is_file():
            raise UsageError(f"profile {name_or_path!r} not found; available: "
                             + ", ".join(profile_names()) + " (or give a path to a .yaml file)")
        text, source, stem = res.read_text(), f"profile profiles/{name_or_path}.yaml", name_or_path
    raw = parse_yaml(text, source)
    if raw is None:
        raise UsageError(f"{source}: the file is empty; a profile has the sections model, run "
                         "and moe (see profiles/tiny-qwen3-moe.yaml)")
    if not isinstance(raw, dict):
        raise UsageError(f"{source}: expected a mapping with the sections model, run and moe, "
                         f"got {kind_of(raw)}")
    for key in raw:
        if key not in ("name", "description", *SECTIONS):
            raise UsageError(f"{at(source, raw, key)}: unknown section {show(key)}; a profile "
                             "has name, description, model, run and moe")
    for key in ("name", "description"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise UsageError(f"{at(source, raw, key)}: {key} must be a string, got "
                             f"{show(raw[key])}")
    sections = {}
    for sec, cls in SECTIONS.items():
        values = raw.get(sec)
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise UsageError(f"{at(source, raw, sec)}: section {sec!r} must be a mapping of "
                             f"field: value, got {show(values)}")
        sections[sec] = _build(cls, sec, values, source)
    prof = Profile(name=raw.get("name") or stem, description=raw.get("description") or "",
                   **sections)
    return apply_overrides(prof, overrides or [])


def profile_from_model(model: ModelConfig, name: str, overrides: list[str] | None = None,
                       base: str = DEFAULT_PROFILE) -> Profile:
    """A checkpoint's architecture with the default profile's run settings."""
    prof = load_profile(base)
    prof.model, prof.name = model, name
    return apply_overrides(prof, overrides or [])


def apply_overrides(prof: Profile, overrides: list[str]) -> Profile:
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise UsageError(f"--set {show(item)}: expected section.field=value")
        sec, _, name = key.partition(".")
        if sec in SECTIONS and not name:
            raise UsageError(f"--set {show(item)}: {sec} is a section, not a field; write "
                             f"--set {sec}.FIELD=VALUE ({sec} fields: "
                             + ", ".join(sorted(field_types(SECTIONS[sec]))) + ")")
        if sec not in SECTIONS:
            raise UsageError(f"--set {show(key)}: unknown key; sections are model, run, moe "
                             "(e.g. run.seq_len=2048)")
        obj = getattr(prof, sec)
        types_ = field_types(type(obj))
        if name not in types_:
            raise UsageError(f"--set {show(key)}: unknown key; {sec} fields are "
                             + ", ".join(sorted(types_)))
        parsed = parse_yaml(value, f"--set {key}", marks=False) if value.strip() else ""
        if types_[name] == list[str] and isinstance(parsed, str):
            parsed = [s.strip() for s in parsed.split(",") if s.strip()]
        setattr(obj, name, coerce(f"--set {key}", parsed, types_[name]))
    prof.model.validate().check_layer_indices()
    prof.run.validate()
    prof.moe.validate()
    return prof


def _is_path(name_or_path: str) -> bool:
    """A profile argument names a file (not a shipped profile) when it looks like one."""
    return name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path \
        or "\\" in name_or_path


def _build(cls, sec: str, values: dict, source: str):
    """One section of a profile file, every field type-checked, then validated; errors name
    the file and the line."""
    types_ = field_types(cls)
    for k in values:
        if k not in types_:
            raise UsageError(f"{at(source, values, k)}: unknown field {show(k)} in section "
                             f"{sec}; {sec} fields are " + ", ".join(sorted(types_)))
    kwargs = {k: coerce(f"{at(source, values, k)}: {sec}.{k}", v, types_[k])
              for k, v in values.items()}
    try:
        obj = cls(**kwargs).validate()
        return obj.check_layer_indices() if cls is ModelConfig else obj
    except UsageError as e:
        raise UsageError(f"{at(source, values, getattr(e, 'field', None))}: {e}") from None

