"""Byte and duration quantities as operators type them and as fq prints them (decimal units, like disks and clouds)."""
from __future__ import annotations

import re

from fq.errors import FqError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$", re.ASCII)
_DECIMAL = re.compile(r"[0-9]+")


def is_decimal(text: str) -> bool:
    """``text`` is ASCII digits only: ``str.isdigit`` also passes ``²`` and other digits ``int()`` refuses."""
    return isinstance(text, str) and _DECIMAL.fullmatch(text) is not None


def parse_bytes(text: str | int, what: str = "size") -> int:
    """``"1.6TB"``, ``"800 GiB"``, ``"123456"`` -> bytes (a positive integer)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _QUANTITY.match(str(text))
        unit = m.group(2).upper() if m else None
        if not m or unit not in _UNITS:
            raise FqError(f"{what}: {text!r} is not a byte quantity (expected e.g. 1.6TB, 800GiB or a number of bytes)")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise FqError(f"{what}: expected a positive number of bytes, got {text!r}")
    return value


def fmt_bytes(n: int | float) -> str:
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}" if unit == "TB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_hours(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
