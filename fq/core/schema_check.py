"""Validate a JSON document against one of fq's packaged schemas, with one precise error line.

The message names the file, the JSON path of the offending value (``nodes[3].K``) and what the
schema expected, so an operator can fix a recipe without reading the schema.
"""
from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any, Callable

import jsonschema

from fq.errors import FqError


@functools.lru_cache(maxsize=None)
def load_schema(name: str) -> dict:
    """The packaged schema ``fq/schemas/<name>.schema.json``."""
    text = resources.files("fq").joinpath("schemas", f"{name}.schema.json").read_text("utf-8")
    schema = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _position(doc: Any, path) -> list[int]:
    """Where ``path`` sits in document order (object keys as written, list indexes)."""
    pos, cur = [], doc
    for part in path:
        if isinstance(cur, dict):
            keys = list(cur)
            pos.append(keys.index(part) if part in keys else len(keys))
            cur = cur.get(part)
        elif isinstance(cur, list) and isinstance(part, int):
            pos.append(part)
            cur = cur[part] if part < len(cur) else None
        else:
            break
    return pos


def json_path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(document)"


def validate(doc: Any, schema_name: str, source: str, describe: Callable[[tuple], str] | None = None) -> None:
    """Raise FqError for the first (most relevant) schema violation of ``doc``.

    ``describe(path)`` may return a prefix naming the object at ``path`` (e.g. the node's name).
    """
    validator = jsonschema.Draft202012Validator(load_schema(schema_name))
    errors = list(validator.iter_errors(doc))
    if not errors:
        return
    # Report the violation earliest in the document (the first bad node, not a later product), and
    # within it jsonschema's most relevant one.
    first = min(_position(doc, e.absolute_path)[:2] for e in errors)
    err = jsonschema.exceptions.best_match(e for e in errors if _position(doc, e.absolute_path)[:2] == first)
    path = tuple(err.absolute_path)
    where = json_path(path)
    if describe is not None:
        extra = describe(path)
        if extra:
            where = f"{where} ({extra})"
    raise FqError(f"{source}: {where}: {_message(err)}")


def _message(err: jsonschema.ValidationError) -> str:
    if err.absolute_path and err.absolute_path[-1] == "K" and err.validator in ("minimum", "maximum", "type"):
        return f"{err.instance!r} out of range: K is an integer 1..8 (bits per weight of one trellis pass)"
    if err.validator == "oneOf" and isinstance(err.schema, dict):
        hints = [s.get("description") or s.get("const") for s in err.schema.get("oneOf", [])]
        if err.absolute_path and err.absolute_path[-1] == "experts":
            return f'{err.instance!r} is not an expert selection; expected "all", {{"hot": N}} or {{"layers": {{"<layer>": [experts]}}}}'
        return f"{err.instance!r} matches none of the allowed forms ({'; '.join(str(h) for h in hints if h)})"
    if err.validator == "const":
        return f"expected {err.validator_value!r}, got {err.instance!r}"
    if err.validator == "enum":
        return f"{err.instance!r} is not one of {', '.join(repr(v) for v in err.validator_value)}"
    if err.validator == "pattern":
        return f"{err.instance!r} does not match {err.validator_value!r}"
    if err.validator in ("minimum", "maximum"):
        bound = "at least" if err.validator == "minimum" else "at most"
        return f"{err.instance!r} out of range: expected {bound} {err.validator_value}"
    return err.message
