"""What every config section shares: field types, type checking without conversion, the
numeric bounds, and the validation error that names its field."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing

from ..io.documents import is_int, show
from ..errors import UsageError

# The synthetic batches seed a generator with seed * 1_000_003 + step (a signed 64-bit value).
MAX_SEED = 2**32 - 1
# Every integer setting (a size, a count, a step number) is at most this: far beyond any real
# model, and it keeps products of a few of them exact in the float arithmetic of the planner.
MAX_INT = 2**31 - 1
_EXPONENT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")


def field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_int_sizes(obj, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if is_int(value) and value > MAX_INT:
            raise invalid(f.name, f"{prefix}{f.name} {show(value)} is too large (at most "
                          f"{MAX_INT})")


def invalid(field_name: str, message: str) -> UsageError:
    """A validation error that remembers its field (a profile file adds the field's line)."""
    e = UsageError(message)
    e.field = field_name
    return e


def coerce(where: str, value, typ):
    """Check `value` against a field type; ints widen to float, nothing else converts."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        return coerce(where, value, args[0])
    if origin is list:
        (inner,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise UsageError(f"{where}: expected a list, got {show(value)}")
        return [coerce(where, v, inner) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if is_int(value):
            return value
    elif typ is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string
        if is_int(value) or isinstance(value, float):
            number = float(value) if isinstance(value, float) or abs(value) < 2**1000 else math.inf
            if not math.isfinite(number):
                raise UsageError(f"{where}: expected a finite number, got {show(value)}")
            return number
    elif typ is str:
        if isinstance(value, str):
            return value
    elif typ is dict:
        if isinstance(value, dict):
            return dict(value)
    raise UsageError(f"{where}: expected {getattr(typ, '__name__', typ)}, got {show(value)}")
