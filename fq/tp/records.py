"""The signed documents of a TP export, in fq's usual envelope (DSSE + in-toto Statement, Ed25519).

- ``NAME.safetensors.intoto.jsonl`` beside every rank shard, predicateType
  ``https://fq.dev/tp-shard/v1``: kind ``expert`` names the unsliced fragment it was cut from (name,
  sha256, attestation digest), the mesh and the rank's coordinates, and per expert its byte range in
  this shard, that range's sha256, the unsliced range's sha256 and the slice of each projection;
  kind ``replicated`` names, per tensor, the skeleton shard it was copied from byte for byte; kind ``linear``
  (a whole-model base's quantized non-expert linears, ``fq.tp.linears``) names the linear fragment it was cut
  from, the tp rank, and per linear its unsliced (out, in), byte range here, that range's sha256 and its slice.
- ``export.intoto.jsonl``, predicateType ``https://fq.dev/tp-export/v1``: subjects = every shard of
  the export; the predicate binds them to the product plan (digest), the MoE spec, the manifest digest
  and the mesh shape, and names every shard's attestation digest — so a missing or foreign file shows.

Predicates are checked against the JSON Schemas below (sharing ``fq-common.schema.json``'s
definitions), after the signature and before any field is used.
"""
from __future__ import annotations

import functools
import json
from importlib import resources

import jsonschema
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from referencing import Registry, Resource

from fq.core.canonical import dumps, loads
from fq.core.safepath import sha256_stream
from fq.model.shards import read_header
from fq.provenance.attest import dsse
from fq.provenance.attest.statement import STATEMENT_TYPE

from fq.errors import FqError

SHARD = "https://fq.dev/tp-shard/v1"
EXPORT = "https://fq.dev/tp-export/v1"
SHARD_FORMAT = "fq-tp-shard/1"
EXPORT_FORMAT = "fq-tp-export/1"
_COMMON = "https://fq.dev/schemas/fq-common.schema.json"


def _ref(name: str) -> dict:
    return {"$ref": f"{_COMMON}#/$defs/{name}"}


def _obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "additionalProperties": False, "required": required or list(props),
            "properties": props}


_INT = {"type": "integer", "minimum": 0}
_POS = {"type": "integer", "minimum": 1}
_SLICE = {**_obj({"dim": {"enum": [0, 1]}, "start": _INT, "stop": _POS}), "type": ["object", "null"]}
_MESH = _obj({"tp": _POS, "ep": _POS})
_COORDS = _obj({"ep": _INT, "tp": _INT})
_SOURCE = _obj({"name": _ref("relname"), "sha256": _ref("sha256"), "attestation_sha256": _ref("sha256")})
_COMMON_FIELDS = {"format": {"const": SHARD_FORMAT}, "product": _ref("node"), "plan_sha256": _ref("sha256"),
                  "campaign": _ref("campaign"), "shard": _ref("shard")}

SHARD_SCHEMAS = {  # by kind (selecting first is much cheaper than a oneOf over both)
    "expert": _obj({**_COMMON_FIELDS, "kind": {"const": "expert"}, "mesh": _MESH, "coords": _COORDS, "node": _ref("node"),
          "chain_index": _INT, "layer": _INT, "block": _INT, "K": _ref("fragment_K"), "codebook": _ref("codebook"),
          "layout": _ref("layout"), "source": _SOURCE,
          "experts": {"type": "array", "minItems": 1, "items": _obj({
              "expert": _INT, "offset": _INT, "length": _POS, "sha256": _ref("sha256"),
              "source_sha256": _ref("sha256"),
              "slices": {"type": "object", "additionalProperties": _SLICE}})}}),
    "replicated": _obj({**_COMMON_FIELDS, "kind": {"const": "replicated"},
          "tensors": {"type": "array", "minItems": 1, "items": _obj({
              "name": {"type": "string", "minLength": 1}, "offset": _INT, "length": _INT, "sha256": _ref("sha256"),
              "source": _SOURCE})}}),
}

EXPORT_SCHEMA = _obj({
    "format": {"const": EXPORT_FORMAT}, "product": _ref("node"), "version": _POS, "plan_sha256": _ref("sha256"),
    "campaign": _ref("campaign"), "base_manifest_sha256": _ref("sha256"),
    "chain": {"type": "array", "minItems": 1, "items": _obj({"node": _ref("node"), "K": _ref("node_K"),
                                                             "codebook": _ref("codebook")})},
    "spec": {"type": "object"}, "assign": {"enum": ["contiguous", "strided"]}, "mesh": _MESH,
    "manifest_sha256": _ref("sha256"),
    "files": {"type": "array", "minItems": 1, "items": _obj({
        "name": _ref("relname"), "sha256": _ref("sha256"), "attestation_sha256": _ref("sha256"),
        "kind": {"enum": ["expert", "replicated", "linear"]},
        "coords": {"anyOf": [_COORDS, _obj({"tp": _INT}), {"type": "null"}]},
        "node": {"type": ["string", "null"]}, "layer": {"type": ["integer", "null"]}})}})

SHARD_SCHEMAS["linear"] = _obj({
    **_COMMON_FIELDS, "kind": {"const": "linear"}, "mesh": _MESH, "coords": _obj({"tp": _INT}), "node": _ref("node"),
    "class": {"enum": ["attention", "shared", "dense", "head"]}, "layer": {"type": ["integer", "null"], "minimum": 0},
    "K": _ref("K"), "codebook": _ref("codebook"), "source": _SOURCE,
    "linears": {"type": "array", "minItems": 1, "items": _obj({
        "name": {"type": "string", "minLength": 1}, "shape": {"type": "array", "items": _POS, "minItems": 2, "maxItems": 2},
        "offset": _INT, "length": _POS, "sha256": _ref("sha256"), "slice": _SLICE})}})

SCHEMAS = {**{(SHARD, kind): schema for kind, schema in SHARD_SCHEMAS.items()}, (EXPORT, None): EXPORT_SCHEMA}


def written(path, groups: list[list[str]]) -> tuple[str, int, str, list[tuple[int, int, str]]]:
    """(sha256, size, header sha256, [(offset, length, sha256)] per group of keys) of a shard just written: what
    its record states."""
    with open(path, "rb") as fh:
        header = read_header(fh, str(path))
        spans = [header.span(g, g[0]) for g in groups]
        whole, size, digests = sha256_stream(fh, spans)
    return whole, size, header.sha256, [(o, n, d) for (o, n), d in zip(spans, digests)]


def attested_header(fh, p: dict, where: str):
    """The header of an open rank shard whose record ``p`` is verified, refused unless it and the file's size are
    the attested ones."""
    header = read_header(fh, where)
    if header.sha256 != p["shard"]["header_sha256"] or header.file_size != p["shard"]["size"]:
        raise FqError(f"{where}: header or size differ from the attested ones")
    return header


@functools.lru_cache(maxsize=None)
def _validator(key: tuple):
    common = json.loads(resources.files("fq").joinpath("schemas", "fq-common.schema.json").read_text("utf-8"))
    registry = Registry().with_resource(_COMMON, Resource.from_contents(common))
    base = jsonschema.Draft202012Validator
    # integers stay JSON integers (3.0 refused), as in every fq document
    checker = base.TYPE_CHECKER.redefine("integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool))
    return jsonschema.validators.extend(base, type_checker=checker)(SCHEMAS[key], registry=registry)


def validate(predicate_type: str, predicate: object, where: str) -> dict:
    kind = predicate.get("kind") if predicate_type == SHARD and isinstance(predicate, dict) else None
    if (predicate_type, kind) not in SCHEMAS:
        raise FqError(f"{where}: unknown {predicate_type} record kind {kind!r}")
    errors = list(_validator((predicate_type, kind)).iter_errors(predicate))
    if errors:
        e = jsonschema.exceptions.best_match(errors)
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path) or "(top)"
        raise FqError(f"{where}: predicate{path}: {e.message}")
    return predicate  # type: ignore[return-value]


def sign(subjects: list[tuple[str, str]], predicate_type: str, predicate: dict, key: Ed25519PrivateKey) -> bytes:
    """One envelope line; the predicate is schema-checked before it is signed."""
    validate(predicate_type, predicate, "record being signed")
    body = dumps({"_type": STATEMENT_TYPE, "predicateType": predicate_type, "predicate": predicate,
                  "subject": [{"name": n, "digest": {"sha256": d}} for n, d in subjects]})
    return dsse.envelope_line(dsse.sign(body, key))


def open_record(data: bytes, public_key: Ed25519PublicKey, where: str,
                predicate_type: str) -> tuple[list[tuple[str, str]], dict]:
    """(subjects, predicate) of a line signed by the pinned key; signature first, then shape and schema."""
    st = loads(dsse.open_envelope(data, public_key, where), f"{where} (statement)")
    if not isinstance(st, dict) or set(st) != {"_type", "subject", "predicateType", "predicate"} \
            or st["_type"] != STATEMENT_TYPE:
        raise FqError(f"{where}: not an in-toto Statement v1")
    if st["predicateType"] != predicate_type:
        raise FqError(f"{where}: predicateType {st['predicateType']!r}, expected {predicate_type!r}")
    subjects = []
    for i, s in enumerate(st["subject"] if isinstance(st["subject"], list) else []):
        if not (isinstance(s, dict) and set(s) == {"name", "digest"} and isinstance(s["name"], str)
                and isinstance(s["digest"], dict) and set(s["digest"]) == {"sha256"}):
            raise FqError(f"{where}: subject[{i}] must be {{name, digest: {{sha256}}}}")
        subjects.append((s["name"], s["digest"]["sha256"]))
    if not subjects:
        raise FqError(f"{where}: statement has no subjects")
    return subjects, validate(predicate_type, st["predicate"], where)
