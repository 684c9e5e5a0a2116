"""What every config section shares: field types, type checking without conversion, the
numeric bounds, and the validation error that names its field."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass

from ..io.documents import is_int, show
from ..errors import UsageError

# The synthetic batches seed a generator with seed * 1_000_003 + step (a signed 64-bit value).
MAX_SEED = 2**32 - 1
# Every integer setting (a size, a count, a step number) is at most this: far beyond any real
# model, and it keeps products of a few of them exact in the float arithmetic of the planner.
MAX_INT = 2**31 - 1
# Ranks on one host (--nproc, --ep): more than any host's GPUs; on CPUs (gloo) a few per core.
MAX_NPROC = 1024
_EXPONENT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")


@dataclass(frozen=True)
class Bound:
    """The values a number may take, low..high (both included), and how the rule reads.

    `low_rule` words the lower bound ("positive", ">= 0", "at least 1"); a value above `high`
    "is too large (at most HIGH)". Without `low_rule` the rule is the range itself, stated
    the same on both sides: "must be in 0..4294967295"."""

    low: float
    high: float
    low_rule: str | None = None

    def check(self, label: str, value, field_name: str | None = None) -> None:
        """A UsageError naming `label` (`run.seed`, `--seed`) unless `value` is allowed."""
        if isinstance(value, float) and not math.isfinite(value):
            raise invalid(field_name, f"{label} must be a finite number, got {show(value)}")
        if self.low <= value <= self.high:
            return
        if self.low_rule is None:
            raise invalid(field_name, f"{label} must be in {self.low}..{self.high}, got "
                          f"{show(value)}")
        if value < self.low:
            raise invalid(field_name, f"{label} must be {self.low_rule}, got {show(value)}")
        raise invalid(field_name, f"{label} {show(value)} is too large (at most {self.high})")


_POSITIVE = Bound(1, MAX_INT, "positive")
_COUNT = Bound(0, MAX_INT, ">= 0")
_RATE = Bound(0.0, math.inf, ">= 0")

# Every numeric setting's bound, in one place. The run section's fields are checked by
# RunConfig.validate; the command-line options read theirs from here too, so `--seed` and
# `--set run.seed` state one rule. The model section's fields are checked by ModelConfig.
BOUNDS = {
    "run.seed": Bound(0, MAX_SEED),
    "run.batch": _POSITIVE, "run.seq_len": _POSITIVE, "run.steps": _POSITIVE,
    "run.grad_accum": _POSITIVE, "run.pipeline_interleave": _POSITIVE,
    "run.warmup": _COUNT,
    "run.lr": _RATE, "run.weight_decay": _RATE,
    # command-line options that are no profile field
    "--nproc": Bound(1, MAX_NPROC, "at least 1"),
    "--ep": Bound(1, MAX_NPROC, "at least 1"),
    "--tolerance": _RATE,
}
# The options that set a profile field's value take that field's bound.
OPTION_FIELDS = {"--seed": "run.seed", "--steps": "run.steps", "--warmup": "run.warmup"}


def check_option(flag: str, value) -> None:
    """A command-line option's value against its bound (BOUNDS); None (not given) passes."""
    if value is not None:
        BOUNDS[OPTION_FIELDS.get(flag, flag)].check(flag, value)


def field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_int_sizes(obj, prefix: str) -> None:
    """Every integer field is at most MAX_INT, checked before anything else about it; a
    field whose bound is a range of its own (run.seed) says that range instead."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        bound = BOUNDS.get(f"{prefix}{f.name}")
        if bound is not None and bound.low_rule is None:
            continue
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
        for arg in args:  # the first type that takes the value (int | str: 4096, auto)
            try:
                return coerce(where, value, arg)
            except UsageError:
                if len(args) == 1:
                    raise
        names = " or ".join(getattr(a, "__name__", str(a)) for a in args)
        raise UsageError(f"{where}: expected {names}, got {show(value)}")
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
