"""Canonical JSON for everything fq hashes or signs, and a strict loader for everything it reads.

Canonical form: UTF-8, sorted keys, no insignificant whitespace, integers stay integers, floats
must be finite. The strict loader refuses duplicate keys (an attacker's second "sha256" must not
win silently), NaN/Infinity, and names the file in its error.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from fq.errors import FqError


def dumps(obj: Any) -> bytes:
    """Canonical bytes of a JSON value (what gets hashed and signed)."""
    _check_finite(obj, "$")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def pretty(obj: Any) -> str:
    """Human-readable, still deterministic (sorted keys, fixed indent, trailing newline)."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_finite(obj: Any, where: str) -> None:
    if isinstance(obj, float) and not math.isfinite(obj):
        raise FqError(f"{where}: non-finite number {obj!r} cannot be written as JSON")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise FqError(f"{where}: JSON object keys must be strings, got {k!r}")
            _check_finite(v, f"{where}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_finite(v, f"{where}[{i}]")


def _no_duplicates(source: str):
    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise FqError(f"{source}: duplicate JSON key {k!r}")
            seen[k] = v
        return seen

    return hook


def _reject_constant(source: str):
    def hook(name):
        raise FqError(f"{source}: {name} is not valid JSON")

    return hook


def loads(data: bytes | str, source: str = "<json>") -> Any:
    """Parse JSON strictly; errors name ``source``."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FqError(f"{source}: not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates(source), parse_constant=_reject_constant(source))
    except json.JSONDecodeError as e:
        raise FqError(f"{source}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def load(path: str | Path) -> Any:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise FqError(f"{path}: cannot read: {e.strerror}") from None
    return loads(data, str(path))
