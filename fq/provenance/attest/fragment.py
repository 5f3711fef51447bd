"""One fq-attestation/1 line beside each shard: ``NAME.safetensors`` + ``NAME.safetensors.intoto.jsonl``.

The line is a DSSE envelope (Ed25519) around an in-toto Statement whose one subject is the shard's
file name and sha256, predicateType ``https://fq.dev/attestation/v1``, predicate per profile:
``expert`` (per expert: offset, length, sha256 of its contiguous byte range; ``K`` the fragment spec as
``fq.core.kbits.to_json`` writes it: an integer, or ``{"gate", "up", "down": K}``), ``linear`` (a whole-model base's
non-expert linears of one class and layer: per linear its range) or ``skeleton`` (per tensor). The attestation digest named by plans is the sha256 of the line's bytes.

Producer side (reads the committed file back, never trusts the caller's digests)::

    attest_fragment(path, key=, campaign=, source=, encoder=, quant_args=, node_digest=, parent=None) -> Attested
    attest_linears(path, key=, campaign=, source=, encoder=, quant_args=, node_digest=) -> Attested
    attest_skeleton(path, key=, campaign=, source=, encoder=) -> Attested

Consumer side::

    read_attestation(root, name, public_key) -> Attested   # signature first, then parse; no payload read
    verify_shard(root, name, public_key, campaign=None) -> Attested   # plus one pass over the shard

Their errors name the files as ``root/name`` (``label``): the same path whichever consumer reads them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fq.core import atomic, kbits
from fq.core.canonical import sha256_hex
from fq.core.safepath import open_regular, read_regular
from fq.errors import FqError
from fq.hessian import store
from fq.model.shards import read_header
from fq.provenance.attest import dsse
from fq.provenance.attest.campaign import require_same
from fq.provenance.attest.keys import fingerprint
from fq.provenance.attest.statement import FRAGMENT, parse_statement, statement
from fq.provenance.fragments import ShardInfo, attestation_name, describe, fragment_filename, linear_filename
from fq.provenance.identity import check_identity, determinism_scope

FORMAT = "fq-attestation/1"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Attested:
    name: str  # the shard's name relative to the root it was read from
    sha256: str  # the shard's sha256, as the signed subject states it
    attestation_sha256: str
    predicate: dict
    info: ShardInfo | None = None  # set when the shard itself was read


def _common(info: ShardInfo, *, key, campaign, source, encoder, determinism) -> dict:
    where = f"attest {info.name}"
    if campaign.get("signer") != fingerprint(key):
        raise FqError(f"{where}: campaign identity names signer {campaign.get('signer')!r}, "
                      f"the signing key is {fingerprint(key)}")
    check_identity(encoder, where)
    if campaign.get("encoder") != encoder["digest"]:
        raise FqError(f"{where}: campaign is bound to encoder {campaign.get('encoder')!r}, "
                      f"this encoder is {encoder['digest']}")
    return {"format": FORMAT, "campaign": campaign, "encoder": encoder,
            "determinism_scope": determinism if determinism is not None else determinism_scope(),
            "source": source, "shard": {"size": info.size, "header_sha256": info.header.sha256}}


def _sign_and_write(path: Path, info: ShardInfo, predicate: dict, key: Ed25519PrivateKey) -> Attested:
    payload = statement([(info.name, info.sha256)], FRAGMENT, predicate)
    line = dsse.envelope_line(dsse.sign(payload, key))
    atomic.write_bytes(path.with_name(attestation_name(path.name)), line)
    return Attested(info.name, info.sha256, sha256_hex(line), predicate, info)


def _describe(path: str | os.PathLike) -> tuple[Path, ShardInfo]:
    p = Path(path)
    with open_regular(p.parent, p.name, str(p)) as fh:
        return p, describe(fh, p.name, str(p))


HESSIAN_FIELDS = {"file", "sha256", "calibration", "capture"}
HESSIAN_OPTIONAL = {"weighting"}  # a router-affinity weighted Hessian's (fq.hessian.affinity); absent when unweighted


def check_quant_args(pred: dict, where: str) -> None:
    """What an expert fragment says it was encoded with must agree with the rest of what it attests: K and codebook
    (when stated) are the fragment's; the stored scales (``stored_scale_log2``, fq.model.experts) are its layout's,
    none where the layout has none; the objective is one fq encodes with; a Hessian only with LDLQ and LDLQ only
    with a Hessian, which must be the artifact of the fragment's own layer (``fq.hessian.store.file_name``). Run
    for every attestation signed (``attest_fragment``) and every one read (``read_attestation``), so every consumer
    applies it whatever its entry point; that all fragments of one layer name one Hessian is
    ``VerifiedProduct.check_fragment``'s (per plan) and ``fq verify``'s (per tree)."""
    qa = pred["quant_args"]
    for k in ("K", "codebook"):
        if k in qa and qa[k] != pred[k]:
            raise FqError(f"{where}: quant_args says {k}={qa[k]!r}, the fragment is {k}={pred[k]!r}")
    scales = (pred.get("layout") or {}).get("stored_scale_log2")  # a linear fragment has no layout, and none
    if qa.get("stored_scale_log2") != scales:
        raise FqError(f"{where}: quant_args stored_scale_log2 {qa.get('stored_scale_log2')!r} is not its layout's "
                      f"{scales!r} (the 2^n its routed projections' tensors store the matrix at)")
    objective = qa.get("objective")
    if objective is not None and objective not in (store.OBJECTIVE_LDLQ, store.OBJECTIVE_WEIGHT):
        raise FqError(f"{where}: quant_args objective {objective!r} is not one fq encodes with "
                      f"({store.OBJECTIVE_LDLQ!r} or {store.OBJECTIVE_WEIGHT!r})")
    h = qa.get("hessian")
    if h is None:
        if objective == store.OBJECTIVE_LDLQ:
            raise FqError(f"{where}: quant_args objective is LDLQ but names no Hessian")
        return
    if objective != store.OBJECTIVE_LDLQ:
        raise FqError(f"{where}: quant_args names a Hessian, but its objective is {objective!r}, not LDLQ")
    if not (isinstance(h, dict) and HESSIAN_FIELDS <= set(h) <= HESSIAN_FIELDS | HESSIAN_OPTIONAL
            and isinstance(h["sha256"], str) and SHA256_HEX.fullmatch(h["sha256"])):
        raise FqError(f"{where}: quant_args hessian must be {{{', '.join(sorted(HESSIAN_FIELDS))}}} (and, weighted, "
                      f"weighting) with a sha256 hex digest")
    want = store.file_name(pred["layer"]) if pred["kind"] == "expert" else _linear_hessian_file(pred["layer"])
    if h["file"] != want:
        raise FqError(f"{where}: a fragment of layer {pred['layer']} names Hessian file {h['file']!r}, not its "
                      f"layer's {want!r} (bound to another layer's Hessian)")
    if h["capture"] not in store.MODES:
        raise FqError(f"{where}: quant_args hessian capture {h['capture']!r} is not one of {', '.join(store.MODES)}")
    if "weighting" in h and (h["weighting"] not in store.WEIGHTED or h["capture"] != "all-experts"
                             or pred["kind"] != "expert"):
        raise FqError(f"{where}: quant_args hessian weighting {h['weighting']!r} (capture {h['capture']!r}) is not one "
                      f"of {', '.join(store.WEIGHTED)} over an all-experts capture of an expert fragment's Hessian")


def _described(path, info: ShardInfo | None, node_digest, digest_of: str) -> tuple[Path, ShardInfo]:
    """(path, its digests): ``info`` as the writer returned it (checked to be this file's), or digested here; and
    ``node_digest`` checked to be a sha256 (``digest_of``: what computes it)."""
    if info is None:
        p, info = _describe(path)
    else:
        p = Path(path)
        if info.name != p.name:
            raise FqError(f"{p}: the digests given are those of {info.name}")
    if not (isinstance(node_digest, str) and SHA256_HEX.fullmatch(node_digest)):
        raise FqError(f"{p}: node_digest {node_digest!r} is not a sha256 hex digest ({digest_of})")
    return p, info


def check_experts_from(pred: dict, where: str) -> None:
    """A base fragment publishing another base's encoding of its experts (``experts_from``: {node, name, sha256} of
    that base's committed fragment of the same block) names a fragment of another base, of the same layer and block."""
    src = pred.get("experts_from")
    if src is None:
        return
    if pred["role"] != "base":
        raise FqError(f"{where}: a stage fragment names experts_from; only a base takes another base's experts")
    if src["node"] == pred["node"]:
        raise FqError(f"{where}: experts_from names its own node {src['node']}")
    want = fragment_filename(src["node"], pred["layer"], pred["block"])
    if src["name"] != want:
        raise FqError(f"{where}: experts_from names {src['name']!r}, not node {src['node']}'s fragment of layer "
                      f"{pred['layer']} block {pred['block']} ({want})")


def attest_fragment(path: str | os.PathLike, *, key: Ed25519PrivateKey, campaign: dict, source: dict,
                    encoder: dict, quant_args: dict, node_digest: str, parent: dict | None = None,
                    determinism: dict | None = None, info: ShardInfo | None = None,
                    experts_from: dict | None = None) -> Attested:
    """Sign the expert fragment at ``path``; ``node_digest`` = the recipe's digest of the fragment's node
    (``Recipe.node_digest``: its definition and its ancestors'), which a plan's chain entry must name;
    ``parent`` = {name, sha256} of the parent's committed fragment, required for a stage and refused
    for a base. ``info``: what write_fragment returned for this file (it read the committed file back and
    digested it), so the writer does not read and hash the same bytes twice; None: digest the file here.
    ``experts_from``: a base publishing another base's encoding of the same experts, {node, name, sha256} of the
    fragment whose expert bytes this one holds (its quant_args and source are that encode's)."""
    p, info = _described(path, info, node_digest, "Recipe.node_digest")
    if info.kind != "expert":
        raise FqError(f"{p}: is a {info.kind} shard; use attest_skeleton")
    m = info.meta
    if p.name != fragment_filename(m["node"], m["layer"], m["block"]):
        raise FqError(f"{p}: a fragment of {m['node']} layer {m['layer']} block {m['block']} must be named "
                      f"{fragment_filename(m['node'], m['layer'], m['block'])}")
    if (m["role"] == "stage") != (parent is not None):
        raise FqError(f"{p}: a {m['role']} fragment {'needs' if m['role'] == 'stage' else 'has no'} parent digest")
    suffix = f"-layer{m['layer']:03d}-block{m['block']:03d}.safetensors"
    if parent is not None and not (isinstance(parent.get("name"), str) and parent["name"].endswith(suffix)):
        raise FqError(f"{p}: parent {parent.get('name')!r} must be the file name of the parent node's fragment "
                      f"of the same block (NODE{suffix})")
    predicate = _common(info, key=key, campaign=campaign, source=source, encoder=encoder, determinism=determinism)
    predicate.update({"kind": "expert", "node": m["node"], "node_digest": node_digest, "role": m["role"],
                      "layer": m["layer"], "block": m["block"], "K": kbits.to_json(m["K"]), "codebook": m["codebook"],
                      "layout": m["layout"].to_json(), "quant_args": quant_args, "parent": parent,
                      "experts": [e.to_json() for e in info.experts]})
    if experts_from is not None:  # absent otherwise: an encoded fragment's attestation is as it always was
        predicate["experts_from"] = experts_from
    check_quant_args(predicate, str(p))  # never sign what a consumer would refuse
    check_experts_from(predicate, str(p))
    return _sign_and_write(p, info, predicate, key)


def _linear_hessian_file(layer: int | None) -> str:
    from fq.hessian.linear_store import linear_file_name

    return linear_file_name(layer)


def attest_linears(path: str | os.PathLike, *, key: Ed25519PrivateKey, campaign: dict, source: dict, encoder: dict,
                   quant_args: dict, node_digest: str, parent: dict | None = None, determinism: dict | None = None,
                   info: ShardInfo | None = None) -> Attested:
    """Sign a linear fragment (a linear node's encoding of one class of one layer, or of the head); ``node_digest``:
    ``LinearNode.digest``, which a base's plan names for that class. ``parent``: a stage's residual on the class,
    {name, sha256} of the committed linear fragment of the same layer it corrects (its role is then ``stage``)."""
    p, info = _described(path, info, node_digest, "LinearNode.digest")
    if info.kind != "linear":
        raise FqError(f"{p}: is a {info.kind} shard; use attest_{'skeleton' if info.kind == 'skeleton' else 'fragment'}")
    m = info.meta
    if p.name != linear_filename(m["node"], m["layer"]):
        raise FqError(f"{p}: a linear fragment of {m['node']} layer {m['layer']} must be named "
                      f"{linear_filename(m['node'], m['layer'])}")
    suffix = "-head.safetensors" if m["layer"] is None else f"-layer{m['layer']:03d}.safetensors"
    if parent is not None and not (isinstance(parent.get("name"), str) and parent["name"].endswith(suffix)
                                   and m["node"].startswith(parent["name"][: -len(suffix)] + "+")):
        raise FqError(f"{p}: parent {parent.get('name')!r} must be the file name of the linear fragment of the same "
                      f"layer this residual corrects (PARENT{suffix}, {m['node']} = PARENT+K..)")
    predicate = _common(info, key=key, campaign=campaign, source=source, encoder=encoder, determinism=determinism)
    predicate.update({"kind": "linear", "node": m["node"], "node_digest": node_digest,
                      "role": "base" if parent is None else "stage",
                      "class": m["class"], "layer": m["layer"], "block": None, "K": m["K"], "codebook": m["codebook"],
                      "layout": None, "quant_args": quant_args, "parent": parent,
                      "linears": [t.to_json() for t in info.tensors]})
    check_quant_args(predicate, str(p))
    return _sign_and_write(p, info, predicate, key)


def attest_skeleton(path: str | os.PathLike, *, key: Ed25519PrivateKey, campaign: dict, source: dict,
                    encoder: dict, determinism: dict | None = None) -> Attested:
    """Sign a skeleton shard: per-tensor sha256; its source shard must be among ``source['shards']``."""
    p, info = _describe(path)
    if info.kind != "skeleton":
        raise FqError(f"{p}: is an {info.kind} fragment; use attest_fragment")
    src_shard = info.meta["source_shard"]
    if src_shard not in [s.get("name") for s in source.get("shards", [])]:
        raise FqError(f"{p}: skeleton of {src_shard!r}, which the attested source does not list")
    predicate = _common(info, key=key, campaign=campaign, source=source, encoder=encoder, determinism=determinism)
    predicate.update({"kind": "skeleton", "node": None, "node_digest": None, "role": None, "layer": None,
                      "block": None, "K": None, "codebook": None, "layout": None, "quant_args": None, "parent": None,
                      "source_shard": src_shard, "tensors": [t.to_json() for t in info.tensors]})
    return _sign_and_write(p, info, predicate, key)


def check_location(name: str, pred: dict, att: str) -> None:
    """A fragment lives where its attestation says: file NODE-layerLLL-blockBBB.safetensors, and when its
    name has directories (a name in a tree), in its node's directory (``base/NODE/``, ``stages/NODE/``,
    ``fragments/NODE/``), a base under ``base/`` and a stage under ``stages/`` — a validly signed fragment
    copied into another node's directory is refused. (A skeleton names no node; its subject binds its name.)"""
    parts = name.split("/")
    base = parts[-1]
    if pred["kind"] == "linear":
        if base != linear_filename(pred["node"], pred["layer"]):
            raise FqError(f"{att}: attests linear node {pred['node']} layer {pred['layer']}, which is not file {base!r}")
        area = {"base": "base", "stage": "stages"}[pred["role"]]
        if len(parts) >= 2 and parts[-2] not in (pred["node"],) and parts[-3:-2] != [area]:
            raise FqError(f"{att}: a linear fragment of node {pred['node']} lies in directory "
                          f"{'/'.join(parts[:-1])}/; it belongs in its node's directory or a "
                          f"{'base' if area == 'base' else 'stage'}'s ({area}/NODE/)")
        return
    if pred["kind"] != "expert":
        return
    if base != fragment_filename(pred["node"], pred["layer"], pred["block"]):
        raise FqError(f"{att}: attests node {pred['node']} layer {pred['layer']} block {pred['block']}, "
                      f"which is not file {base!r}")
    if len(parts) >= 2 and parts[-2] != pred["node"]:
        raise FqError(f"{att}: a fragment of node {pred['node']} lies in directory {'/'.join(parts[:-1])}/; "
                      f"it belongs in its node's directory ({pred['node']}/)")
    area = {"base": "base", "stage": "stages"}[pred["role"]]
    if len(parts) >= 3 and parts[-3] in ("base", "stages") and parts[-3] != area:
        raise FqError(f"{att}: a {pred['role']} fragment lies under {parts[-3]}/; {pred['role']}s live under {area}/")


def label(root: str | os.PathLike, name: str) -> str:
    """How messages name ``root/name``: the root as the caller gave it joined with the name (one path, the same in
    every consumer's messages: ``fq verify``'s lines, ``fq combine``'s, the runtime's)."""
    return str(Path(root, name))


def read_attestation(root: str | os.PathLike, name: str, public_key: Ed25519PublicKey,
                     campaign: dict | None = None, sha256: str | None = None) -> Attested:
    """Verify the attestation of shard ``root/name`` without touching the shard. ``sha256``: the
    attestation digest a plan pins, compared first: a line that is not the pinned one is refused whatever
    else it holds (its own problems, found with bounded work, only word the refusal)."""
    att = label(root, attestation_name(name))
    data = read_regular(root, attestation_name(name), att)
    if sha256 is not None and sha256_hex(data) != sha256:
        # refused: not the line the plan pins. Its own problem, if it has one, says more than "another digest";
        # finding it is bounded work (capped signatures, size and depth limits)
        _check_line(data, att, name, public_key, campaign)
        raise FqError(f"{att}: attestation is not the one the plan names (sha256 {sha256_hex(data)[:16]}…, the "
                      f"plan names {sha256[:16]}…)")
    return _check_line(data, att, name, public_key, campaign)


def _check_line(data: bytes, att: str, name: str, public_key: Ed25519PublicKey, campaign: dict | None) -> Attested:
    payload = dsse.open_envelope(data, public_key, att)
    subjects, pred = parse_statement(payload, att, FRAGMENT)
    base = name.rsplit("/", 1)[-1]
    if len(subjects) != 1:
        raise FqError(f"{att}: names {len(subjects)} subjects, a shard attestation names exactly one")
    subj_name, subj_sha = subjects[0]
    if subj_name != base:
        raise FqError(f"{att}: attests {subj_name!r}, not {base!r} (attestation replayed from another shard?)")
    check_location(name, pred, att)
    if pred["kind"] == "expert" and kbits.to_json(kbits.fragment(pred["K"], f"{att}: K")) != pred["K"]:
        raise FqError(f"{att}: K {pred['K']!r} is not in its one form (a uniform K is an integer)")
    if pred["kind"] in ("expert", "linear"):
        check_quant_args(pred, att)
    if pred["kind"] == "expert":
        check_experts_from(pred, att)
    if pred["campaign"]["signer"] != fingerprint(public_key):
        raise FqError(f"{att}: campaign identity names signer {pred['campaign']['signer'][:16]}…, "
                      f"not the pinned key {fingerprint(public_key)[:16]}…")
    check_identity(pred["encoder"], att)
    if pred["campaign"]["encoder"] != pred["encoder"]["digest"]:
        raise FqError(f"{att}: encoder {pred['encoder']['digest'][:16]}… is not the campaign's encoder")
    if campaign is not None:
        require_same(pred["campaign"], campaign, att)
    return Attested(name, subj_sha, sha256_hex(data), pred)


def check_header(att: Attested, info_header, source: str) -> None:
    if info_header.sha256 != att.predicate["shard"]["header_sha256"]:
        raise FqError(f"{source}: safetensors header differs from the attested one "
                      "(offsets, names or metadata altered after signing)")


def check_node_digest(att: Attested, digest: str, where: str) -> None:
    """A fragment serves a chain node only if it was encoded for that node's current definition: its
    attested ``node_digest`` must be the digest the chain names (``Recipe.node_digest``)."""
    got, node = att.predicate["node_digest"], att.predicate["node"]
    if got != digest:
        raise FqError(f"{where}: fragment {att.name} attests node_digest {got[:16]}…, the chain's digest of node "
                      f"{node} is {digest[:16]}…: encoded for another definition of node {node}; re-encode it")


def range_mismatch(att: Attested, expert: int, got_sha: str, source: str) -> FqError:
    """The error for an expert range whose bytes are not the attested ones, naming a swap when it is one."""
    others = [e["expert"] for e in att.predicate["experts"] if e["sha256"] == got_sha and e["expert"] != expert]
    if others:
        return FqError(f"{source}: bytes of expert {expert} are those attested for expert {others[0]} "
                       "(expert byte ranges swapped)")
    return FqError(f"{source}: bytes of expert {expert} do not match the attested sha256 (payload altered)")


def compare(att: Attested, info: ShardInfo, source: str) -> None:
    """Everything the shard's own bytes say must equal what was signed; most specific problem first."""
    pred = att.predicate
    if info.kind != pred["kind"]:
        raise FqError(f"{source}: shard is {info.kind}, its attestation says {pred['kind']}")
    check_header(att, info.header, source)
    if info.size != pred["shard"]["size"]:
        raise FqError(f"{source}: {info.size} bytes, attested {pred['shard']['size']}")
    if info.kind == "expert":
        m = dict(info.meta, K=kbits.to_json(info.meta["K"]))
        for f in ("node", "role", "layer", "block", "K", "codebook"):
            if m[f] != pred[f]:
                raise FqError(f"{source}: header says {f}={m[f]!r}, attestation says {pred[f]!r}")
        if m["layout"].to_json() != pred["layout"]:
            raise FqError(f"{source}: header layout differs from the attested layout")
        attested = {e["expert"]: e for e in pred["experts"]}
        got = {e.expert: e for e in info.experts}
        if set(got) != set(attested):
            raise FqError(f"{source}: holds experts {sorted(got)}, attested {sorted(attested)}")
        for ex, e in got.items():
            a = attested[ex]
            if (e.offset, e.length) != (a["offset"], a["length"]):
                raise FqError(f"{source}: expert {ex} occupies [{e.offset}, +{e.length}), attested "
                              f"[{a['offset']}, +{a['length']})")
            if e.sha256 != a["sha256"]:
                raise range_mismatch(att, ex, e.sha256, source)
    elif info.kind == "linear":
        m = info.meta
        for f in ("node", "class", "layer", "K", "codebook"):
            if m[f] != pred[f]:
                raise FqError(f"{source}: header says {f}={m[f]!r}, attestation says {pred[f]!r}")
        if [t.to_json() for t in info.tensors] != pred["linears"]:
            names = [t.name for t in info.tensors]
            if names != [t["name"] for t in pred["linears"]]:
                raise FqError(f"{source}: holds linears {names}, attested {[t['name'] for t in pred['linears']]}")
            bad = next(t.name for t, a in zip(info.tensors, pred["linears"]) if t.to_json() != a)
            raise FqError(f"{source}: linear {bad!r} differs from its attested range or sha256 (payload altered)")
    else:
        if info.meta["source_shard"] != pred["source_shard"]:
            raise FqError(f"{source}: skeleton of {info.meta['source_shard']!r}, attested {pred['source_shard']!r}")
        attested = {t["name"]: t for t in pred["tensors"]}
        if [t.name for t in info.tensors] != [t["name"] for t in pred["tensors"]]:
            raise FqError(f"{source}: tensor names differ from the attested ones")
        for t in info.tensors:
            if t.to_json() != attested[t.name]:
                raise FqError(f"{source}: tensor {t.name!r} differs from its attested range or sha256")
    if info.sha256 != att.sha256:
        raise FqError(f"{source}: sha256 {info.sha256[:16]}… differs from the attested {att.sha256[:16]}…")


def verify_shard(root: str | os.PathLike, name: str, public_key: Ed25519PublicKey,
                 campaign: dict | None = None) -> Attested:
    """Attestation first (signature, then parse), then one read of the shard checked against it."""
    att = read_attestation(root, name, public_key, campaign)
    where = label(root, name)
    with open_regular(root, name, where, size=att.predicate["shard"]["size"], listed_by="its attestation") as fh:
        check_header(att, read_header(fh, where), where)  # a header altered after signing, named as such
        info = describe(fh, name, where)
    compare(att, info, where)
    return Attested(att.name, att.sha256, att.attestation_sha256, att.predicate, info)
