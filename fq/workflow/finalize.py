"""Finalize: verify every committed fragment, refuse strays, publish bases, stages and signed assemblies.

Idempotent and resumable: a published file that already holds the expected bytes is kept, anything
else under ``published/`` that finalize would not itself write is refused by name (finalize accepts
the names it publishes, never another block layout's leftovers). Every write is atomic, manifests and
assemblies are deterministic (Ed25519 signatures are), so finalizing twice gives the same bytes.

Published layout (``OUT/published``)::

    base/NODE/       a directory an EXL3 runtime loads: source_config.json (the source's config.json, verbatim),
                     config.json and quantization_config.json (derived from it and the shards:
                     fq.provenance.exl3config), README.md (the model card, derived from those two and its signed
                     params: fq.provenance.model_card), model.sig (the OpenSSF model signature of the directory, when the
                     campaign has a model-signing key: fq.provenance.model_sig),
                     tokenizer and generation files, skeleton shards, NODE's fragments, model.safetensors.index.json,
                     fq-manifest.intoto.jsonl            (every shard with its .intoto.jsonl beside it)
    stages/NODE/     NODE's fragments, and its residuals on non-expert linears (recipe ``skeleton`` on a stage)
    assemblies/      PRODUCT.assembly.intoto.jsonl
    publication.intoto.jsonl   the signed publication statement (fq.provenance.publication): every file above with its
                               sha256, the products, plans and bases, and the version (assembly.version)

and ``OUT/campaign_summary.json`` beside it (unsigned: the view of the publication statement that
``fq.provenance.summary.summary_view`` derives, checked against it field by field), so that every file under
``published/`` is attested or listed by a signed document.

Finalize holds ``OUT/locks/workers.lock`` exclusively for its whole body (verify and publish), so no
worker -- not even an orphan of a killed Snakemake -- can write into the campaign meanwhile, and it
refuses to start while one is alive. Holding that lock also proves every ``.tmp-*`` leftover of an
interrupted write dead, so finalize removes them (by name, in the log) instead of refusing them. A kill
at any point leaves only whole files under their final names (each write is temp + fsync + rename);
the next run redoes what is missing and keeps what already holds the expected bytes. A full disk stops
it with one line naming the file and the filesystem, and leaves no partial file published.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

from fq.core import atomic, canonical, kbits
from fq.core.safepath import sha256_file
from fq.errors import FqError
from fq.provenance.assembly import SignedPlan, build_assembly, write_assembly
from fq.provenance.attest import keys
from fq.provenance.attest.fragment import check_node_digest, verify_shard
from fq.provenance.derived import DERIVED_ORDER
from fq.provenance.exl3config import CONFIG, QUANTIZATION_CONFIG, SOURCE_CONFIG, write_derived
from fq.provenance.model_card import README, card_params, write_card
from fq.provenance import model_sig
from fq.provenance.fragments import attestation_name
from fq.provenance.manifest import MANIFEST_NAME, read_base_manifest, write_base_manifest
from fq.provenance.publication import NAME as PUBLICATION_NAME, build_publication, write_publication
from fq.provenance.summary import summary_view
from fq.hessian.store import OBJECTIVE_WEIGHT
from fq.workflow.calibration import check_weighting, quant_hessian, read_binding
from fq.workflow import locks
from fq.workflow.campaign import Campaign
from fq.workflow.common import INDEX, SIDE_FILES, SUMMARY, check_signer


MODEL_SIGNING_PUB = "model-signing.pub"  # OUT/model-signing.pub, beside OUT/signer.pub


class Problems(list):
    def raise_if_any(self, what: str) -> None:
        if self:
            raise FqError(f"{what}: {len(self)} problem(s): " + "; ".join(self))


def _expected_committed(c: Campaign) -> dict[str, dict[str, str]]:
    """dir -> {file name: role} of every file finalize expects in fragments/ and skeleton/."""
    exp: dict[str, dict[str, str]] = {}
    for f in c.fragments:
        p = Path(c.fragment(f.node, f.block))
        exp.setdefault(str(p.parent), {})[p.name] = "fragment"
        exp[str(p.parent)][attestation_name(p.name)] = "attestation"
    for s in [c.skeleton(s) for s in c.skeleton_shards] + c.linears.variant_files()[::2]:
        p = Path(s)
        exp.setdefault(str(p.parent), {})[p.name] = "skeleton"
        exp[str(p.parent)][attestation_name(p.name)] = "attestation"
    for node, layer in c.linears.jobs:
        p = Path(c.linears.fragment(node, layer))
        exp.setdefault(str(p.parent), {})[p.name] = "linear"
        exp[str(p.parent)][attestation_name(p.name)] = "attestation"
    return exp


def check_strays(c: Campaign) -> Problems:
    problems = Problems()
    exp = _expected_committed(c)
    for top in (c.out / "fragments", c.out / "skeleton", c.out / "linears"):
        if not top.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            if dirpath not in exp and filenames:
                problems.append(f"stray directory {dirpath}: the plan has no node or shard there")
                continue
            for name in sorted(filenames):
                path = Path(dirpath, name)
                if name.startswith(".tmp-"):
                    problems.append(f"{path}: leftover temp file of an interrupted write; remove it")
                elif name not in exp.get(dirpath, {}):
                    problems.append(f"stray shard {path}: not in this campaign's plan (another block layout or "
                                    f"recipe?); remove it or encode into a fresh campaign directory")
    return problems


_T0 = [0.0]


def _log(msg: str) -> None:
    """One progress line in the finalize log, with the seconds since finalize started."""
    print(f"finalize: {msg} [+{time.monotonic() - _T0[0]:.3f} s]", file=sys.stderr, flush=True)


def remove_interrupted_writes(c: Campaign) -> list[Path]:
    """``.tmp-*`` leftovers under fragments/, skeleton/, published/ and the summary's directory. Only with
    workers.lock held exclusively: then no writer is alive, and these are dead halves of killed writes."""
    removed = []
    for top in (c.out / "fragments", c.out / "skeleton", c.out / "linears", c.out / "published"):
        if top.is_dir():
            for dirpath, dirnames, filenames in os.walk(top):
                for name in sorted(filenames + dirnames):
                    p = Path(dirpath, name)
                    if name.startswith(".tmp-"):
                        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                        removed.append(p)
    removed += locks.remove_dead_temps(c.out, [SUMMARY])
    return removed


@contextlib.contextmanager
def disk_full_is_one_line(path: Path):
    """ENOSPC/EDQUOT while writing ``path`` becomes one FqError naming the file and its filesystem."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        d = path.parent if path.parent.exists() else Path(".")
        free = shutil.disk_usage(d).free
        raise FqError(f"{path}: {os.strerror(e.errno)} while writing it ({free} bytes free on the filesystem of "
                      f"{d}); the interrupted write was removed, so nothing partial is published under that name. "
                      f"Free space there and run Snakemake again (finalize resumes)") from None


def check_objective(c: Campaign, att, layer: int, where: str) -> None:
    """A fragment of a calibrated layer must attest the layer's bound Hessian (its sha256, token digest and
    capture mode); one of any other layer must attest weight-only encoding. So no published product mixes
    fragments of a layer encoded against two different Hessians, or against none where one was bound."""
    qa = att.predicate.get("quant_args") or {}
    if layer not in c.calib.calibrated_layers:
        if qa.get("objective") != OBJECTIVE_WEIGHT or "hessian" in qa:
            raise FqError(f"{where}: attests objective {qa.get('objective')!r}; layer {layer} of this campaign is "
                          f"encoded weight-only ({OBJECTIVE_WEIGHT!r}); re-encode it")
        return
    bound = read_binding(c.calib.hessian_binding(layer))
    if bound is None:
        raise FqError(f"{where}: layer {layer} is calibrated but has no bound Hessian "
                      f"({c.calib.hessian_binding(layer)} missing); run its calibration job")
    check_weighting(bound, c.calib.settings["weighting"], c.calib.hessian_binding(layer), layer)
    if qa.get("hessian") != quant_hessian(bound):
        got = (qa.get("hessian") or {}).get("sha256") if isinstance(qa.get("hessian"), dict) else None
        raise FqError(f"{where}: encoded against Hessian {got or 'none'}, but the campaign bound layer {layer}'s "
                      f"Hessian to {bound['sha256']} ({c.calib.hessian_binding(layer)}); re-encode it")


def verify_committed(c: Campaign, pub, ident: dict) -> dict[tuple, object]:
    """Verify every planned fragment and skeleton; returns (node, layer, first_expert) -> Attested."""
    problems = Problems()
    done = {}
    for f in c.fragments:
        p = Path(c.fragment(f.node, f.block))
        try:
            att = verify_shard(p.parent, p.name, pub, campaign=ident)
            check_node_digest(att, c.recipe.node_digest(f.node), f"finalize {p}")
            check_objective(c, att, f.block.layer, f"finalize {p}")
            done[(f.node, f.block.layer, f.block.first_expert)] = att
        except FqError as e:
            problems.append(str(e))
    for f in c.fragments:  # chain edges: a stage names the parent fragment actually committed
        att = done.get((f.node, f.block.layer, f.block.first_expert))
        node = c.recipe.node(f.node)
        if att is None or node.is_base:
            continue
        parent = done.get((node.parent, f.block.layer, f.block.first_expert))
        want = att.predicate["parent"]
        if parent is not None and (want["name"], want["sha256"]) != (parent.name, parent.sha256):
            problems.append(f"{c.fragment(f.node, f.block)}: encoded against parent {want['name']} sha256 "
                            f"{want['sha256'][:16]}…, the committed parent is {parent.sha256[:16]}…; re-encode it")
    for f in c.shared_fragments:  # a base publishing another base's encoding holds that committed fragment's experts
        att = done.get((f.node, f.block.layer, f.block.first_expert))
        owner = c.recipe.expert_owner(f.node)
        src = done.get((owner, f.block.layer, f.block.first_expert))
        if att is None or src is None:
            continue
        got = att.predicate.get("experts_from") or {"node": None, "name": None, "sha256": "-"}
        if (got["node"], got["name"], got["sha256"]) != (owner, src.name.rsplit("/", 1)[-1], src.sha256) or \
                [(e["expert"], e["sha256"]) for e in att.predicate["experts"]] != \
                [(e["expert"], e["sha256"]) for e in src.predicate["experts"]]:
            problems.append(f"{c.fragment(f.node, f.block)}: should hold the experts of {owner}'s committed "
                            f"{src.name.rsplit('/', 1)[-1]} sha256 {src.sha256[:16]}…, it names {got['name']} sha256 "
                            f"{got['sha256'][:16]}…; share it again")
    for s in [c.skeleton(s) for s in c.skeleton_shards] + c.linears.variant_files()[::2]:
        p = Path(s)
        try:
            done[("skeleton", str(p))] = verify_shard(p.parent, p.name, pub, campaign=ident)
        except FqError as e:
            problems.append(str(e))
    for node, layer in c.linears.jobs:
        p = Path(c.linears.fragment(node, layer))
        try:
            att = verify_shard(p.parent, p.name, pub, campaign=ident)
            entry = c.plan.linear(node)
            want = entry["digest"]
            if att.predicate["kind"] != "linear" or att.predicate["node_digest"] != want:
                raise FqError(f"finalize {p}: attests {att.predicate['kind']} node_digest "
                              f"{str(att.predicate['node_digest'])[:16]}…, linear node {node} is {want[:16]}…; re-encode it")
            check_linear_objective(c, att, layer, f"finalize {p}")
            if "parent" in entry:  # a stage's residual: its edge names the parent linear fragment actually committed
                parent = done.get(("linear", entry["parent"], layer))
                got = att.predicate["parent"] or {"name": None, "sha256": "-"}
                if parent is not None and (got["name"], got["sha256"]) != (parent.name, parent.sha256):
                    raise FqError(f"finalize {p}: encoded against parent {got['name']} sha256 {got['sha256'][:16]}…, "
                                  f"the committed parent is {parent.sha256[:16]}…; re-encode it")
            elif att.predicate["parent"] is not None:
                raise FqError(f"finalize {p}: linear node {node} is a base's, but the fragment names a parent")
            done[("linear", node, layer)] = att
        except FqError as e:
            problems.append(str(e))
    problems.raise_if_any(f"finalize {c.out}")
    return done


def check_linear_objective(c: Campaign, att, layer: int | None, where: str) -> None:
    """A linear fragment of a calibrated campaign attests its layer's bound linear Hessians; otherwise weight-only."""
    qa = att.predicate.get("quant_args") or {}
    if not c.calib.settings:
        if qa.get("objective") != OBJECTIVE_WEIGHT or "hessian" in qa:
            raise FqError(f"{where}: attests objective {qa.get('objective')!r}; this campaign encodes weight-only")
        return
    binding = c.calib.linear_hessian_binding(layer)
    bound = read_binding(binding)
    if bound is None:
        raise FqError(f"{where}: has no bound linear Hessians ({binding} missing); run its calibration job")
    if qa.get("hessian") != quant_hessian(bound):
        got = (qa.get("hessian") or {}).get("sha256") if isinstance(qa.get("hessian"), dict) else None
        raise FqError(f"{where}: encoded against linear Hessians {got or 'none'}, the campaign bound {bound['sha256']} "
                      f"({binding}); re-encode it")


def _publish(src: Path, dst: Path) -> None:
    """Copy src to dst unless dst already holds the same bytes (never a link: published bytes are their own)."""
    if dst.is_symlink():
        raise FqError(f"{dst}: is a symlink; published files must be regular files")
    if dst.is_file() and dst.stat().st_size == src.stat().st_size and sha256_file(dst) == sha256_file(src):
        return
    with disk_full_is_one_line(dst), open(src, "rb") as fin, atomic.atomic_open(dst, "wb") as fout:
        while data := fin.read(1 << 22):
            fout.write(data)


def _published_plan(c: Campaign) -> dict[str, Path]:
    """Published relative name -> committed source file, for every file finalize copies."""
    out: dict[str, Path] = {}
    for f in c.fragments:
        node = c.recipe.node(f.node)
        rel_dir = f"base/{f.node}" if node.is_base else f"stages/{f.node}"
        p = Path(c.fragment(f.node, f.block))
        out[f"{rel_dir}/{p.name}"] = p
        out[f"{rel_dir}/{attestation_name(p.name)}"] = Path(c.attestation(str(p)))
    for stage in c.recipe.stages:  # a stage's residuals on non-expert linears go with its expert fragments
        for s in c.linears.node_fragments(stage.name):
            p = Path(s)
            out[f"stages/{stage.name}/{p.name}"] = p
            out[f"stages/{stage.name}/{attestation_name(p.name)}"] = Path(c.attestation(str(p)))
    for base in c.recipe.bases:
        for s in c.linears.base_skeletons(base.name) + c.linears.base_fragments(base.name):
            p = Path(s)
            out[f"base/{base.name}/{p.name}"] = p
            out[f"base/{base.name}/{attestation_name(p.name)}"] = Path(c.attestation(str(p)))
        for side in SIDE_FILES:
            if (c.source_dir / side).is_file():
                out[f"base/{base.name}/{SOURCE_CONFIG if side == CONFIG else side}"] = c.source_dir / side
    return out


def _base_index(c: Campaign, base: str, root: Path) -> bytes:
    """model.safetensors.index.json of a published base: every tensor key -> the file holding it."""
    from fq.model.shards import read_header

    weight_map = {}
    d = root / "base" / base
    for p in sorted(d.glob("*.safetensors")):
        with open(p, "rb") as fh:
            for e in read_header(fh, str(p)).entries:
                weight_map[e.name] = p.name
    return canonical.pretty({"metadata": {"format": "fq-exl3-base/1", "node": base}, "weight_map": weight_map}).encode()


def _linear_bits(base) -> dict:
    """A base's quantized non-expert classes as its derived files' ``linears`` param: {class: K}, a budgeted base's
    class whose K varies per layer {"<layer>"|"head": K}."""
    return {cls: K if kbits.is_one(K) else {("head" if layer is None else str(layer)): k for layer, k in K}
            for cls, K in base.skeleton}


def _calibration_block(c: Campaign) -> dict | None:
    """The bases' ``quantization_config.calibration`` (exllamav3's rows and cols): the token rows and columns the
    Hessians were captured from, None for a weight-only campaign."""
    cal = c.calib.settings
    return {"rows": cal["rows"], "cols": cal["columns"]} if cal else None


def _eval_params(c: Campaign) -> dict | None:
    """How the campaign's eval job measures each base (its card says so): the text's name and sha256, tokens and
    window; None without an eval job."""
    cfg = c.evals.settings
    if not cfg:
        return None
    text = Path(c.evals.text)
    try:
        digest = sha256_file(text)
    except OSError as e:
        raise FqError(f"{text}: cannot read the eval text the model cards describe ({e.strerror}); eval.text names it "
                      "(the demo: its held-out split, written by the demo_model rule)") from None
    return {"text": text.name, "sha256": digest, "tokens": cfg["tokens"], "seq_len": cfg["seq_len"]}


def _card_params(c: Campaign, base, signer: str, evaluation: dict | None, model_signing: str | None) -> dict:
    """The model card's params of a base (fq.provenance.model_card): its own facts and the campaign's, none of
    another node's (a recipe change elsewhere leaves this base's manifest as it is)."""
    return card_params(base_model=c.source_repo, revision=c.source.revision, node=base.name, campaign=c.name,
                       signer=signer, quantized_by=(c.config.get("model_card") or {}).get("quantized_by"),
                       description=base.description or None, budget=base.bits if base.is_budgeted else None,
                       eval=evaluation, model_signing=model_signing)


def finalize(c: Campaign, key_path: str, version: int, expires: str) -> dict:
    _T0[0] = time.monotonic()
    # held until this process exits: through verify, publish and signing, as one critical section
    workers = locks.hold_finalize(locks.lock_dir(c.out))
    _log(f"holding {workers} exclusively (pid {os.getpid()}; no encode worker, live or orphaned, is running)")
    for p in remove_interrupted_writes(c):
        _log(f"removed {p}: leftover of an interrupted write")
    doc = canonical.load(c.campaign_json)
    ident = doc["identity"]
    priv = keys.load_private(key_path)
    pub = priv.public_key()
    check_signer(doc, pub, key_path)
    check_strays(c).raise_if_any(f"finalize {c.out}")
    _log(f"verifying {len(c.fragments)} fragments, {len(c.linears.jobs)} linear fragments and "
         f"{len(c.skeleton_shards)} skeleton shards (+ {len(c.linears.variant_files()) // 2} in variants)")
    verify_committed(c, pub, ident)

    root = c.out / "published"
    plan = _published_plan(c)
    oms = model_sig.load_private(c.model_signing_key) if c.model_signing_key else None
    ours = set(plan) | {f"base/{b.name}/{n}" for b in c.recipe.bases
                        for n in (INDEX, MANIFEST_NAME, *DERIVED_ORDER, *([model_sig.SIGNATURE] if oms else []))}
    ours |= {f"assemblies/{p.name}.assembly.intoto.jsonl" for p in c.recipe.products} | {PUBLICATION_NAME}
    problems = Problems()
    if root.exists():
        for dirpath, _, filenames in os.walk(root):
            for name in filenames:
                rel = Path(dirpath, name).relative_to(root).as_posix()
                if rel not in ours and not name.startswith(".tmp-"):
                    problems.append(f"stray file published/{rel}: finalize does not publish it; remove it")
    problems.raise_if_any(f"finalize {root}")

    _log(f"publishing {len(plan)} files into {root}")
    for rel, src in sorted(plan.items()):
        _publish(src, root / rel)
    _log(f"signing {len(c.recipe.bases)} base manifests and {len(c.recipe.products)} assemblies")
    manifests = {}
    evaluation = _eval_params(c)
    pem = model_sig.public_pem(oms) if oms else None
    if pem is not None:  # beside signer.pub: the key model_signing verify takes
        with disk_full_is_one_line(c.out / MODEL_SIGNING_PUB):
            if not (c.out / MODEL_SIGNING_PUB).is_file() or (c.out / MODEL_SIGNING_PUB).read_text() != pem:
                atomic.write_text(c.out / MODEL_SIGNING_PUB, pem)
    for base in c.recipe.bases:
        d = root / "base" / base.name
        with disk_full_is_one_line(d / QUANTIZATION_CONFIG):  # config.json (and the tensor files): derived, declared below
            derived = write_derived(d, bits=kbits.to_json(base.K), codebook=base.codebook,
                                    calibration=_calibration_block(c), linears=_linear_bits(base) or None,
                                    whole_model_bits=True)
        with disk_full_is_one_line(d / INDEX):  # after the derived shards, which it indexes too
            atomic.write_bytes(d / INDEX, _base_index(c, base.name, root))
        with disk_full_is_one_line(d / README):  # the model card: from quantization_config.json, declared derived
            derived.append(write_card(d, _card_params(c, base, ident["signer"], evaluation,
                                                      model_sig.hint(pem) if pem else None)))
        with disk_full_is_one_line(d / MANIFEST_NAME):
            _, manifests[base.name] = write_base_manifest(d, node=base.name, campaign=ident, key=priv, derived=derived,
                                                          model_signing=pem)
        if oms is not None:  # the OpenSSF model signature: every file of the directory, the manifest included
            with disk_full_is_one_line(d / model_sig.SIGNATURE):
                model_sig.write_signature(d, read_base_manifest(d, pub, ident).digests(), oms)

    plans = []
    for prod in c.recipe.products:
        chain, names = [], []
        for n in prod.chain:
            node = c.recipe.node(n)
            chain.append({"node": n, "role": "base" if node.is_base else "stage", "K": kbits.to_json(node.K),
                          "codebook": node.codebook, "parent": node.parent, "digest": c.recipe.node_digest(n)})
            rel_dir = f"base/{n}" if node.is_base else f"stages/{n}"
            names += [f"{rel_dir}/{Path(c.fragment(f.node, f.block)).name}" for f in c.fragments if f.node == n]
        base = prod.chain[0]
        linears = [{"name": f"base/{base}/{Path(p).name}", "digest": c.plan.linear(Path(p).parent.name)["digest"]}
                   for p in c.linears.base_fragments(base)]
        stage_linears = [{"name": f"stages/{n}/{Path(p).name}", "digest": c.plan.linear(Path(p).parent.name)["digest"],
                          "stage": n} for n in prod.chain[1:] for p in c.linears.node_fragments(n)]
        plan_doc = build_assembly(root, product=prod.name, chain=chain, fragments=names, base_dir=f"base/{base}",
                                  campaign=ident, recipe_sha256=c.recipe.sha256, version=version, expires=expires,
                                  public_key=pub, linears=linears, stage_linears=stage_linears)
        with disk_full_is_one_line(root / "assemblies" / f"{prod.name}.assembly.intoto.jsonl"):
            path = write_assembly(root, plan_doc, priv)
        plans.append(SignedPlan(str(path), sha256_file(path), plan_doc))
    _log(f"signing the publication statement (version {version})")
    subjects, publication = build_publication(
        root, version=version, campaign=ident, recipe={"name": c.recipe.name, "sha256": c.recipe.sha256},
        plan_identity_sha256=c.plan.identity_sha256, plans=plans, public_key=pub)
    if {b: e["manifest_sha256"] for b, e in publication["bases"].items()} != manifests:
        raise FqError(f"finalize {root}: the plans pin bases {sorted(publication['bases'])}, "
                      f"finalize signed manifests of {sorted(manifests)}")
    with disk_full_is_one_line(root / PUBLICATION_NAME):
        write_publication(root, subjects, publication, priv)
    summary = summary_view(publication)
    with disk_full_is_one_line(c.out / SUMMARY):
        atomic.write_text(c.out / SUMMARY, canonical.pretty(summary))
    _log(f"done: {len(plans)} products published")
    return summary


def verify_published(published: str, pub_path: str, out: str) -> None:
    """What a consumer runs (`fq verify published --key signer.pub`): every file accounted for and verified."""
    from fq.provenance.verify import publication_versions, verify_path

    pub = keys.load_public(pub_path)
    report = verify_path(published, pub)
    if not report.ok:
        raise FqError(f"fq verify {published}: {len(report.problems)} problem(s): " + "; ".join(report.problems))
    atomic.write_text(out, f"ok: {report.shards} shards, {report.manifests} base manifests, {report.assemblies} plans"
                           f"{publication_versions(report)} verified under key {keys.fingerprint(pub)}\n")
