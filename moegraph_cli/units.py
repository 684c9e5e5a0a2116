"""Byte sizes: parse "80GiB" / "80G" / "80GB" / "1.5e9" and format for tables.

The convention, stated in every --help that takes a size: a unit with `i` (KiB, MiB, GiB, TiB,
PiB) or a bare letter (K, M, G, T, P, as in `nvidia-smi`, `free -h` and PyTorch's memory
summaries) is binary, 2^10 per step; a unit with `B` and no `i` (KB, MB, GB, TB, PB) is
decimal, 10^3 per step, as disk vendors write it. No unit, or `B`, is bytes. Case is ignored.
So 80G = 80GiB = 85,899,345,920 bytes and 80GB = 80,000,000,000 bytes.
"""

import re

from .errors import UsageError

SIZE_CONVENTION = "G = GiB = 2^30 bytes, GB = 10^9"

_STEPS = "kmgtp"
_UNITS = {"": 1, "b": 1}
for _i, _letter in enumerate(_STEPS, start=1):
    _UNITS[_letter] = _UNITS[_letter + "i"] = _UNITS[_letter + "ib"] = 2 ** (10 * _i)
    _UNITS[_letter + "b"] = 10 ** (3 * _i)

_FORMAT_UNITS = (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30),
                 ("MiB", 2**20), ("KiB", 2**10))


def parse_bytes(text: str, what: str = "size") -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"{what} {text!r} is not a size; write e.g. 80GiB, 80G or 500MB "
                         f"({SIZE_CONVENTION})")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value >= 1:  # also NaN / inf from huge exponents
        raise UsageError(f"{what} {text!r} must be at least one byte")
    if value > 2**63:
        raise UsageError(f"{what} {text!r} is larger than any machine's memory or disk")
    return int(value)


def fmt_bytes(n: float | int | None) -> str:
    """In the largest binary unit that keeps the number at least 1 (EiB at most)."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in _FORMAT_UNITS:
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"
