"""Skeleton: the non-expert tensors of one source shard, copied byte-verbatim and attested per tensor."""
from __future__ import annotations

from pathlib import Path

from fq import canonical
from fq.attest import keys
from fq.attest.fragment import attest_skeleton
from fq.fragments import write_skeleton
from fq.shards import RawTensor, read_header, read_range


def source_statement(doc: dict, shards) -> dict:
    """The ``source`` field of an attestation: repo, revision and the named shards with their sha256."""
    src = doc["source"]
    return {"repo": src["repo"], "revision": src["revision"],
            "shards": [{"name": s, "sha256": src["shards"][s]["sha256"]} for s in sorted(set(shards))]}


def extract_skeleton(campaign_json: str, key_path: str, staged: str, tensors: list[str], out: str) -> None:
    doc = canonical.load(campaign_json)
    shard = Path(staged).name
    with open(staged, "rb") as fh:
        header = read_header(fh, staged)
        raws = []
        for name in tensors:
            e = header.entry(name)
            raws.append(RawTensor(name, e.dtype, tuple(e.shape), read_range(fh, e.start, e.length, staged)))
    write_skeleton(out, tensors=raws, source_shard=shard)
    attest_skeleton(out, key=keys.load_private(key_path), campaign=doc["identity"],
                    source=source_statement(doc, [shard]), encoder=doc["encoder"])
