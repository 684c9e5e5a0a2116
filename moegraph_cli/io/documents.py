"""Reading the files a user hands to moegraph (profiles, config.json, plans, savings,
calibrations) with one-line errors that name the file and, for YAML, the line.

Every loader goes through `read_text` (missing, not a file, unreadable, not UTF-8) and then
`parse_yaml` or `parse_json`. YAML mappings come back as `Mapping`, a dict that remembers the
line of each key, so a loader can say `plan.yaml:12: field 'pools' ...` about a value that
parsed but is wrong. JSON is YAML, so the planner's files may be either. Both readers refuse
a key written twice in one mapping, naming the key and its line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from ..errors import UsageError, one_line, show_path

_SHOW_CHARS = 60


class Mapping(dict):
    """A YAML mapping: a dict plus the 1-based line of the mapping and of each key."""

    line: int | None = None
    key_lines: dict

    def line_of(self, key) -> int | None:
        return getattr(self, "key_lines", {}).get(key, self.line)


class _LineLoader(yaml.SafeLoader):
    pass


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode):
    data = Mapping()
    data.line = node.start_mark.line + 1
    yield data
    written = [key_node for key_node, _ in node.value if key_node.tag != _MERGE_TAG]
    data.update(loader.construct_mapping(node))  # merges `<<` keys, refuses unhashable keys
    _refuse_duplicates(loader, written)
    data.key_lines = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        data.key_lines.setdefault(key, key_node.start_mark.line + 1)


def _refuse_duplicates(loader: _LineLoader, key_nodes: list) -> None:
    """A key written twice in one mapping is an error (YAML says keys are unique; PyYAML
    would keep the last value silently, e.g. a second `run:` section dropping the first).
    Keys a `<<` merge brings in may be overridden: that is what merging is for."""
    first_line: dict = {}
    for key_node in key_nodes:
        key = loader.construct_object(key_node)
        if key in first_line:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {show(key)} (first at line {first_line[key]})",
                key_node.start_mark)
        first_line[key] = key_node.start_mark.line + 1


_LineLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


def show(value) -> str:
    """A value for an error message: its repr, on one line, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= _SHOW_CHARS else text[:_SHOW_CHARS - 3] + "..."


def at(where: str, doc=None, key=None) -> str:
    """`where` with the line of `key` in `doc` (or of `doc` itself) when it is known."""
    line = doc.line_of(key) if isinstance(doc, Mapping) else None
    return f"{where}:{line}" if line else where


def read_text(path: str | Path, what: str | None, hint: str | None = None) -> str:
    """The text of a user's file; a one-line UsageError if it is missing, not a regular
    file, unreadable or not UTF-8 text. `what` names the kind of file ("plan", "profile";
    None: the path says it, e.g. config.json)."""
    path = Path(path)
    label = f"{what} {show_path(path)}" if what else show_path(path)
    try:
        if not path.exists():
            raise UsageError(f"{label}: no such file" + (f" ({hint})" if hint else ""))
        if not path.is_file():
            raise UsageError(f"{label}: not a regular file")
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"{label}: cannot be read ({e.strerror or type(e).__name__})"
                         ) from None
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark some editors write is dropped
    except UnicodeDecodeError as e:
        raise UsageError(f"{label}: not a text file (byte {e.start} is not UTF-8)") from None


def parse_yaml(text: str, where: str, syntax: str = "YAML", marks: bool = True):
    """The YAML document in `text` (mappings as `Mapping`); `where` names it in errors, with
    the line and column of a syntax error unless `marks` is off (a one-line value)."""
    try:
        return yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        pos = f":{mark.line + 1}:{mark.column + 1}" if mark and marks else ""
        problem = e.problem or e.context or "syntax error"
        if marks and e.problem and e.context and e.context_mark and e.problem_mark \
                and e.context_mark.line != e.problem_mark.line:
            problem += f" ({e.context} from line {e.context_mark.line + 1})"
        raise UsageError(f"{where}{pos}: not valid {syntax}: {one_line(problem)}") from None
    except yaml.reader.ReaderError as e:  # a control character: no mark, a position
        code = e.character if isinstance(e.character, int) else ord(e.character)
        newlines = text.count("\n", 0, e.position)
        line = f":{newlines + 1}" if marks else ""
        raise UsageError(f"{where}{line}: not valid {syntax}: character U+{code:04X} is not "
                         "allowed") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{where}: not valid {syntax}: {one_line(str(e))}") from None
    except RecursionError:
        raise UsageError(f"{where}: not valid {syntax}: nested too deeply") from None
    except (ValueError, OverflowError) as e:  # a tagged or timestamp scalar out of range
        raise UsageError(f"{where}: not valid {syntax}: {one_line(str(e))}") from None


class DuplicateKey(ValueError):
    """A JSON object names `key` twice (raised by `unique_pairs`)."""

    def __init__(self, key):
        super().__init__(key)
        self.key = key


def unique_pairs(pairs: list) -> dict:
    """json's object_pairs_hook: an object that names a key twice is refused (DuplicateKey),
    where json would keep the last value silently. Every JSON reader of moegraph's uses it:
    parse_json here, the checkpoint's shard index and safetensors headers."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def duplicate_line(text: str) -> str:
    """Where the JSON text names a key twice: ` at line N` from the YAML reader's marks (JSON
    is YAML's flow style), or nothing if that reader cannot place it."""
    try:
        yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        if e.problem and e.problem.startswith("duplicate key") and e.problem_mark:
            return f" at line {e.problem_mark.line + 1}"
    except Exception:  # noqa: BLE001 - only a hint is at stake
        pass
    return ""


def parse_json(text: str, where: str):
    """The JSON document in `text`; `where` names it in errors. A key twice in one object is
    an error (json would keep the last value silently)."""
    try:
        return json.loads(text, object_pairs_hook=unique_pairs)
    except DuplicateKey as e:
        raise UsageError(f"{where}: invalid JSON (duplicate key {show(e.key)}"
                         f"{duplicate_line(text)})") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: invalid JSON ({e.msg} at line {e.lineno}, column "
                         f"{e.colno})") from None
    except RecursionError:
        raise UsageError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer with too many digits
        raise UsageError(f"{where}: invalid JSON ({one_line(str(e))})") from None


def read_document(path: str | Path, what: str, hint: str, syntax: str = "YAML/JSON"):
    """The parsed YAML/JSON document at `path`; `what` names the file kind in errors, `hint`
    says how to write one."""
    text = read_text(path, what, hint)
    return parse_yaml(text, f"{what} {path}", syntax)


def check_format(raw, where: str, marker: str, version: int, kind: str, hint: str) -> dict:
    """The top-level mapping of a moegraph file that starts `marker: version`; `kind` names
    the file ("a moegraph plan"), `hint` says how to write one."""
    if raw is None:
        raise UsageError(f"{where}: the file is empty; expected {kind} ({hint})")
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: not {kind}: expected a mapping that starts {marker}: "
                         f"{version}, got {kind_of(raw)} ({hint})")
    if marker not in raw:
        raise UsageError(f"{at(where, raw)}: not {kind}: no {marker} field ({hint})")
    if not is_int(raw[marker]) or raw[marker] != version:
        raise UsageError(f"{at(where, raw, marker)}: {marker} is {show(raw[marker])}; this "
                         f"moegraph reads version {version}")
    return raw


def kind_of(value) -> str:
    """What a parsed value is, for "expected a mapping, got ..." messages."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the string {show(value)}"
    return show(value)


def plain(value):
    """`value` with every `Mapping` turned back into a dict (for yaml.safe_dump and copies)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or a float that converts to a finite float (not a bool, NaN or infinite)."""
    if is_int(value):
        return abs(value) < 2**1000
    return isinstance(value, float) and math.isfinite(value)


def is_bytes(value) -> bool:
    """A byte count: an int in 0..2**63-1 (what a device's allocator can report)."""
    return is_int(value) and 0 <= value < 2**63
