"""The base manifest: one signed line naming every file of a published base with its sha256.

``BASE_DIR/fq-manifest.intoto.jsonl`` is a DSSE envelope around an in-toto Statement whose subjects
are every file of the base directory (skeleton shards, expert fragments, their attestations,
config/tokenizer files), predicateType ``https://fq.dev/base-manifest/v1``. The *base manifest
digest* that plans pin is the sha256 of this line's bytes; ``fq combine --base DIR`` compares it with
the base actually on disk.

    write_base_manifest(base_dir, node=, campaign=, key=) -> (path, sha256)
    read_base_manifest(base_dir, public_key, campaign=None) -> Manifest   # signature first
    check_base_files(base_dir, manifest) -> list[str]                    # re-hash; strays and misses
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fq import atomic
from fq.attest import dsse
from fq.attest.campaign import require_same
from fq.attest.keys import fingerprint
from fq.attest.statement import MANIFEST, parse_statement, statement
from fq.canonical import sha256_hex
from fq.errors import FqError
from fq.safepath import check_name, open_regular, read_regular, sha256_stream

MANIFEST_NAME = "fq-manifest.intoto.jsonl"


@dataclass(frozen=True)
class Manifest:
    sha256: str
    node: str
    campaign: dict
    files: dict  # name -> (sha256, size)


def list_files(base_dir: str | os.PathLike) -> list[str]:
    """Relative names of every file under ``base_dir`` except the manifest; refuses symlinks and
    anything that is not a regular file or directory."""
    base = Path(base_dir)
    names = []
    for dirpath, dirnames, filenames in os.walk(base):
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                raise FqError(f"{os.path.join(dirpath, d)}: is a symlink; a base holds only real files")
        for f in filenames:
            rel = Path(dirpath, f).relative_to(base).as_posix()
            if rel != MANIFEST_NAME and not f.startswith(".tmp-"):
                names.append(check_name(rel, f"{base}/{rel}"))
    return sorted(names)


def _hash(base_dir, name: str) -> tuple[str, int]:
    with open_regular(base_dir, name, f"{base_dir}/{name}") as fh:
        digest, size, _ = sha256_stream(fh)
    return digest, size


def write_base_manifest(base_dir: str | os.PathLike, *, node: str, campaign: dict,
                        key: Ed25519PrivateKey) -> tuple[Path, str]:
    names = list_files(base_dir)
    if not names:
        raise FqError(f"{base_dir}: empty base; nothing to manifest")
    if campaign.get("signer") != fingerprint(key):
        raise FqError(f"{base_dir}: campaign names signer {campaign.get('signer')!r}, the key is {fingerprint(key)}")
    hashed = [(n, *_hash(base_dir, n)) for n in names]
    predicate = {"format": "fq-base-manifest/1", "node": node, "campaign": campaign,
                 "files": [{"name": n, "size": size} for n, _, size in hashed]}
    line = dsse.envelope_line(dsse.sign(statement([(n, d) for n, d, _ in hashed], MANIFEST, predicate), key))
    path = Path(base_dir) / MANIFEST_NAME
    atomic.write_bytes(path, line)
    return path, sha256_hex(line)


def read_base_manifest(base_dir: str | os.PathLike, public_key: Ed25519PublicKey,
                       campaign: dict | None = None) -> Manifest:
    where = f"{base_dir}/{MANIFEST_NAME}"
    data = read_regular(base_dir, MANIFEST_NAME, where)
    subjects, pred = parse_statement(dsse.open_envelope(data, public_key, where), where, MANIFEST)
    if pred["campaign"]["signer"] != fingerprint(public_key):
        raise FqError(f"{where}: campaign identity names another signer than the pinned key")
    if campaign is not None:
        require_same(pred["campaign"], campaign, where)
    sizes = {f["name"]: f["size"] for f in pred["files"]}
    if sorted(sizes) != sorted(n for n, _ in subjects) or len(sizes) != len(subjects):
        raise FqError(f"{where}: subjects and predicate files name different files")
    for n, _ in subjects:
        check_name(n, f"{where}: subject")
    return Manifest(sha256_hex(data), pred["node"], pred["campaign"], {n: (d, sizes[n]) for n, d in subjects})


def check_base_files(base_dir: str | os.PathLike, manifest: Manifest) -> list[str]:
    """One line per problem: a listed file missing or different, or a file the manifest does not list."""
    problems = []
    try:
        present = set(list_files(base_dir))
    except FqError as e:
        return [str(e)]
    for name in sorted(present - set(manifest.files)):
        problems.append(f"{base_dir}/{name}: not listed in {MANIFEST_NAME} (stray file in a published base)")
    for name, (digest, size) in sorted(manifest.files.items()):
        if name not in present:
            problems.append(f"{base_dir}/{name}: listed in {MANIFEST_NAME} but missing")
            continue
        try:
            got, got_size = _hash(base_dir, name)
        except FqError as e:
            problems.append(str(e))
            continue
        if (got, got_size) != (digest, size):
            problems.append(f"{base_dir}/{name}: sha256/size differ from {MANIFEST_NAME}")
    return problems
