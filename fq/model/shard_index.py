"""A source shard's range index: the sha256 of its header and of every tensor's bytes, derived in the one pass that
verifies the whole shard against the digest the campaign recorded, so that a job reading a few tensors verifies
only their bytes.

The staging job (fq.workflow.staging) copies or downloads a shard through ``index_pass``: one read that hashes the
whole file and, beside it, the header and each tensor's byte range (``fq.core.safepath.sha256_stream``). Only once
the whole digest is the recorded one is the index written, atomically, as ``SHARD.ranges.json`` beside the staged
shard. A safetensors file is its header followed by its tensors with no gap (``fq.model.shards.read_header``), so
the ranges cover every byte of the shard.

A reader (``fq.hessian.layer.read_tensors``) then trusts the index only when its ``shard_sha256`` is the digest
the campaign recorded, and checks every byte it uses against it: the header byte-for-byte (its sha256), each
wanted tensor's dtype, shape, offset and length, and the sha256 of the range it read. Anything else is refused,
naming the file and what differs.

    ranges(header) -> [(offset, length)]                  header first, then every tensor in offset order
    index_pass(fh, where, shard, sink=None) -> (sha256, size, index doc or None)
    index_path(shard_path) -> Path                        SHARD.ranges.json beside the shard
    write(path, doc); load(path, shard, shard_sha256) -> doc
    read_verified(fh, header, doc, entries, where, index_where) -> {name: bytearray}
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO, Callable

from fq.core import atomic, canonical
from fq.errors import FqError

FORMAT = "fq-shard-ranges/1"
SUFFIX = ".ranges.json"


def index_path(shard_path: str | os.PathLike) -> Path:
    p = Path(shard_path)
    return p.with_name(p.name + SUFFIX)


def ranges(header) -> list[tuple[int, int]]:
    """(offset, length) of the header, then of every tensor in offset order: sorted, disjoint, the whole file."""
    return [(0, header.data_start)] + [(e.start, e.length) for e in header.entries]


def _doc(shard: str, header, sha256: str, size: int, digests: list[str]) -> dict:
    head, tensors = digests[0], digests[1:]
    return {
        "format": FORMAT,
        "shard": shard,
        "shard_sha256": sha256,  # the whole-shard digest this index was derived from, in the same pass
        "size": size,
        "header": {"length": header.data_start, "sha256": head},
        "tensors": {e.name: {"dtype": e.dtype, "shape": list(e.shape), "offset": e.start, "length": e.length,
                             "sha256": d} for e, d in zip(header.entries, tensors)},
    }


def index_pass(fh: BinaryIO, where: str, shard: str,
               sink: Callable[[int, memoryview], None] | None = None) -> tuple[str, int, dict | None]:
    """One pass over ``fh``: (sha256 of the whole file, its size, its range index). ``sink(at, piece)`` sees every
    byte as it streams by (a copy). The index is None when the header does not parse (the caller's digest check or
    header check then says why); the caller writes it only once the whole digest is the recorded one."""
    from fq.core.safepath import sha256_stream
    from fq.model.shards import read_header

    try:
        header = read_header(fh, where)
    except FqError:
        header = None
    taps = [(0, 1 << 62, sink)] if sink is not None else []
    spans = ranges(header) if header is not None else []
    sha256, size, digests = sha256_stream(fh, spans, taps)
    if header is None:
        return sha256, size, None
    # the header was parsed from one read and hashed in another: the index must describe the bytes hashed
    if digests[0] != header.sha256 or size != header.file_size:
        raise FqError(f"{where}: changed while it was read (header or size differs between two reads)")
    return sha256, size, _doc(shard, header, sha256, size, digests)


def write(path: str | os.PathLike, doc: dict) -> None:
    """Canonical JSON (sorted keys, no whitespace) and a newline, written atomically."""
    atomic.write_bytes(path, canonical.dumps(doc) + b"\n")


def _check_shape(doc, where: str) -> None:
    def bad(what):
        return FqError(f"{where}: not a {FORMAT} index ({what})")

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad("format")
    if not isinstance(doc.get("shard_sha256"), str) or type(doc.get("size")) is not int:
        raise bad("shard_sha256, size")
    head = doc.get("header")
    if not isinstance(head, dict) or type(head.get("length")) is not int or not isinstance(head.get("sha256"), str):
        raise bad("header length, sha256")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise bad("tensors")
    for name, t in tensors.items():
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "offset", "length", "sha256"}:
            raise bad(f"tensor {name!r}: expected dtype, shape, offset, length, sha256")


def load(path: str | os.PathLike, shard: str, shard_sha256: str) -> dict:
    """The index at ``path``, refused unless it is a well-formed index of ``shard`` derived from ``shard_sha256``
    (the digest the campaign recorded)."""
    where = str(path)
    doc = canonical.load(path)
    _check_shape(doc, where)
    if doc.get("shard") != shard:
        raise FqError(f"{where}: an index of shard {doc.get('shard')!r}, expected {shard!r}")
    if doc["shard_sha256"] != shard_sha256:
        raise FqError(f"{where}: derived from shard sha256 {doc['shard_sha256']}, but the campaign recorded "
                      f"{shard_sha256} for {shard}; delete the index and re-stage the shard")
    return doc


def _check_header(header, doc: dict, where: str, index_where: str) -> None:
    got, want = header.sha256, doc["header"]["sha256"]
    if header.data_start != doc["header"]["length"] or got != want:
        raise FqError(f"{where}: header ({header.data_start} bytes) has sha256 {got}, but {index_where} says "
                      f"{doc['header']['length']} bytes with sha256 {want}")
    if header.file_size != doc["size"]:
        raise FqError(f"{where}: {header.file_size} bytes, but {index_where} says {doc['size']}")


def _check_entry(e, doc: dict, where: str, index_where: str) -> str:
    t = doc["tensors"].get(e.name)
    if t is None:
        raise FqError(f"{where}: tensor {e.name!r} is not in {index_where}")
    mine = {"dtype": e.dtype, "shape": list(e.shape), "offset": e.start, "length": e.length}
    theirs = {k: t[k] for k in mine}
    if mine != theirs:
        diff = ", ".join(f"{k} {mine[k]!r} (index: {theirs[k]!r})" for k in mine if mine[k] != theirs[k])
        raise FqError(f"{where}: tensor {e.name!r} differs from {index_where}: {diff}")
    return t["sha256"]


def read_verified(fh: BinaryIO, header, doc: dict, entries, where: str, index_where: str) -> dict[str, bytearray]:
    """The bytes of ``entries`` (of ``header``, read from ``fh``), each range's sha256 checked against ``doc``;
    the header itself must be the one the index was derived from, byte for byte."""
    _check_header(header, doc, where, index_where)
    out = {}
    for e in entries:
        want = _check_entry(e, doc, where, index_where)
        buf = bytearray(e.length)
        fh.seek(e.start)
        if fh.readinto(buf) != e.length:
            raise FqError(f"{where}: truncated: wanted {e.length} bytes of tensor {e.name!r} at {e.start}")
        got = hashlib.sha256(buf).hexdigest()
        if got != want:
            raise FqError(f"{where}: tensor {e.name!r} (bytes {e.start}..{e.end}) has sha256 {got}, but {index_where} "
                          f"(derived from the shard sha256 {doc['shard_sha256']} the campaign recorded) says {want}")
        out[e.name] = buf
    return out
