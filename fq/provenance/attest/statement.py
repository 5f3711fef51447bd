"""in-toto Statement v1 (https://in-toto.io/Statement/v1) and the JSON Schemas of fq's predicates.

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": <file name>, "digest": {"sha256": <hex>}}, ...],
     "predicateType": <one of PREDICATE_TYPES>, "predicate": {...}}

Predicates are validated against ``fq/schemas/*.json`` (draft 2020-12). "integer" is strict here:
``3.0`` is refused, so integers in signed documents stay JSON integers.
"""
from __future__ import annotations

import functools
import json
from importlib import resources

import jsonschema
from referencing import Registry, Resource

from fq.core.canonical import dumps, loads
from fq.core.safepath import check_name
from fq.errors import FqError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
FRAGMENT = "https://fq.dev/attestation/v1"  # fq-attestation/1, profiles "expert", "linear" and "skeleton"
ASSEMBLY = "https://fq.dev/assembly/v1"
MANIFEST = "https://fq.dev/base-manifest/v1"
ADAPTER = "https://fq.dev/adapter/v1"
PUBLICATION = "https://fq.dev/publication/v1"

SCHEMAS = {
    (FRAGMENT, "expert"): "fq-attestation-expert.schema.json",
    (FRAGMENT, "skeleton"): "fq-attestation-skeleton.schema.json",
    (FRAGMENT, "linear"): "fq-attestation-linear.schema.json",
    (ASSEMBLY, None): "fq-assembly.schema.json",
    (MANIFEST, None): "fq-base-manifest.schema.json",
    (ADAPTER, None): "fq-adapter.schema.json",
    (PUBLICATION, None): "fq-publication.schema.json",
}
_BASE_URI = "https://fq.dev/schemas/"


def _load_schema(name: str) -> dict:
    return json.loads(resources.files("fq").joinpath("schemas", name).read_text("utf-8"))


@functools.lru_cache(maxsize=None)
def _validator(name: str):
    names = ["fq-common.schema.json", *sorted(set(SCHEMAS.values()))]
    registry = Registry().with_resources((_BASE_URI + n, Resource.from_contents(_load_schema(n))) for n in names)
    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine(
        "integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool))
    cls = jsonschema.validators.extend(base, type_checker=checker)
    return cls(_load_schema(name), registry=registry)


def validate_predicate(predicate_type: str, predicate: object, source: str) -> dict:
    """Validate a predicate against its profile's schema; the kind field picks the fragment profile."""
    kind = predicate.get("kind") if isinstance(predicate, dict) and predicate_type == FRAGMENT else None
    schema = SCHEMAS.get((predicate_type, kind))
    if schema is None:
        what = f"kind {kind!r}" if predicate_type == FRAGMENT else f"predicateType {predicate_type!r}"
        raise FqError(f"{source}: unknown predicate {what}")
    errors = list(_validator(schema).iter_errors(predicate))
    if errors:
        e = jsonschema.exceptions.best_match(errors)  # descends into oneOf to the error that says most
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path) or "(top)"
        if e.validator == "pattern" and isinstance(e.instance, str):
            check_name(e.instance, f"{source}: predicate{path}")  # say '..' or 'absolute', not just 'pattern'
        raise FqError(f"{source}: predicate{path}: {e.message} (schema {schema})")
    return predicate  # type: ignore[return-value]


def statement(subjects: list[tuple[str, str]], predicate_type: str, predicate: dict) -> bytes:
    """Canonical payload bytes of a Statement; the predicate is schema-checked before it is signed."""
    validate_predicate(predicate_type, predicate, "statement being signed")
    body = {"_type": STATEMENT_TYPE, "predicateType": predicate_type, "predicate": predicate,
            "subject": [{"name": n, "digest": {"sha256": d}} for n, d in subjects]}
    return dumps(body)


def parse_statement(payload: bytes, source: str, predicate_type: str) -> tuple[list[tuple[str, str]], dict]:
    """(subjects, predicate) of verified payload bytes; refuses any other statement or predicate type."""
    st = loads(payload, f"{source} (statement)")
    if not isinstance(st, dict) or set(st) != {"_type", "subject", "predicateType", "predicate"}:
        raise FqError(f"{source}: statement must have exactly _type, subject, predicateType, predicate")
    if st["_type"] != STATEMENT_TYPE:
        raise FqError(f"{source}: statement _type {st['_type']!r}, expected {STATEMENT_TYPE!r}")
    if st["predicateType"] != predicate_type:
        raise FqError(f"{source}: predicateType {st['predicateType']!r}, expected {predicate_type!r}")
    subjects = []
    if not isinstance(st["subject"], list) or not st["subject"]:
        raise FqError(f"{source}: statement has no subjects")
    for i, s in enumerate(st["subject"]):
        ok = isinstance(s, dict) and set(s) == {"name", "digest"} and isinstance(s["name"], str) \
            and isinstance(s["digest"], dict) and set(s["digest"]) == {"sha256"} and isinstance(s["digest"]["sha256"], str)
        if not ok:
            raise FqError(f"{source}: subject[{i}] must be {{name, digest: {{sha256}}}}")
        subjects.append((s["name"], s["digest"]["sha256"]))
    return subjects, validate_predicate(predicate_type, st["predicate"], source)
