"""An insider's re-signing of a published tree: after an edit, every signed document that names the edited files is
signed again with the campaign's own key, with none of the producer's checks -- what a careless or hostile holder of
the key can publish. What stays refused is what the consumers check of the files together.

    resign_tree(root, priv, oms=None)      # base manifests (model.sig), plans, the publication statement, over the files as they are
    reattest(path, priv, edit=None)        # a shard's attestation signed again (``edit(predicate)`` may change it)
    rewrite_skeleton(path, priv, edit)     # a skeleton shard rewritten (``edit(tensors) -> tensors``) and re-attested
    write_index(base_dir)                  # model.safetensors.index.json over the base's shards as they are
    statement_of(path) / sign(statement, priv)
"""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from fq.core import canonical
from fq.provenance.assembly import payload_bytes, sign_assembly
from fq.provenance.attest import dsse
from fq.provenance.manifest import MANIFEST_NAME, list_files

INDEX = "model.safetensors.index.json"
PUBLICATION = "publication.intoto.jsonl"


def statement_of(path: Path) -> dict:
    return canonical.loads(base64.b64decode(canonical.loads(Path(path).read_bytes())["payload"]))


def sign(st: dict, priv) -> bytes:
    return dsse.envelope_line(dsse.sign(canonical.dumps(st), priv))


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def reattest(path: Path, priv, edit=None) -> None:
    """The shard's attestation over its bytes as they are now: subject digest, shard size, header digest and the
    per-tensor or per-expert ranges refreshed by fq's own reader; ``edit(predicate)`` after."""
    from fq.provenance.fragments import describe

    path = Path(path)
    att = path.with_name(path.name + ".intoto.jsonl")
    st = statement_of(att)
    with open(path, "rb") as fh:
        info = describe(fh, path.name, str(path))
    st["subject"][0]["digest"]["sha256"] = info.sha256
    pred = st["predicate"]
    pred["shard"] = {"size": info.size, "header_sha256": info.header.sha256}
    key = {"linear": "linears", "skeleton": "tensors"}.get(pred["kind"])  # ranges as the bytes now are
    if key:
        pred[key] = [t.to_json() for t in info.tensors]
    else:
        pred["experts"] = [e.to_json() for e in info.experts]
    if edit:
        edit(st["predicate"])
    att.write_bytes(sign(st, priv))


def rewrite_skeleton(path: Path, priv, edit) -> None:
    """A skeleton shard written again by fq's writer from ``edit({name: tensor})`` and attested by fq's signer
    with the old attestation's campaign, source and encoder."""
    from safetensors import safe_open

    from fq.provenance.attest.fragment import attest_skeleton
    from fq.provenance.fragments import write_skeleton

    path = Path(path)
    pred = statement_of(path.with_name(path.name + ".intoto.jsonl"))["predicate"]
    with safe_open(str(path), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors = edit(tensors)
    path.unlink()
    write_skeleton(path, tensors=sorted(tensors.items()), source_shard=pred["source_shard"])
    attest_skeleton(path, key=priv, campaign=pred["campaign"], source=pred["source"], encoder=pred["encoder"])


def write_index(base_dir: Path) -> None:
    from fq.model.shards import read_header

    base_dir = Path(base_dir)
    wm = {}
    for p in sorted(base_dir.glob("*.safetensors")):
        with open(p, "rb") as fh:
            for e in read_header(fh, str(p)).entries:
                wm[e.name] = p.name
    doc = canonical.loads((base_dir / INDEX).read_bytes())
    doc["weight_map"] = wm
    (base_dir / INDEX).write_bytes(canonical.pretty(doc).encode())


def resign_manifest(base_dir: Path, priv, oms=None) -> str:
    """The base manifest over the base's files as they are now (derived declarations kept, their inputs' digests
    refreshed); returns its sha256. Its OpenSSF model signature (model.sig) is signed again with ``oms`` (the
    campaign's model-signing key); without it, dropped with the manifest's declaration of it, as an insider holding
    the Ed25519 key alone would."""
    from fq.provenance.model_sig import SIGNATURE, write_signature

    base_dir = Path(base_dir)
    st = statement_of(base_dir / MANIFEST_NAME)
    pred = st["predicate"]
    if oms is None and "model_signing" in pred:
        del pred["model_signing"]
        (base_dir / SIGNATURE).unlink(missing_ok=True)
    rederive(base_dir, pred)
    digest = {n: _sha(base_dir / n) for n in list_files(base_dir)}
    pred["files"] = [{"name": n, "size": (base_dir / n).stat().st_size} for n in digest]
    for d in pred.get("derived", []):
        d["from"] = [{"name": f["name"], "sha256": digest[f["name"]]} for f in d["from"] if f["name"] in digest]
    st["subject"] = [{"name": n, "digest": {"sha256": h}} for n, h in digest.items()]
    line = sign(st, priv)
    (base_dir / MANIFEST_NAME).write_bytes(line)
    if oms is not None and "model_signing" in pred:
        write_signature(base_dir, {**digest, MANIFEST_NAME: hashlib.sha256(line).hexdigest()}, oms)
    return hashlib.sha256(line).hexdigest()


def rederive(base_dir: Path, pred: dict) -> None:
    """The derived files recomputed by their declared rules over the base as it is now (a whole-model base's
    ``model_bits`` set to what its shards hold), as an insider running fq's own derivation would."""
    from fq.provenance.derived import RULES
    from fq.provenance.exl3config import storage_bits, tensor_storage

    listed = [n for n in list_files(base_dir) if n not in {d["name"] for d in pred.get("derived", [])}]
    for d in pred.get("derived", []):
        rule, params = RULES[d["rule"]], d["params"]
        inputs = rule.inputs(listed)
        if "model_bits" in params:
            shards = sorted(n for n in listed if n.endswith(".safetensors"))
            params["model_bits"] = storage_bits(tensor_storage(base_dir, shards, params["bits"], params["codebook"],
                                                               params.get("linears")))
        (base_dir / d["name"]).write_bytes(rule.derive(base_dir, inputs, params))


def resign_plan(root: Path, plan_path: Path, priv, edit=None) -> None:
    """A plan over the tree as it is now: entries whose file is gone dropped, the others' digests and sizes
    refreshed, the base manifest's digest the one on disk; ``edit(plan)`` after."""
    plan = statement_of(plan_path)["predicate"]
    for key in ("fragments", "linears", "stage_linears"):
        if key not in plan:
            continue
        kept = []
        for f in plan[key]:
            p = root / f["name"]
            if not p.is_file():
                continue
            f["sha256"], f["size"] = _sha(p), p.stat().st_size
            f["attestation_sha256"] = _sha(p.with_name(p.name + ".intoto.jsonl"))
            if "header_sha256" in f:
                f["header_sha256"] = statement_of(p.with_name(p.name + ".intoto.jsonl"))["predicate"]["shard"][
                    "header_sha256"]
            kept.append(f)
        plan[key] = kept
    plan["base"]["manifest"]["sha256"] = _sha(root / plan["base"]["manifest"]["name"])
    if edit:
        edit(plan)
    plan_path.write_bytes(sign_assembly(plan, priv))


def resign_publication(root: Path, priv) -> None:
    pub_path = root / PUBLICATION
    st = statement_of(pub_path)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p != pub_path)
    sha = {n: _sha(root / n) for n in files}
    st["subject"] = [{"name": n, "digest": {"sha256": sha[n]}} for n in files]
    for b in st["predicate"]["bases"].values():
        b["manifest_sha256"] = sha.get(b["manifest"], b["manifest_sha256"])
    for entry in st["predicate"]["products"].values():
        entry["sha256"] = sha[entry["file"]]
        entry["bytes"] = payload_bytes(statement_of(root / entry["file"])["predicate"])
    pub_path.write_bytes(sign(st, priv))


def resign_tree(root: Path, priv, edit_plan=None, oms=None) -> None:
    """Every base manifest (and model.sig: ``resign_manifest``), every plan (``edit_plan(plan)`` on each) and the
    publication statement, in that order."""
    root = Path(root)
    for m in sorted(root.glob(f"base/*/{MANIFEST_NAME}")):
        resign_manifest(m.parent, priv, oms)
    for plan in sorted(root.glob("assemblies/*.assembly.intoto.jsonl")):
        resign_plan(root, plan, priv, edit_plan)
    resign_publication(root, priv)
