"""Reading the planner's YAML/JSON files (plans, calibrations, savings) with one-line errors."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..errors import UsageError


def read_document(path: str | Path, what: str, hint: str, syntax: str = "YAML/JSON"):
    """The parsed document at `path`; `what` names the file kind in errors, `hint` says how
    to write one. JSON is YAML, so one parser reads both."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{what} {path}: no such file ({hint})")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"{what} {path}: not valid {syntax}{where}") from None
