"""``fq verify``: check a shard, a directory of shards, or a published campaign against a pinned key.

Every file in a verified tree must be accounted for:

- ``*.safetensors``: a fragment or skeleton shard with its ``.intoto.jsonl`` beside it (signature
  first, then the shard re-hashed in one pass and compared with every attested range);
- ``*.safetensors.intoto.jsonl``: must have its shard;
- ``fq-manifest.intoto.jsonl``: a base manifest; every file under its directory is listed and re-hashed;
- ``assemblies/*.assembly.intoto.jsonl``: a plan, opened as every consumer opens it
  (``fq.provenance.product.open_product``: signature, chain, expiry, file name, version state), and each fragment it
  names must be present under the campaign root and pass ``Product.check_fragment`` (the checks fq combine
  makes); a fragment that is missing is one problem naming the plans that need it;
- ``publication.intoto.jsonl`` (``fq.provenance.publication``): required at the root of a published tree (one holding
  ``base/``, ``stages/`` or ``assemblies/``) and beside every ``assemblies/``; the tree is checked against it
  both ways (nothing listed missing, nothing present unlisted, every digest the listed one) and every plan
  against its product entry;
- ``campaign_summary.json`` at the root: exactly the view of the publication statement
  (``fq.provenance.summary.check_summary_publication``); without a verified statement, every value it states that a
  signed plan also states must agree with it (``fq.provenance.summary.check_summary``);
- any other file must be listed by a base manifest above it. Symlinks, FIFOs, devices and leftover
  ``.tmp-*`` files are problems. All documents must carry one campaign identity, and all fragments of
  one node one node_digest (a fragment left over from an older definition of its node is stale).

Problems are collected, one line each, each problem once; nothing raises past ``verify_path`` except usage
errors. When no signed document verifies under the pinned key and some refuse it, that is one line (a wrong
``--key``), not one per document. A directory given as a symlink (a promoted ``published`` link) is verified
where it points; symlinks inside the tree stay problems.

    verify_path(path, public_key, now=None, state=None, summary=None) -> Report
"""
from __future__ import annotations

import datetime as dt
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fq.core.safepath import describe_mode, read_regular, split_path
from fq.errors import FqError, SignatureError
from fq.provenance.assembly import SUFFIX, PlanState, check_geometry
from fq.provenance.attest.campaign import campaign_digest
from fq.provenance.attest.fragment import Attested, verify_shard
from fq.provenance.attest.keys import fingerprint
from fq.provenance.fragments import attestation_name
from fq.provenance.manifest import MANIFEST_NAME, check_base_files, read_base_manifest
from fq.provenance.product import BESIDE, objective, open_product
from fq.provenance.publication import (NAME as PUBLICATION_NAME, Statement, file_problems, plan_problems,
                                       read_publication)
from fq.provenance.summary import SUMMARY_NAME, check_summary, check_summary_publication

ATT_SUFFIX = ".safetensors.intoto.jsonl"
PUBLICATION_DIRS = ("base", "stages", "assemblies")  # a directory holding one of these is a published tree


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    shards: int = 0
    manifests: int = 0
    assemblies: int = 0
    publications: list = field(default_factory=list)  # verified publication statements
    plans: list = field(default_factory=list)  # verified plans (fq.provenance.assembly.Plan)
    digests: dict = field(default_factory=dict)  # tree mode: name -> sha256 a verified signed document states for it
    campaigns: dict = field(default_factory=dict)  # campaign digest -> (first document naming it, identity)
    wrong_key: list = field(default_factory=list)  # SignatureErrors: documents with no signature by the pinned key

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def signed_ok(self) -> int:
        return self.shards + self.manifests + self.assemblies + len(self.publications)

    def record(self, state: PlanState | None) -> None:
        """Record every plan and publication statement this report accepted in ``state`` (only a tree that
        verified: a consumer who ran ``fq verify`` is then refused an older version by every later consumer)."""
        if state is None or not self.ok:
            return
        for plan in self.plans:
            state.record(plan)
        for pub in self.publications:
            state.record_publication(pub)

    def fail(self, e: FqError) -> None:
        self.problems.append(str(e))
        if isinstance(e, SignatureError):
            self.wrong_key.append(e)

    def campaign(self, ident: dict, where: str) -> None:
        d = campaign_digest(ident)
        if self.campaigns and d not in self.campaigns:
            first_where, first = next(iter(self.campaigns.values()))
            field = next(k for k in sorted(set(ident) | set(first)) if ident.get(k) != first.get(k))
            self.problems.append(f"{where}: campaign identity differs in {field!r} from {first_where}'s "
                                 "(two campaigns in one tree)")
        self.campaigns.setdefault(d, (where, ident))

    def collapse_wrong_key(self, path: Path, public_key) -> None:
        """Nothing verified and some documents refuse the key: one line, not one per document."""
        if self.wrong_key and not self.signed_ok and len(self.problems) > 1:
            ids = sorted({k for e in self.wrong_key for k in e.keyids})
            self.problems = [f"{path}: none of the {len(self.wrong_key)} signed documents verifies under the pinned "
                             f"key {fingerprint(public_key)[:16]}… (their signatures name key ids "
                             f"{', '.join(ids) or 'none'}); is --key this campaign's signer?"]


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else describe_mode(mode)


def _check_plan(report: Report, path: Path, root: Path, public_key, now, state, verified: dict[str, Attested],
                failed: frozenset[str] = frozenset(), missing: dict[str, list[str]] | None = None,
                publication: str | None = BESIDE):
    """A plan as every consumer opens it, then each fragment it names. ``verified``/``failed``: fragments
    already checked (or refused) on their own; ``missing`` (tree mode): fragment name -> products needing it,
    filled here and reported once by the caller; without it a missing fragment is this plan's problem.
    ``publication``: None in tree mode, where the tree's statement is checked against every plan at once."""
    product = open_product(path, public_key, root=root, now=now, state=state, publication=publication)
    plan = product.predicate
    report.campaign(plan["campaign"], str(path))
    manifest_name = plan["base"]["manifest"]["name"]
    manifest = read_base_manifest(root / plan["base"]["dir"], public_key, plan["campaign"])
    if manifest.sha256 != plan["base"]["manifest"]["sha256"]:
        raise FqError(f"{path}: {manifest_name} is not the base manifest the plan pins")
    atts, absent = [], []
    for f in plan["fragments"]:
        if f["name"] in failed:
            continue  # already reported as its own problem
        att = verified.get(f["name"])
        if att is None and not os.path.lexists(root / f["name"]):
            absent.append(f["name"])
            continue
        att = att or verify_shard(root, f["name"], public_key, plan["campaign"])
        atts.append(att)
        product.check_fragment(att, f, f"{path}: fragment {f['name']}", str(path))
    if absent and missing is None:
        raise FqError(f"{path}: fragment {absent[0]} is missing" +
                      (f" (and {len(absent) - 1} more of its fragments)" if len(absent) > 1 else ""))
    for name in absent:
        missing.setdefault(name, []).append(plan["product"])
    check_geometry([a.predicate for a in atts], [a.info for a in atts], str(path))
    report.plans.append(product.plan)
    return product.plan


def verify_path(path: str | os.PathLike, public_key: Ed25519PublicKey, *, now: dt.datetime | None = None,
                state: PlanState | None = None, summary: str | os.PathLike | None = None) -> Report:
    """``summary``: a campaign summary kept outside the tree (``OUT/campaign_summary.json`` beside
    ``OUT/published``), checked as if it lay at the tree's root."""
    path = Path(path)
    report = Report()
    if not os.path.lexists(path):
        raise FqError(f"{path}: does not exist")
    if os.path.islink(path) and os.path.isdir(path):
        path = Path(os.path.realpath(path))  # the link the caller named (a promoted generation), not one inside
    kind = _kind(path)
    if kind == "dir":
        _verify_tree(report, path, public_key, now, state, summary)
        report.collapse_wrong_key(path, public_key)
        return report
    if kind != "file":
        report.problems.append(f"{path}: is {kind}, expected a shard, attestation, manifest or assembly")
        return report
    name = path.name
    try:
        if name.endswith(".safetensors") or name.endswith(ATT_SUFFIX):
            shard = name[: -len(".intoto.jsonl")] if name.endswith(ATT_SUFFIX) else name
            att = verify_shard(path.parent, shard, public_key)
            report.campaign(att.predicate["campaign"], shard)
            report.shards += 1
        elif name == MANIFEST_NAME:
            manifest = read_base_manifest(path.parent, public_key)
            report.problems += check_base_files(path.parent, manifest)
            report.manifests += 1
        elif name.endswith(SUFFIX):
            if path.parent.name != "assemblies":
                raise FqError(f"{path}: a plan is verified from ROOT/assemblies/, where its fragment names resolve")
            _check_plan(report, path, path.parent.parent, public_key, now, state, {})
            report.assemblies += 1
        elif name == PUBLICATION_NAME:
            stmt = read_publication(path.parent, public_key)
            report.campaign(stmt.predicate["campaign"], str(path))
            if state is not None:
                state.check_publication(stmt)
            report.publications.append(stmt)
        else:
            report.problems.append(f"{path}: not an fq shard, attestation, manifest, assembly or publication statement")
    except FqError as e:
        report.fail(e)
    return report


def _scoped(names, prefix: str) -> dict[str, str]:
    """tree-relative name -> name relative to ``prefix`` (a directory of the tree, "." for its root)."""
    if prefix == ".":
        return {n: n for n in names}
    return {n: n[len(prefix) + 1:] for n in names if n.startswith(prefix + "/")}


def _verify_tree(report: Report, root: Path, public_key, now, state, summary=None) -> None:
    files: list[str] = []
    unusable: set[str] = set()  # symlinks and special files: reported once, not again as missing
    for dirpath, dirnames, filenames in os.walk(root):
        for d in list(dirnames):
            if os.path.islink(os.path.join(dirpath, d)):
                report.problems.append(f"{Path(dirpath, d)}: is a symlink; a published tree holds only real files")
                unusable.add(Path(dirpath, d).relative_to(root).as_posix())
                dirnames.remove(d)
        dirnames.sort()
        for f in sorted(filenames):
            rel = Path(dirpath, f).relative_to(root).as_posix()
            kind = _kind(root / rel)
            if kind != "file":
                report.problems.append(f"{root / rel}: is {kind}, expected a regular file")
                unusable.add(rel)
            elif f.startswith(".tmp-"):
                report.problems.append(f"{root / rel}: leftover temporary file of an interrupted write")
                unusable.add(rel)
            else:
                files.append(rel)
    present = set(files)
    covered: set[str] = set()
    verified: dict[str, Attested] = {}
    failed: set[str] = set(unusable)
    digests: dict[str, str] = {}  # tree-relative name -> sha256 the signed document covering it states
    orphans: list[str] = []  # attestations without their shard
    for rel in files:
        p = root / rel
        if rel.endswith(".safetensors"):
            covered.add(rel)
            try:
                att = verify_shard(root, rel, public_key)
                report.campaign(att.predicate["campaign"], rel)
                verified[rel] = att
                digests[rel], digests[attestation_name(rel)] = att.sha256, att.attestation_sha256
                report.shards += 1
            except FqError as e:
                report.fail(e)
                failed.add(rel)
        elif rel.endswith(ATT_SUFFIX):
            covered.add(rel)
            if rel[: -len(".intoto.jsonl")] not in present | unusable:
                orphans.append(rel)
        elif p.name == MANIFEST_NAME:
            covered.add(rel)
            base = p.parent
            try:
                manifest = read_base_manifest(base, public_key)
                report.campaign(manifest.campaign, rel)
                report.problems += check_base_files(base, manifest)
                prefix = base.relative_to(root).as_posix()
                listed = [n if prefix == "." else f"{prefix}/{n}" for n in manifest.files]
                covered.update(listed)
                digests[rel] = manifest.sha256
                for n, full in zip(manifest.files, listed):
                    digests.setdefault(full, manifest.files[n][0])
                report.manifests += 1
            except FqError as e:
                report.fail(e)
    _check_edges(report, verified)
    _check_node_digests(report, verified)
    _check_hessians(report, verified)

    # publication statements: at the root of a published tree, and beside every assemblies/ directory
    plan_files = [rel for rel in files if rel.endswith(SUFFIX) and Path(rel).parent.name == "assemblies"]
    scopes = {Path(rel).parent.parent.as_posix() for rel in plan_files}
    top = {n.split("/", 1)[0] for n in files} | {n.split("/", 1)[0] for n in unusable}
    if top & (set(PUBLICATION_DIRS) | {PUBLICATION_NAME, SUMMARY_NAME}):
        scopes.add(".")
    publications: dict[str, Statement | bool] = {}  # scope -> verified statement, or False (missing/refused)
    for scope in sorted(scopes):
        rel = PUBLICATION_NAME if scope == "." else f"{scope}/{PUBLICATION_NAME}"
        where = root / rel
        if rel not in present:
            if rel not in unusable:
                report.problems.append(f"{where}: missing; a published tree carries the signed publication statement "
                                       "finalize writes (what it contains, with its version)")
            publications[scope] = False
            continue
        covered.add(rel)
        try:
            stmt = read_publication(where.parent, public_key)
            report.campaign(stmt.predicate["campaign"], rel)
            if state is not None:
                state.check_publication(stmt)
            publications[scope] = stmt
            report.publications.append(stmt)
        except FqError as e:
            report.fail(e)
            publications[scope] = False

    plans = {}
    missing: dict[str, list[str]] = {}  # fragment (tree-relative) -> products whose plans need it
    for rel in plan_files:
        covered.add(rel)
        plan_root = (root / rel).parent.parent
        prefix = plan_root.relative_to(root).as_posix()
        try:
            scoped_verified = {k: verified[full] for full, k in _scoped(verified, prefix).items()}
            need: dict[str, list[str]] = {}
            plans[rel] = _check_plan(report, root / rel, plan_root, public_key, now, state, scoped_verified,
                                     frozenset(_scoped(failed, prefix).values()), need, None)
            for name, products in need.items():
                missing.setdefault(name if prefix == "." else f"{prefix}/{name}", []).extend(products)
            digests[rel] = plans[rel].sha256
            report.assemblies += 1
        except FqError as e:
            report.fail(e)
    for key, names in sorted(_missing_groups(missing, present).items()):
        products = sorted({p for n in names for p in missing[n]})
        what = f"{root / key}: missing" if len(names) == 1 else \
            f"{root / key}: missing, with the {len(names)} fragments in it"
        report.problems.append(f"{what} (needed by plan{'s' if len(products) > 1 else ''} {', '.join(products)})")
    reported_missing = set(missing) | {attestation_name(n) for n in missing}
    for rel in orphans:
        if rel[: -len(".intoto.jsonl")] not in missing:
            report.problems.append(f"{root / rel}: attestation without its shard {rel[: -len('.intoto.jsonl')]}")

    for scope, stmt in sorted(publications.items()):
        if not stmt:
            continue
        scoped = _scoped(present, scope)
        inside = set(scoped.values()) - {PUBLICATION_NAME, SUMMARY_NAME}
        report.problems += file_problems(stmt, root if scope == "." else root / scope, inside,
                                         {k: digests[full] for full, k in scoped.items() if full in digests},
                                         set(_scoped(reported_missing | unusable, scope).values()))
        report.problems += plan_problems(stmt, {k: plans[full] for full, k in _scoped(plans, scope).items()})

    if SUMMARY_NAME in present or summary is not None:
        covered.add(SUMMARY_NAME)
        src, name = (root, SUMMARY_NAME) if SUMMARY_NAME in present else split_path(summary)
        where = str(Path(src, name))
        try:
            data = read_regular(src, name, where)
            stmt = publications.get(".")
            if stmt:
                report.problems += check_summary_publication(data, where, stmt.predicate, stmt.path)
            else:
                idents = [ident for _, ident in report.campaigns.values()]
                top_plans = {k: v for k, v in plans.items() if Path(k).parent.as_posix() == "assemblies"}
                unverified = {k for k in present if Path(k).parent.as_posix() == "assemblies" and k not in top_plans}
                report.problems += check_summary(data, where, top_plans, idents[0] if len(idents) == 1 else None,
                                                 unverified)
        except FqError as e:
            report.fail(e)
    for rel in files:
        if rel not in covered:
            report.problems.append(f"{root / rel}: not covered by any attestation or base manifest")
    report.digests = digests
    if not files and not report.problems:
        report.problems.append(f"{root}: no files to verify")


def _missing_groups(missing: dict[str, list[str]], present: set[str]) -> dict[str, list[str]]:
    """Missing fragments grouped by the highest directory of which nothing is present (a deleted stage
    directory is one problem); a fragment whose directory still holds files is its own group."""
    dirs = {"/".join(n.split("/")[:i]) for n in present for i in range(1, n.count("/") + 1)}
    groups: dict[str, list[str]] = {}
    for n in sorted(missing):
        parts = n.split("/")
        key = next(("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) not in dirs), n)
        groups.setdefault(key, []).append(n)
    return groups


def _check_node_digests(report: Report, verified: dict[str, Attested]) -> None:
    """One node, one definition: every fragment of a node in a tree must attest the same node_digest."""
    by_node: dict[str, dict[str, list[str]]] = {}
    for rel, att in sorted(verified.items()):
        p = att.predicate
        if p["kind"] == "expert":
            by_node.setdefault(p["node"], {}).setdefault(p["node_digest"], []).append(rel)
    for node, digests in sorted(by_node.items()):
        if len(digests) > 1:
            groups = sorted(digests.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
            listed = "; ".join(f"{d[:16]}…: {len(rels)} ({rels[0]}{', …' if len(rels) > 1 else ''})"
                               for d, rels in groups)
            report.problems.append(f"node {node}: its fragments were encoded for {len(digests)} different "
                                   f"definitions (node_digest {listed}); re-encode the stale ones")


def _check_hessians(report: Report, verified: dict[str, Attested]) -> None:
    """One layer, one objective: every fragment of a layer in a tree attests the same Hessian (file sha256, token
    digest, capture mode), or none (weight-only); a consumer sees a campaign that mixed two, whatever it signed."""
    by_layer: dict[int, dict[str, list[str]]] = {}
    for rel, att in sorted(verified.items()):
        p = att.predicate
        if p["kind"] != "expert":
            continue
        key = objective(p)
        by_layer.setdefault(p["layer"], {}).setdefault(key, []).append(rel)
    for layer, keys in sorted(by_layer.items()):
        if len(keys) > 1:
            listed = "; ".join(f"{k}: {len(rels)} ({rels[0]}{', …' if len(rels) > 1 else ''})"
                               for k, rels in sorted(keys.items(), key=lambda kv: (-len(kv[1]), kv[1][0])))
            report.problems.append(f"layer {layer}: its fragments were encoded against {len(keys)} different "
                                   f"objectives ({listed}); a campaign binds one Hessian per layer")


def _check_edges(report: Report, verified: dict[str, Attested]) -> None:
    """A stage's recorded parent digest must be the parent fragment's, wherever that is in the tree."""
    by_base = {}
    for rel, att in verified.items():
        by_base.setdefault(rel.rsplit("/", 1)[-1], []).append(att)
    for rel, att in sorted(verified.items()):
        parent = att.predicate.get("parent")
        if not parent:
            continue
        for cand in by_base.get(parent["name"], []):
            if cand.sha256 != parent["sha256"]:
                report.problems.append(f"{rel}: records parent {parent['name']} sha256 {parent['sha256'][:16]}…, "
                                       f"but {cand.name} is {cand.sha256[:16]}… (chain edge broken)")


def publication_versions(report) -> str:
    """", publication version N" for the publication statements a report verified (nothing without one)."""
    versions = sorted({p.version for p in report.publications})
    if not versions:
        return ""
    return f", publication version{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))}"
