"""Skeleton: the non-expert tensors of one source shard, copied byte-verbatim and attested per tensor; and its
variants: a whole-model base publishes the skeleton without the linears it quantizes (``derive_variant``).

A skeleton job is a campaign writer like an encode job: it holds ``workers.lock`` shared and the claim
``skeleton-SHARD`` for its lifetime, and signs only with the campaign's bound key."""
from __future__ import annotations

import sys
from pathlib import Path

from fq.core import canonical
from fq.errors import FqError
from fq.model.shards import RawTensor, read_header, read_range
from fq.provenance.attest import keys
from fq.provenance.attest.fragment import attest_skeleton
from fq.provenance.fragments import write_skeleton


def source_statement(doc: dict, shards) -> dict:
    """The ``source`` field of an attestation: repo, revision and the named shards with their sha256."""
    src = doc["source"]
    return {"repo": src["repo"], "revision": src["revision"],
            "shards": [{"name": s, "sha256": src["shards"][s]["sha256"]} for s in sorted(set(shards))]}


def _begin(campaign_json: str, key_path: str, out: str, lock_dir: str | None, lock: str, what: str):
    """(campaign document, signing key) of a skeleton job, after taking its worker lock and removing the temps an
    interrupted write of ``out`` left."""
    from fq.provenance.fragments import attestation_name
    from fq.workflow import locks
    from fq.workflow.common import check_signer

    name = Path(out).name
    if lock_dir is not None:
        locks.hold_worker(lock_dir, lock, what)
        for p in locks.remove_dead_temps(Path(out).parent, [name, attestation_name(name)]):
            print(f"removed {p}: leftover of an interrupted write of this skeleton", file=sys.stderr)
    doc = canonical.load(campaign_json)
    priv = keys.load_private(key_path)
    check_signer(doc, priv.public_key(), key_path)
    return doc, priv


def extract_skeleton(campaign_json: str, key_path: str, staged: str, tensors: list[str], out: str,
                     lock_dir: str | None = None) -> None:
    doc, priv = _begin(campaign_json, key_path, out, lock_dir, f"skeleton-{Path(out).name}",
                       f"skeleton {Path(out).name}")
    shard = Path(staged).name
    with open(staged, "rb") as fh:
        header = read_header(fh, staged)
        raws = []
        for name in tensors:
            e = header.entry(name)
            raws.append(RawTensor(name, e.dtype, tuple(e.shape), read_range(fh, e.start, e.length, staged)))
    write_skeleton(out, tensors=raws, source_shard=shard)
    attest_skeleton(out, key=priv, campaign=doc["identity"],
                    source=source_statement(doc, [shard]), encoder=doc["encoder"])


def derive_variant(campaign_json: str, key_path: str, whole: str, tensors: list[str], out: str,
                   lock_dir: str | None = None) -> None:
    """The skeleton shard ``whole`` (committed, verified here under the campaign key) without the tensors a
    whole-model base replaces: ``tensors`` kept, byte-verbatim, attested per tensor like the whole shard."""
    from fq.provenance.attest.fragment import verify_shard

    doc, priv = _begin(campaign_json, key_path, out, lock_dir, f"skeleton-{Path(out).parent.name}-{Path(out).name}",
                       f"skeleton variant {out}")
    w = Path(whole)
    att = verify_shard(w.parent, w.name, priv.public_key(), campaign=doc["identity"])
    shard = att.predicate["source_shard"]
    with open(whole, "rb") as fh:
        header = read_header(fh, whole)
        if header.sha256 != att.info.header.sha256:
            raise FqError(f"{whole}: changed while it was read")
        digests = {t.name: t.sha256 for t in att.info.tensors}
        raws = []
        for t in tensors:
            e = header.entry(t)
            data = read_range(fh, e.start, e.length, whole)
            if canonical.sha256_hex(data) != digests.get(t):
                raise FqError(f"{whole}: tensor {t!r} is not the attested one (changed while it was read?)")
            raws.append(RawTensor(t, e.dtype, tuple(e.shape), data))
    write_skeleton(out, tensors=raws, source_shard=shard)
    attest_skeleton(out, key=priv, campaign=doc["identity"], source=source_statement(doc, [shard]),
                    encoder=doc["encoder"])
