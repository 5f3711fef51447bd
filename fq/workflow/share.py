"""Share jobs: a base that publishes another base's encoding of its routed experts (recipe ``Node.experts_from``: the
same K and codebook, so the same expert bytes) gets its fragment of a block from that base's *committed* fragment
instead of encoding the block again.

The owner's fragment is verified under the campaign key (its node digest the recipe's), its tensors are written
byte for byte into a fragment of this base (fq's layout; only the header's ``node`` differs), each expert's range
is checked to hash as the owner's attestation says, and the new fragment is attested with the owner encode's
``quant_args`` and ``source`` and ``experts_from`` naming the owner fragment (name, sha256). The metrics are the
owner's, renamed. No torch, no device, no staged shard: a copy, priced as none (fq.planning.price).
"""
from __future__ import annotations

import sys
from pathlib import Path

from fq.core import atomic, canonical
from fq.errors import FqError
from fq.model.experts import ExpertLayout, suffixes
from fq.model.shards import RawTensor, read_header
from fq.provenance.attest import keys
from fq.provenance.attest.fragment import attest_fragment, check_node_digest, verify_shard
from fq.provenance.fragments import attestation_name, write_fragment
from fq.provenance.identity import bundle_files
from fq.core.canonical import dumps, sha256_hex
from fq.workflow import locks
from fq.workflow.common import check_signer


def check_writer(doc: dict) -> None:
    """The files that lay out a fragment's bytes (the encoder bundle's sources) must be the bound build's: a share
    job writes a fragment header. torch, CUDA and the device do not touch a copy, so they are not compared."""
    mine = sha256_hex(dumps([[p, h] for p, h in bundle_files()]))
    bound = doc["encoder"].get("sources_sha256")
    if mine != bound:
        raise FqError(f"encoder build differs from the one bound to this campaign in sources_sha256 ({bound!r} -> "
                      f"{mine!r}); share with the bound build or start a new campaign")


def share_fragment(*, campaign_json: str, key_path: str, node: str, node_digest: str, owner: str, owner_digest: str,
                   layer: int, block: int, owner_fragment: str, owner_metrics: str, out_fragment: str,
                   out_metrics: str, lock_dir: str, layout: ExpertLayout) -> dict:
    """Base ``node``'s fragment of (layer, block), holding base ``owner``'s committed encoding of it."""
    claim = Path(out_fragment).stem
    locks.hold_worker(lock_dir, claim, f"block {claim} (node {node}: the experts of {owner}, layer {layer})")
    outs = [out_fragment, str(Path(out_fragment).with_name(attestation_name(Path(out_fragment).name))), out_metrics]
    for out in outs:
        for p in locks.remove_dead_temps(Path(out).parent, [Path(out).name]):
            print(f"removed {p}: leftover of an interrupted write of this block", file=sys.stderr)
    doc = canonical.load(campaign_json)
    priv = keys.load_private(key_path)
    pub = priv.public_key()
    check_signer(doc, pub, key_path)
    check_writer(doc)
    src = Path(owner_fragment)
    att = verify_shard(src.parent, src.name, pub, campaign=doc["identity"])
    check_node_digest(att, owner_digest, f"experts of {owner} for {node}")
    p = att.predicate
    if (p["kind"], p["role"], p["node"], p["layer"], p["block"]) != ("expert", "base", owner, layer, block):
        raise FqError(f"{src}: is {p['kind']} {p['role']} node {p['node']} layer {p['layer']} block {p['block']}, "
                      f"not base {owner}'s fragment of layer {layer} block {block}")
    if p.get("experts_from") is not None:
        raise FqError(f"{src}: holds the experts of {p['experts_from']['node']}; share from the base that encodes them")
    data = src.read_bytes()
    with open(src, "rb") as fh:
        header = read_header(fh, str(src))
    view = memoryview(data)
    entries = {e.name: e for e in header.entries}
    tensors = {}
    for e in (x["expert"] for x in p["experts"]):
        tensors[e] = {}
        for proj in layout.projections:
            tensors[e][proj] = {}
            for s in suffixes(p["codebook"]):
                ent = entries[layout.key(layer, e, proj, s)]
                tensors[e][proj][s] = RawTensor(ent.name, ent.dtype, ent.shape, view[ent.start:ent.end])
    info = write_fragment(out_fragment, layout=layout, node=node, role="base", layer=layer, block=block, K=p["K"],
                          codebook=p["codebook"], experts=tensors)
    if [(e.expert, e.length, e.sha256) for e in info.experts] != \
            [(e["expert"], e["length"], e["sha256"]) for e in p["experts"]]:
        raise FqError(f"{out_fragment}: its expert bytes are not those {src.name} attests (changed while copied?)")
    view.release()
    new = attest_fragment(out_fragment, key=priv, campaign=doc["identity"], source=p["source"], encoder=doc["encoder"],
                          quant_args=p["quant_args"], node_digest=node_digest, info=info,
                          experts_from={"node": owner, "name": src.name, "sha256": att.sha256})
    metrics = canonical.load(owner_metrics)
    if metrics.get("sha256") != att.sha256:
        raise FqError(f"{owner_metrics}: metrics of {metrics.get('fragment')!r} sha256 {metrics.get('sha256')!r}, "
                      f"not of the committed {src.name}")
    summary = dict(metrics, node=node, fragment=Path(out_fragment).name, sha256=new.sha256, experts_from=owner)
    atomic.write_text(out_metrics, canonical.pretty(summary))
    return summary
