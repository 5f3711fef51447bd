"""Canonical JSON for everything fq hashes or signs, and a strict loader for everything it reads.

Canonical form: UTF-8, sorted keys, no insignificant whitespace, integers stay integers, floats
must be finite. The strict loader is the one parser of every JSON document fq reads (envelopes,
statements, safetensors headers, manifests, plans, summaries, recipes, state): it refuses duplicate
keys (an attacker's second "sha256" must not win silently), NaN/Infinity and numbers that overflow
to them, and — before parsing — documents longer than ``max_bytes`` (default ``MAX_JSON_BYTES``),
nesting deeper than ``MAX_DEPTH`` and integers longer than ``MAX_INT_DIGITS`` digits, so a hostile
document is one ``FqError`` naming the file, never a ``RecursionError`` or Python's integer-size
``ValueError``.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from fq.errors import FqError

# the safetensors header limit; whole documents are capped lower by fq.core.safepath.read_regular
MAX_JSON_BYTES = 100 << 20
MAX_DEPTH = 64  # fq's own documents nest at most 8 levels; json's recursive parser fails near 1000
MAX_INT_DIGITS = 64  # offsets, sizes and versions fit in 20; Python refuses to parse more than 4300
# a JSON string, or an unterminated one up to the end: possessive and never failing once started, so
# stripping strings is linear even for '"\\"\\"\\"…' (a backtracking pattern takes seconds on 40 KB of that)
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")

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


def _int(source: str):
    def hook(text: str) -> int:
        digits = len(text.lstrip("-"))
        if digits > MAX_INT_DIGITS:
            raise FqError(f"{source}: integer of {digits} digits (at most {MAX_INT_DIGITS} accepted)")
        return int(text)

    return hook


def _float(source: str):
    def hook(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise FqError(f"{source}: number {text[:24]}{'…' if len(text) > 24 else ''} does not fit in a "
                          "float (a finite number was expected)")
        return value

    return hook


def nesting_depth(text: str) -> int:
    """How deeply arrays and objects nest in JSON text (brackets inside strings do not count); linear
    time, no recursion. For text that is not JSON the count is an upper bound of what a parser reaches."""
    brackets = _NOT_BRACKETS.sub("", _STRING.sub("", text))
    if len(brackets) <= 4096:
        return _depth_py(brackets)
    import numpy as np  # a hostile document may hold millions of brackets: count them vectorized
    codes = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    deepest, level = 0, 0
    for i in range(0, len(codes), 1 << 20):
        chunk = codes[i: i + (1 << 20)]
        steps = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1).astype(np.int64)
        running = np.cumsum(steps) + level
        deepest, level = max(deepest, int(running.max())), int(running[-1])
    return deepest


def _depth_py(brackets: str) -> int:
    deepest = level = 0
    for c in brackets:
        level += 1 if c in "[{" else -1
        deepest = max(deepest, level)
    return deepest


def loads(data: bytes | str, source: str = "<json>", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse JSON strictly; errors name ``source``. Length and nesting are checked before parsing."""
    if len(data) > max_bytes:
        raise FqError(f"{source}: JSON document of {len(data)} bytes, larger than the {max_bytes}-byte limit")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FqError(f"{source}: not UTF-8 ({e.reason} at byte {e.start})") from None
    depth = nesting_depth(data)
    if depth > MAX_DEPTH:
        raise FqError(f"{source}: JSON nested {depth} levels deep (at most {MAX_DEPTH} accepted)")
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates(source), parse_constant=_reject_constant(source),
                          parse_int=_int(source), parse_float=_float(source))
    except json.JSONDecodeError as e:
        raise FqError(f"{source}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def load(path: str | Path) -> Any:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise FqError(f"{path}: cannot read: {e.strerror}") from None
    return loads(data, str(path))
