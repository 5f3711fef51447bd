"""``fq verify``: check a shard, a directory of shards, or a published campaign against a pinned key.

Every file in a verified tree must be accounted for:

- ``*.safetensors``: a fragment or skeleton shard with its ``.intoto.jsonl`` beside it (signature
  first, then the shard re-hashed in one pass and compared with every attested range);
- ``*.safetensors.intoto.jsonl``: must have its shard;
- ``fq-manifest.intoto.jsonl``: a base manifest; every file under its directory is listed and re-hashed;
- ``assemblies/*.assembly.intoto.jsonl``: a plan, opened as every consumer opens it
  (``fq.provenance.product.open_product``: signature, chain, expiry, file name, version state), and each fragment it
  names must be present under the campaign root and pass ``VerifiedProduct.check_fragment`` (the checks fq combine
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
errors. A problem is reported where it arises, and what follows from it is not reported again: a base manifest
missing or refused is one line (not one per plan pinning it, nor "not covered" for the files it would list); a
symlinked or missing directory is one line (nothing under it is reported missing or refused again); a fragment
encoded for a stale definition of its node is named once, by its node's line (which names the digest the plans'
chains name as current), not again by each plan or the publication statement; a base directory holding another
base than the one the statement lists (swapped, or copied over) is one line naming the directory and how many of
its files differ. When no signed document verifies under the pinned key and some refuse it, that is one line (a
wrong ``--key``), not one per document. A directory given as a symlink (a promoted ``published`` link) is verified
where it points; symlinks inside the tree stay problems.

Paths: a line about a file starts with that file's path, PATH (as given) joined with the file's name in the
tree (``PATH/stages/r1/r1-layer001-block000.safetensors: ...``), whichever check found it; files a line refers
to inside it are named as the tree and its signed documents name them (relative to the tree root). Lines about a
node or a layer start with ``node N:`` / ``layer L:``.

    verify_path(path, public_key, now=None, state=None, summary=None) -> VerifyReport
"""
from __future__ import annotations

import datetime as dt
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fq.core.canonical import sha256_hex
from fq.core.safepath import describe_mode, read_regular, split_path
from fq.errors import FqError, SignatureError
from fq.provenance.assembly import SUFFIX, PlanState, check_geometry
from fq.provenance.attest.campaign import campaign_digest
from fq.provenance.attest.fragment import Attested, verify_shard
from fq.provenance.attest.keys import fingerprint
from fq.provenance.fragments import attestation_name
from fq.provenance.complete import BaseShard, base_problems, check_published_base
from fq.provenance.manifest import MANIFEST_NAME, BaseManifest, check_base_files, read_base_manifest, read_verified
from fq.provenance.model_sig import MAX_BYTES as SIGNATURE_MAX_BYTES, SIGNATURE
from fq.provenance.product import VerifiedProduct, objective, open_product
from fq.provenance.publication import (NAME as PUBLICATION_NAME, Statement, file_problems, other_campaign,
                                       plan_problems, read_publication, replaced_bases)
from fq.provenance.summary import SUMMARY_NAME, check_summary, check_summary_publication

ATT_SUFFIX = ".safetensors.intoto.jsonl"
PUBLICATION_DIRS = ("base", "stages", "assemblies")  # a directory holding one of these is a published tree


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    shards: int = 0
    manifests: int = 0
    assemblies: int = 0
    publications: list = field(default_factory=list)  # verified publication statements
    plans: list = field(default_factory=list)  # verified plans (fq.provenance.assembly.SignedPlan)
    digests: dict = field(default_factory=dict)  # tree mode: name -> sha256 a verified signed document states for it
    campaigns: dict = field(default_factory=dict)  # campaign digest -> (first document naming it, identity)
    wrong_key: list = field(default_factory=list)  # SignatureErrors: documents with no signature by the pinned key
    about: dict = field(default_factory=dict, repr=False)  # tree mode: problem index -> tree-relative file it is about

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

    def add(self, problem: str, about: str | None = None) -> None:
        """One problem line; ``about``: the tree-relative file it is about (dropped with its directory when that
        directory is reported whole, ``drop_under``)."""
        if about is not None:
            self.about[len(self.problems)] = about
        self.problems.append(problem)

    def fail(self, e: FqError, about: str | None = None) -> None:
        self.add(str(e), about)
        if isinstance(e, SignatureError):
            self.wrong_key.append(e)

    def drop_under(self, dirs: set[str]) -> None:
        """Drop the lines about files under ``dirs`` (tree-relative directories reported whole, one line each)."""
        if not dirs:
            return
        kept = [(p, self.about.get(i)) for i, p in enumerate(self.problems)
                if self.about.get(i) is None or not _under(self.about[i], dirs)]
        self.problems = [p for p, _ in kept]
        self.about = {i: a for i, (_, a) in enumerate(kept) if a is not None}

    def campaign(self, ident: dict, where: str, about: str | None = None) -> None:
        d = campaign_digest(ident)
        if self.campaigns and d not in self.campaigns:
            first_where, first = next(iter(self.campaigns.values()))
            field = next(k for k in sorted(set(ident) | set(first)) if ident.get(k) != first.get(k))
            self.add(f"{where}: campaign identity differs in {field!r} from {first_where}'s "
                     "(two campaigns in one tree)", about)
        self.campaigns.setdefault(d, (where, ident))

    def collapse_wrong_key(self, path: Path, public_key) -> None:
        """Nothing verified and some documents refuse the key: one line, not one per document."""
        if self.wrong_key and not self.signed_ok and len(self.problems) > 1:
            ids = sorted({k for e in self.wrong_key for k in e.keyids})
            self.problems = [f"{path}: none of the {len(self.wrong_key)} signed documents verifies under the pinned "
                             f"key {fingerprint(public_key)[:16]}… (their signatures name key ids "
                             f"{', '.join(ids) or 'none'}); is --key this campaign's signer?"]


class _Located(FqError):
    """A plan's problem that is about another file (``about``, relative to the plan's root): the base manifest it
    pins, say; dropped with that file's directory when the directory is reported whole."""

    def __init__(self, message: str, about: str):
        super().__init__(message)
        self.about = about


def _under(name: str, dirs) -> bool:
    """Whether ``name`` lies under one of ``dirs`` (tree-relative directories)."""
    return any(name.startswith(d.rstrip("/") + "/") for d in dirs)


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else describe_mode(mode)


def _check_plan(report: VerifyReport, product: VerifiedProduct, path: Path, root: Path, public_key,
                verified: dict[str, Attested], skip=lambda name: False, missing: dict[str, list[str]] | None = None,
                manifests: dict[str, BaseManifest | None] | None = None):
    """Each fragment an opened plan names, and the base manifest it pins. ``verified``: fragments already checked
    on their own; ``skip(name)``: names whose problem is already reported (a refused fragment, a stale one, one
    under a symlinked directory); ``missing`` (tree mode): file name -> products needing it, filled here (fragments
    and base manifests) and reported once by the caller; without it a missing fragment is this plan's problem.
    ``manifests`` (tree mode): the base manifests the tree holds, already read (None: refused, its own problem)."""
    plan = product.predicate
    manifest_name = plan["base"]["manifest"]["name"]
    file = f"{plan['base']['dir']}/{MANIFEST_NAME}"
    if manifests is None:
        manifest = read_base_manifest(root / plan["base"]["dir"], public_key, plan["campaign"])
    else:
        manifest = manifests.get(file)
        if file not in manifests and not skip(file):
            missing.setdefault(file, []).append(plan["product"])
    if manifest is not None and manifest.sha256 != plan["base"]["manifest"]["sha256"]:
        raise _Located(f"{path}: {manifest_name} is not the base manifest the plan pins", file)
    atts, absent = [], []

    def attested(f: dict):
        """The fragment's verified attestation; None where its problem is reported elsewhere or it is absent."""
        if skip(f["name"]):
            return None  # already reported as its own problem
        att = verified.get(f["name"])
        if att is None and not os.path.lexists(root / f["name"]):
            absent.append(f["name"])
            return None
        return att or verify_shard(root, f["name"], public_key, plan["campaign"])

    for f in plan["fragments"]:
        if (att := attested(f)) is not None:
            atts.append(att)
            product.check_fragment(att, f, f"{path}: fragment {f['name']}", str(path))
    for f in plan.get("linears", ()):  # a whole-model base's linear fragments: attested, and listed by its manifest
        if (att := attested(f)) is None:
            continue
        product.check_linear(att, f, f"{path}: linear fragment {f['name']}")
        rel = f["name"][len(plan["base"]["dir"]) + 1:]
        if manifest is not None and (manifest.files.get(rel) or (None,))[0] != att.sha256:
            raise _Located(f"{path}: linear fragment {f['name']} is not in the base as its manifest lists it", f["name"])
    for f in plan.get("stage_linears", ()):  # the stages' residuals on non-expert linears: signed by the plan
        if (att := attested(f)) is not None:
            product.check_stage_linear(att, f, f"{path}: linear fragment {f['name']}")
    if absent and missing is None:
        raise FqError(f"{path}: fragment {absent[0]} is missing" +
                      (f" (and {len(absent) - 1} more of its fragments)" if len(absent) > 1 else ""))
    for name in absent:
        missing.setdefault(name, []).append(plan["product"])
    check_geometry([a.predicate for a in atts], [a.info for a in atts], str(path))
    if manifest is not None:
        _check_complete(report, product, root, public_key, manifest, verified, skip)
    report.plans.append(product.plan)
    return product.plan


def _check_complete(report: VerifyReport, product: VerifiedProduct, root: Path, public_key, manifest: BaseManifest,
                    verified: dict[str, Attested], skip) -> None:
    """The plan's base as one model (``fq.provenance.complete``), once every shard it lists verified on its own
    (a shard refused or missing is its own problem already); a problem another plan of the base found is not
    repeated."""
    plan = product.predicate
    base = plan["base"]["dir"]
    names = [f"{base}/{n}" for n in manifest.files if n.endswith(".safetensors")
             and n not in {d["name"] for d in manifest.derived}]
    if any(n not in verified or skip(n) for n in names):
        return
    base_dir = root / base

    def read(name: str) -> bytes:
        return read_verified(base_dir, name, *manifest.files[name])[1]

    try:
        problems = base_problems(plan, [BaseShard.from_attested(verified[n]) for n in names], files=manifest.files,
                                 read=read, where=str(base_dir), root=root, public_key=public_key)
    except FqError as e:
        problems = [str(e)]
    for line in problems:
        if line not in report.problems:
            report.add(line, f"{base}/{MANIFEST_NAME}")


def verify_path(path: str | os.PathLike, public_key: Ed25519PublicKey, *, now: dt.datetime | None = None,
                state: PlanState | None = None, summary: str | os.PathLike | None = None) -> VerifyReport:
    """``summary``: a campaign summary kept outside the tree (``OUT/campaign_summary.json`` beside
    ``OUT/published``), checked as if it lay at the tree's root."""
    path = Path(path)
    report = VerifyReport()
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
            report.campaign(att.predicate["campaign"], str(path))
            report.shards += 1
        elif name == MANIFEST_NAME:
            manifest = read_base_manifest(path.parent, public_key)
            report.problems += check_base_files(path.parent, manifest)
            report.manifests += 1
        elif name.endswith(SUFFIX):
            if path.parent.name != "assemblies":
                raise FqError(f"{path}: a plan is verified from ROOT/assemblies/, where its fragment names resolve")
            product = open_product(path, public_key, root=path.parent.parent, now=now, state=state)
            report.campaign(product.predicate["campaign"], str(path))
            _check_plan(report, product, path, path.parent.parent, public_key, {})
            check_published_base(product.predicate, path.parent.parent, public_key)  # the base as one model
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


def _verify_tree(report: VerifyReport, root: Path, public_key, now, state, summary=None) -> None:
    files: list[str] = []
    unusable: set[str] = set()  # symlinks and special files: reported once, not again as missing
    unusable_dirs: set[str] = set()  # symlinked directories: nothing under them is reported again
    for dirpath, dirnames, filenames in os.walk(root):
        for d in list(dirnames):
            if os.path.islink(os.path.join(dirpath, d)):
                rel = Path(dirpath, d).relative_to(root).as_posix()
                report.add(f"{Path(dirpath, d)}: is a symlink; a published tree holds only real files", rel)
                unusable.add(rel)
                unusable_dirs.add(rel)
                dirnames.remove(d)
        dirnames.sort()
        for f in sorted(filenames):
            rel = Path(dirpath, f).relative_to(root).as_posix()
            kind = _kind(root / rel)
            if kind != "file":
                report.add(f"{root / rel}: is {kind}, expected a regular file", rel)
                unusable.add(rel)
            elif f.startswith(".tmp-"):
                report.add(f"{root / rel}: leftover temporary file of an interrupted write", rel)
                unusable.add(rel)
            else:
                files.append(rel)
    present = set(files)
    covered: set[str] = set()
    verified: dict[str, Attested] = {}
    failed: set[str] = set(unusable)
    digests: dict[str, str] = {}  # tree-relative name -> sha256 the signed document covering it states
    manifests: dict[str, BaseManifest | None] = {}  # tree-relative base manifest -> what it verified as (None: refused)
    orphans: list[str] = []  # attestations without their shard
    derived: set[str] = set()  # tree-relative names a verified base manifest declares derived (recomputed, unattested)
    signatures_said: set[str] = set()  # tree-relative model.sig files check_base_files reported (missing, refused)
    # manifests first, so that a file one declares derived is known as such before it would be taken for a shard
    for rel in sorted(files, key=lambda r: Path(r).name != MANIFEST_NAME):
        p = root / rel
        if rel in derived:
            continue  # listed by its manifest and recomputed by check_base_files
        if rel.endswith(".safetensors"):
            covered.add(rel)
            try:
                att = verify_shard(root, rel, public_key)
                report.campaign(att.predicate["campaign"], str(p), rel)
                verified[rel] = att
                digests[rel], digests[attestation_name(rel)] = att.sha256, att.attestation_sha256
                report.shards += 1
            except FqError as e:
                report.fail(e, rel)
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
                report.campaign(manifest.campaign, str(p), rel)
                lines = check_base_files(base, manifest)
                for line in lines:
                    report.add(line, rel)
                prefix = base.relative_to(root).as_posix()
                listed = [n if prefix == "." else f"{prefix}/{n}" for n in manifest.files]
                covered.update(listed)
                sig = SIGNATURE if prefix == "." else f"{prefix}/{SIGNATURE}"
                # model.sig: checked against the manifest by check_base_files, its bytes against the publication's
                # listing, unless refused above (then the listing does not repeat that)
                said = any(line.startswith(f"{base / SIGNATURE}:") for line in lines)
                if said:
                    signatures_said.add(sig)  # missing or refused: one line, the publication's listing says no more
                if sig in present:
                    covered.add(sig)
                    if not said:
                        digests[sig] = sha256_hex(read_regular(base, SIGNATURE, str(base / SIGNATURE),
                                                               limit=SIGNATURE_MAX_BYTES))
                derived.update(d["name"] if prefix == "." else f"{prefix}/{d['name']}" for d in manifest.derived)
                digests[rel] = manifest.sha256
                for n, full in zip(manifest.files, listed):
                    digests.setdefault(full, manifest.files[n][0])
                manifests[rel] = manifest
                report.manifests += 1
            except FqError as e:
                report.fail(e, rel)
                manifests[rel] = None
    _check_edges(report, root, verified)
    _check_hessians(report, verified)
    _check_linear_nodes(report, verified)

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
            if rel not in unusable and not _under(rel, unusable_dirs):
                report.add(f"{where}: missing; a published tree carries the signed publication statement "
                           "finalize writes (what it contains, with its version)", rel)
            publications[scope] = False
            continue
        covered.add(rel)
        try:
            stmt = read_publication(where.parent, public_key)
            report.campaign(stmt.predicate["campaign"], str(where), rel)
            if state is not None:
                state.check_publication(stmt)
            publications[scope] = stmt
            report.publications.append(stmt)
        except FqError as e:
            report.fail(e, rel)
            publications[scope] = False

    # plans: opened first (signature, chain, expiry, state), so that the node digests their chains name are known
    # before any fragment is checked against them
    opened: dict[str, tuple[VerifiedProduct, str]] = {}  # plan file -> (product, its root relative to the tree's)
    chains: dict[str, dict[str, list[str]]] = {}  # node -> node_digest the plans' chains name -> their products
    for rel in plan_files:
        covered.add(rel)
        plan_root = (root / rel).parent.parent
        prefix = plan_root.relative_to(root).as_posix()
        try:
            product = open_product(root / rel, public_key, root=plan_root, now=now, state=state, publication=None)
            stmt = publications.get(prefix)
            foreign = other_campaign(product.predicate["campaign"], stmt.predicate["campaign"]) if stmt else None
            if foreign:
                raise FqError(f"{root / rel}: a plan of another publication: its campaign identity differs in "
                              f"{foreign} from that of {stmt.path} (version {stmt.version})")
            report.campaign(product.predicate["campaign"], str(root / rel), rel)
            for n in product.predicate["chain"]:
                chains.setdefault(n["node"], {}).setdefault(n["digest"], []).append(product.predicate["product"])
            opened[rel] = (product, prefix)
        except FqError as e:
            report.fail(e, rel)
    stale = _check_node_digests(report, verified, chains)
    failed |= stale

    def skipper(prefix: str):
        def skip(name: str) -> bool:
            full = name if prefix == "." else f"{prefix}/{name}"
            return full in failed or _under(full, unusable_dirs)
        return skip

    plans = {}
    missing: dict[str, list[str]] = {}  # file (tree-relative) -> products whose plans need it
    for rel, (product, prefix) in opened.items():
        plan_root = (root / rel).parent.parent
        try:
            scoped_verified = {k: verified[full] for full, k in _scoped(verified, prefix).items()}
            scoped_manifests = {k: manifests[full] for full, k in _scoped(manifests, prefix).items()}
            need: dict[str, list[str]] = {}
            plans[rel] = _check_plan(report, product, root / rel, plan_root, public_key, scoped_verified,
                                     skipper(prefix), need, scoped_manifests)
            for name, products in need.items():
                missing.setdefault(name if prefix == "." else f"{prefix}/{name}", []).extend(products)
            digests[rel] = plans[rel].sha256
            report.assemblies += 1
        except _Located as e:
            report.fail(e, e.about if prefix == "." else f"{prefix}/{e.about}")
        except FqError as e:
            report.fail(e, rel)

    listed_all = {n if scope == "." else f"{scope}/{n}" for scope, stmt in publications.items() if stmt
                  for n in stmt.files}  # tree-relative names the verified statements list
    reported: set[str] = set(unusable) | {d + "/" for d in unusable_dirs} | stale | signatures_said | \
        {attestation_name(n) for n in stale}  # tree-relative names (directories end in "/") reported already
    for key, names in sorted(_missing_groups(missing, present).items()):
        products = sorted({p for n in names for p in missing[n]})
        needed = f"(needed by plan{'s' if len(products) > 1 else ''} {', '.join(products)})"
        reported.update(names)
        reported.update(attestation_name(n) for n in names if n.endswith(".safetensors"))
        if key in names:
            report.add(f"{root / key}: missing {needed}", key)
            continue
        reported.add(key + "/")
        frags = [n for n in names if n.endswith(".safetensors")]
        inside = set(frags) | {attestation_name(n) for n in frags}
        extra = {n for n in listed_all if n.startswith(key + "/")} - inside
        what = [f"the {len(frags)} fragment{'s' if len(frags) > 1 else ''} in it"] if frags else []
        if extra:
            what.append(f"{len(extra)} more file(s) {PUBLICATION_NAME} lists there" if frags else
                        f"the {len(extra)} file(s) {PUBLICATION_NAME} lists there")
        if len(names) == 1 and not extra:
            report.add(f"{root / key}: missing {needed}", key)
        else:
            report.add(f"{root / key}: missing, with {' and '.join(what) or f'the {len(names)} files in it'} "
                       f"{needed}", key)
    for rel in orphans:
        if rel[: -len(".intoto.jsonl")] not in missing:
            report.add(f"{root / rel}: attestation without its shard {rel[: -len('.intoto.jsonl')]}", rel)

    replaced: set[str] = set()  # base directories holding another base than the listed one: one line each
    for scope, stmt in sorted(publications.items()):
        if not stmt:
            continue
        scoped = _scoped(present, scope)
        inside = set(scoped.values()) - {PUBLICATION_NAME, SUMMARY_NAME}
        scoped_digests = {k: digests[full] for full, k in scoped.items() if full in digests}
        users: dict[str, list[str]] = {}  # base manifest (scope-relative) -> products of the plans pinning it
        for rel, (product, prefix) in opened.items():
            if prefix == scope:
                users.setdefault(product.predicate["base"]["manifest"]["name"], []).append(product.predicate["product"])
        lines, dirs = replaced_bases(stmt, root if scope == "." else root / scope, inside, scoped_digests,
                                     {k: m.node for full, k in _scoped(manifests, scope).items()
                                      if (m := manifests[full]) is not None}, users)
        for line in lines:
            report.add(line)
        replaced.update(d if scope == "." else f"{scope}/{d}" for d in dirs)
        scoped_reported = {k for k in _scoped(reported, scope).values() if k} | {d + "/" for d in dirs}
        reencoded = {k for full, k in _scoped(plans, scope).items() if not plans[full].canonical}
        report.problems += file_problems(stmt, root if scope == "." else root / scope, inside, scoped_digests,
                                         reported=scoped_reported, reencoded=reencoded)
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
    # a base directory whose manifest is missing or refused (one line, above): its files are not "not covered" too
    unmanifested = {Path(m).parent.as_posix() for m, v in manifests.items() if v is None} | \
        {Path(m).parent.as_posix() for m in set(missing) | set(listed_all)
         if Path(m).name == MANIFEST_NAME and m not in present}
    for rel in files:
        if rel not in covered and not _under(rel, unmanifested):
            report.add(f"{root / rel}: not covered by any attestation or base manifest", rel)
    report.drop_under(replaced)
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


def _check_node_digests(report: VerifyReport, verified: dict[str, Attested], chains: dict[str, dict[str, list[str]]]
                        ) -> set[str]:
    """One node, one definition: every fragment of a node in a tree must attest the node_digest the plans' chains
    name for it (``chains``: node -> digest -> products). When they name one, a fragment attesting another is stale:
    named here once (returned, so that no plan and no publication line reports it again). Without a plan naming
    the node, or with plans naming several digests, a node whose fragments attest several is one line too."""
    by_node: dict[str, dict[str, list[str]]] = {}
    for rel, att in sorted(verified.items()):
        p = att.predicate
        if p["kind"] == "expert":
            by_node.setdefault(p["node"], {}).setdefault(p["node_digest"], []).append(rel)
    stale: set[str] = set()
    for node, digests in sorted(by_node.items()):
        named = chains.get(node, {})
        if len(named) == 1:
            (current, products), = named.items()
            old = sorted(((d, rels) for d, rels in digests.items() if d != current),
                         key=lambda kv: (-len(kv[1]), kv[1][0]))
            if not old:
                continue
            n = sum(len(rels) for _, rels in old)
            total = sum(len(rels) for rels in digests.values())
            listed = "; ".join(f"{d[:16]}…: {len(rels)} ({rels[0]}{', …' if len(rels) > 1 else ''})"
                               for d, rels in old)
            products = sorted(set(products))
            report.add(f"node {node}: {n} of its {total} fragments {'was' if n == 1 else 'were'} encoded for a stale "
                       f"definition (node_digest {listed}); the current definition is {current[:16]}…, the digest "
                       f"the chain of plan{'s' if len(products) > 1 else ''} {', '.join(products)} names; re-encode "
                       f"the stale {'one' if n == 1 else 'ones'}")
            stale.update(r for _, rels in old for r in rels)
        elif len(digests) > 1:
            groups = sorted(digests.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
            listed = "; ".join(f"{d[:16]}…: {len(rels)} ({rels[0]}{', …' if len(rels) > 1 else ''})"
                               for d, rels in groups)
            which = (f"no plan in the tree names node {node}, so which is current is not known" if not named else
                     f"the plans' chains name {len(named)} different digests for it")
            report.add(f"node {node}: its fragments were encoded for {len(digests)} different definitions "
                       f"(node_digest {listed}); {which}; re-encode the stale ones")
    return stale


def _check_hessians(report: VerifyReport, verified: dict[str, Attested]) -> None:
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


def _check_linear_nodes(report: VerifyReport, verified: dict[str, Attested]) -> None:
    """One linear node, one definition, in the whole tree: the copies of a linear node's fragments in the bases that
    share it attest one node digest, and no digest is attested by two linear nodes; and the linear fragments of one
    layer, in every base, name one Hessian (the campaign's per-layer linear Hessian) or none."""
    digests: dict[str, dict[str, list[str]]] = {}
    nodes: dict[str, set[str]] = {}
    hessians: dict = {}
    for rel, att in sorted(verified.items()):
        p = att.predicate
        if p["kind"] != "linear":
            continue
        digests.setdefault(p["node"], {}).setdefault(p["node_digest"], []).append(rel)
        nodes.setdefault(p["node_digest"], set()).add(p["node"])
        h = p["quant_args"].get("hessian")
        key = "weight-only" if h is None else f"Hessian {h['file']} sha256 {h['sha256'][:16]}…"
        hessians.setdefault(p["layer"], {}).setdefault(key, []).append(rel)
    for node, by_digest in sorted(digests.items()):
        if len(by_digest) > 1:
            listed = "; ".join(f"{d[:16]}…: {len(r)} ({r[0]}{', …' if len(r) > 1 else ''})"
                               for d, r in sorted(by_digest.items(), key=lambda kv: (-len(kv[1]), kv[1][0])))
            report.add(f"linear node {node}: its fragments in the tree attest {len(by_digest)} node digests ({listed}); "
                       f"one node has one definition")
    for digest, names in sorted(nodes.items()):
        if len(names) > 1:
            report.add(f"linear node digest {digest[:16]}… is attested by {len(names)} linear nodes "
                       f"({', '.join(sorted(names))}); a digest names one node's definition")
    for layer, keys in sorted(hessians.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        if len(keys) > 1:
            listed = "; ".join(f"{k}: {len(r)} ({r[0]}{', …' if len(r) > 1 else ''})"
                               for k, r in sorted(keys.items(), key=lambda kv: (-len(kv[1]), kv[1][0])))
            unit = "the head" if layer is None else f"layer {layer}"
            report.add(f"{unit}: its linear fragments in the tree were encoded against {len(keys)} objectives "
                       f"({listed}); a campaign binds one Hessian per layer")


def _check_edges(report: VerifyReport, root: Path, verified: dict[str, Attested]) -> None:
    """A stage's recorded parent digest must be the parent fragment's, wherever that is in the tree; a base fragment
    holding another base's encoding (``experts_from``) must hold that fragment's expert bytes."""
    by_base = {}
    for rel, att in verified.items():
        by_base.setdefault(rel.rsplit("/", 1)[-1], []).append(att)
    for rel, att in sorted(verified.items()):
        src = att.predicate.get("experts_from")  # a base publishing another base's encoding: the same expert bytes
        for cand in by_base.get(src["name"], []) if src else ():
            ranges = [(e["expert"], e["sha256"]) for e in att.predicate["experts"]]
            if cand.sha256 != src["sha256"] or [(e["expert"], e["sha256"]) for e in cand.predicate["experts"]] != ranges:
                report.add(f"{root / rel}: holds the experts of {src['name']} sha256 {src['sha256'][:16]}…, but "
                           f"{cand.name} is {cand.sha256[:16]}…{'' if cand.sha256 != src['sha256'] else ' with other expert bytes'} "
                           f"(shared encoding broken)", rel)
        parent = att.predicate.get("parent")
        if not parent:
            continue
        for cand in by_base.get(parent["name"], []):
            if cand.sha256 != parent["sha256"]:
                report.add(f"{root / rel}: records parent {parent['name']} sha256 {parent['sha256'][:16]}…, "
                           f"but {cand.name} is {cand.sha256[:16]}… (chain edge broken)", rel)


def publication_versions(report) -> str:
    """", publication version N" for the publication statements a report verified (nothing without one)."""
    versions = sorted({p.version for p in report.publications})
    if not versions:
        return ""
    return f", publication version{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))}"
