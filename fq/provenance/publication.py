"""The publication statement: ``ROOT/publication.intoto.jsonl``, what one campaign published, signed.

Modelled on TUF's targets and snapshot metadata: one signed document that says what a publication
contains, so that nothing can be withheld or added unnoticed, with a version that only rises.

- **Subjects**: every file of the publication (name relative to ROOT, sha256), except the statement itself
  and ``campaign_summary.json`` (which is checked against the statement instead, field by field).
- **Predicate** ``fq-publication/1`` (``fq/schemas/fq-publication.schema.json``)::

      {format, version, campaign, recipe: {name, sha256}, plan_identity_sha256,
       bases: {NODE: {manifest, manifest_sha256}},
       products: {PRODUCT: {file, sha256, version, chain, bytes, bpw, recipe_sha256}}}

  ``version`` is the operator's ``assembly.version`` (the plans carry the same one); it is monotonic per
  signer: consumers with a state file refuse a lower one (``fq.provenance.assembly.PlanState``) and ``fq promote``
  refuses to publish one that is not above what the destination holds. ``products`` names each plan
  (``assemblies/PRODUCT.assembly.intoto.jsonl``) with its line's sha256, its version, chain, payload
  bytes, bits per weight (the chain's K summed, ``fq.core.kbits.chain_bits``: an integer when every node is one K, else
  each node's mean K over its layers and projections) and recipe digest; ``bases`` each base manifest.

``fq verify`` of a published tree requires the statement and checks the tree against it both ways
(nothing listed missing, nothing present unlisted, every digest the one the signed documents covering the
file state), and every plan against its product entry. A consumer of one plan (``fq combine``,
``fq mesh-plan``, ``fq tp-export``) checks, when the statement is present at ROOT, that the plan is the
one it lists (``fq.provenance.product.open_product``).

    build_publication(root, *, version, campaign, recipe, plan_identity_sha256, plans, public_key) -> (subjects, predicate)
    write_publication(root, subjects, predicate, key) -> (path, sha256)
    read_publication(root, public_key, campaign=None) -> Statement
    Statement.require_plan(plan); plan_problems(statement, plans); file_problems(statement, present, digests, ...)
    replaced_bases(statement, root, present, digests, nodes, users) -> (lines, dirs)   # one line per swapped base
    fq.provenance.summary.summary_view(predicate) -> dict    # the campaign_summary.json the statement implies
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fq.core import atomic, kbits
from fq.core.canonical import sha256_hex
from fq.core.safepath import check_name, open_regular, read_regular, sha256_stream
from fq.errors import FqError
from fq.provenance.assembly import SUFFIX, SignedPlan, payload_bytes
from fq.provenance.attest import dsse
from fq.provenance.attest.campaign import require_same
from fq.provenance.attest.keys import fingerprint
from fq.provenance.attest.statement import PUBLICATION, parse_statement, statement
from fq.provenance.fragments import attestation_name
from fq.provenance.manifest import MANIFEST_NAME, read_base_manifest
from fq.provenance.summary import SUMMARY_NAME

NAME = "publication.intoto.jsonl"
FORMAT = "fq-publication/1"


@dataclass(frozen=True)
class Statement:
    path: str
    sha256: str  # of the envelope line
    statement_sha256: str  # of the signed statement
    predicate: dict
    files: dict  # subject name -> sha256

    @property
    def version(self) -> int:
        return self.predicate["version"]

    @property
    def signer(self) -> str:
        return self.predicate["campaign"]["signer"]

    def require_plan(self, plan: SignedPlan) -> None:
        """The plan a consumer opened must be the one this statement lists for its product (and of its campaign:
        a plan of another campaign is named as such, not the statement)."""
        product = plan.predicate["product"]
        foreign = other_campaign(plan.predicate["campaign"], self.predicate["campaign"])
        if foreign:
            raise FqError(f"{plan.path}: a plan of another publication: its campaign identity differs in "
                          f"{foreign} from that of {self.path} (version {self.version}); not a plan this publication "
                          "lists")
        entry = self.predicate["products"].get(product)
        if entry is None:
            raise FqError(f"{plan.path}: product {product!r} is not in the publication {self.path} (version "
                          f"{self.version} lists {', '.join(sorted(self.predicate['products']))}); a plan from "
                          "another publication?")
        if entry["sha256"] != plan.sha256 and not plan.canonical:
            raise FqError(f"{plan.path}: its envelope line is not fq's canonical encoding (sha256 {plan.sha256[:16]}…): "
                          f"a re-encoded copy of a signed plan, not the line {self.path} lists for product "
                          f"{product!r} ({entry['sha256'][:16]}…); fetch the published line")
        if entry["sha256"] != plan.sha256:
            raise FqError(f"{plan.path}: not the plan {self.path} lists for product {product!r} (sha256 "
                          f"{plan.sha256[:16]}… version {plan.predicate['version']}; the publication lists "
                          f"{entry['sha256'][:16]}… version {entry['version']})")
        problems = entry_problems(self, entry, plan, entry["file"])
        if problems:
            raise FqError(problems[0])


def other_campaign(ident: dict, expected: dict) -> str | None:
    """None when the identities are one campaign's; else the first field that differs, in words."""
    for k in sorted(set(ident) | set(expected)):
        if ident.get(k) != expected.get(k):
            return f"{k!r} ({ident.get(k)!r}, the publication's {expected.get(k)!r})"
    return None


def product_entry(plan: SignedPlan, file: str) -> dict:
    """What a publication states about one product, derived from its verified plan."""
    p = plan.predicate
    return {"file": file, "sha256": plan.sha256, "version": p["version"], "chain": [n["node"] for n in p["chain"]],
            "bytes": payload_bytes(p), "bpw": kbits.chain_bits(n["K"] for n in p["chain"]),
            "recipe_sha256": p["recipe_sha256"]}


def entry_problems(stmt: Statement, entry: dict, plan: SignedPlan, file: str) -> list[str]:
    """How a product entry differs from the verified plan it names (one line per field)."""
    product = plan.predicate["product"]
    want = product_entry(plan, file)
    out = [f"{stmt.path}: products.{product}.{k} is {entry.get(k)!r}, the signed plan {file} says {want[k]!r}"
           for k in want if entry.get(k) != want[k]]
    base = plan.predicate["base"]
    listed = stmt.predicate["bases"].get(base["node"])
    if listed is None or (listed["manifest"], listed["manifest_sha256"]) != (base["manifest"]["name"],
                                                                           base["manifest"]["sha256"]):
        out.append(f"{stmt.path}: bases.{base['node']} is not the base manifest {base['manifest']['name']} "
                   f"({base['manifest']['sha256'][:16]}…) that plan {file} pins")
    return out


def plan_file(product: str) -> str:
    return f"assemblies/{product}{SUFFIX}"


# -- producer -------------------------------------------------------------------------------------------

def _files(root: Path) -> list[str]:
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                raise FqError(f"{os.path.join(dirpath, d)}: is a symlink; a publication holds only real files")
        dirnames.sort()
        for f in filenames:
            rel = Path(dirpath, f).relative_to(root).as_posix()
            if rel in (NAME, SUMMARY_NAME):
                continue
            if f.startswith(".tmp-"):
                raise FqError(f"{root}/{rel}: leftover temporary file of an interrupted write")
            names.append(check_name(rel, f"{root}/{rel}"))
    return sorted(names)


def build_publication(root: str | os.PathLike, *, version: int, campaign: dict, recipe: dict,
                      plan_identity_sha256: str, plans: list[SignedPlan], public_key: Ed25519PublicKey
                      ) -> tuple[list[tuple[str, str]], dict]:
    """(subjects, predicate) of the publication under ``root``: ``plans`` are its verified plans (their
    files under ``root/assemblies/``); each base manifest they pin is read (signature first). A file's
    digest is taken from the signed document that covers it (a plan for its fragments and their
    attestations, a base manifest for its files) and hashed only when none does."""
    root = Path(root)
    if type(version) is not int or version < 1:
        raise FqError(f"publication version {version!r}: expected an integer >= 1 (assembly.version)")
    known: dict[str, str] = {}
    products, bases = {}, {}
    for plan in plans:
        p = plan.predicate
        file = Path(plan.path).resolve().relative_to(root.resolve()).as_posix()
        if file != plan_file(p["product"]):
            raise FqError(f"{plan.path}: a published plan of product {p['product']!r} is {plan_file(p['product'])}")
        require_same(p["campaign"], campaign, plan.path)
        products[p["product"]] = product_entry(plan, file)
        known[file] = plan.sha256
        for f in [*p["fragments"], *p.get("stage_linears", ())]:
            known[f["name"]] = f["sha256"]
            known[attestation_name(f["name"])] = f["attestation_sha256"]
        base = p["base"]
        if base["node"] not in bases:
            manifest = read_base_manifest(root / base["dir"], public_key, campaign)
            bases[base["node"]] = {"manifest": base["manifest"]["name"], "manifest_sha256": manifest.sha256}
            known[base["manifest"]["name"]] = manifest.sha256
            known.update({f"{base['dir']}/{n}": d for n, (d, _) in manifest.files.items()})
        if bases[base["node"]]["manifest_sha256"] != base["manifest"]["sha256"]:
            raise FqError(f"{plan.path}: pins base manifest {base['manifest']['sha256'][:16]}…, "
                          f"{base['manifest']['name']} is {bases[base['node']]['manifest_sha256'][:16]}…")
    subjects = []
    for name in _files(root):
        digest = known.get(name)
        if digest is None:
            with open_regular(root, name, f"{root}/{name}") as fh:
                digest = sha256_stream(fh)[0]
        subjects.append((name, digest))
    predicate = {"format": FORMAT, "version": version, "campaign": campaign, "recipe": recipe,
                 "plan_identity_sha256": plan_identity_sha256, "bases": bases, "products": products}
    _consistent(subjects, predicate, f"publication of {root}")
    return subjects, predicate


def write_publication(root: str | os.PathLike, subjects: list[tuple[str, str]], predicate: dict,
                      key: Ed25519PrivateKey) -> tuple[Path, str]:
    if predicate["campaign"]["signer"] != fingerprint(key):
        raise FqError(f"{root}/{NAME}: the campaign names signer {predicate['campaign']['signer'][:16]}…, "
                      f"the key is {fingerprint(key)[:16]}…")
    line = dsse.envelope_line(dsse.sign(statement(subjects, PUBLICATION, predicate), key))
    path = Path(root) / NAME
    atomic.write_bytes(path, line)
    return path, sha256_hex(line)


# -- consumer -------------------------------------------------------------------------------------------

def _consistent(subjects: list[tuple[str, str]], pred: dict, where: str) -> dict[str, str]:
    """The predicate's listing must agree with the subjects it is signed with; returns name -> sha256."""
    files: dict[str, str] = {}
    for name, digest in subjects:
        check_name(name, f"{where}: subject")
        if name in files:
            raise FqError(f"{where}: subject {name} is listed twice")
        if name in (NAME, SUMMARY_NAME):
            raise FqError(f"{where}: subject {name} is not a file a publication lists")
        files[name] = digest
    for product, e in sorted(pred["products"].items()):
        if e["file"] != plan_file(product):
            raise FqError(f"{where}: products.{product}.file is {e['file']!r}, expected {plan_file(product)!r}")
        if files.get(e["file"]) != e["sha256"]:
            raise FqError(f"{where}: products.{product}: {e['file']} is not a subject with sha256 {e['sha256'][:16]}…")
        if e["chain"][0] not in pred["bases"]:
            raise FqError(f"{where}: products.{product}: base {e['chain'][0]!r} is not among the bases")
        if e["version"] != pred["version"]:  # one publication, one version: finalize signs every plan with it
            raise FqError(f"{where}: products.{product} is a plan of version {e['version']}, the publication is "
                          f"version {pred['version']}; a publication's plans carry its version")
    for node, b in sorted(pred["bases"].items()):
        if not b["manifest"].endswith("/" + MANIFEST_NAME) or files.get(b["manifest"]) != b["manifest_sha256"]:
            raise FqError(f"{where}: bases.{node}: {b['manifest']} is not a subject base manifest with sha256 "
                          f"{b['manifest_sha256'][:16]}…")
    return files


def read_publication(root: str | os.PathLike, public_key: Ed25519PublicKey, campaign: dict | None = None) -> Statement:
    """Verify ``root/publication.intoto.jsonl``: signature first, then statement, schema, signer, campaign,
    and the listing's agreement with its subjects."""
    where = f"{root}/{NAME}"
    data = read_regular(root, NAME, where)
    payload = dsse.open_envelope(data, public_key, where)
    subjects, pred = parse_statement(payload, where, PUBLICATION)
    if pred["campaign"]["signer"] != fingerprint(public_key):
        raise FqError(f"{where}: campaign identity names signer {pred['campaign']['signer'][:16]}…, not the pinned key")
    if campaign is not None:
        require_same(pred["campaign"], campaign, where)
    files = _consistent(subjects, pred, where)
    return Statement(where, sha256_hex(data), sha256_hex(payload), pred, files)


def plan_problems(stmt: Statement, plans: dict[str, SignedPlan]) -> list[str]:
    """Every verified plan (tree-relative file -> SignedPlan) against its product entry; a plan file the statement
    does not list at all is left to ``file_problems`` (reported there once)."""
    out = []
    for file, plan in sorted(plans.items()):
        product = plan.predicate["product"]
        entry = stmt.predicate["products"].get(product)
        if file not in stmt.files:
            continue
        if entry is None or entry["file"] != file:
            out.append(f"{stmt.path}: lists {file} but not as product {product!r} (the signed plan's product)")
            continue
        if entry["sha256"] != plan.sha256:
            continue  # another plan than the listed one: file_problems names it once
        out += entry_problems(stmt, entry, plan, file)
    return out


def _groups(names: set[str], other: set[str]) -> dict[str, list[str]]:
    """Group ``names`` under the highest directory holding none of ``other`` (a whole directory withheld
    or added is one problem, not one per file); a name with no such directory is its own group."""
    groups: dict[str, list[str]] = {}
    dirs_of_other = {"/".join(n.split("/")[:i]) for n in other for i in range(1, n.count("/") + 1)}
    for n in sorted(names):
        parts = n.split("/")
        key = n
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d not in dirs_of_other:
                key = d + "/"
                break
        groups.setdefault(key, []).append(n)
    return groups


def file_problems(stmt: Statement, root: Path, present: set[str], digests: dict[str, str],
                  already_missing: set[str] = frozenset(), *, reported: set[str] = frozenset(),
                  reencoded: set[str] = frozenset()) -> list[str]:
    """The tree against the statement, both ways: a listed file missing (a whole product or directory
    withheld is one line), a present file unlisted, a digest that is not the listed one. ``present``: the
    tree's files (relative to ``root``, without the statement and the summary); ``digests``: what the
    signed documents covering each file state (files whose own verification failed are absent);
    ``already_missing``: files already reported missing (fragments a plan needs); ``reported``: names, and
    directories (ending in "/"), whose problems are already reported (a missing or symlinked directory, a
    replaced base, a stale fragment): nothing under them is reported again; ``reencoded``: plans whose envelope
    line is not fq's canonical encoding (a re-encoded copy of a signed line, called that)."""
    dirs = tuple(d for d in reported if d.endswith("/"))

    def done(n: str) -> bool:
        return n in reported or n in already_missing or n.startswith(dirs)

    out = []
    listed = stmt.files
    products = {e["file"]: p for p, e in stmt.predicate["products"].items()}
    missing = {n for n in set(listed) - present if not done(n)}
    for file in sorted(missing & set(products)):
        p = products[file]
        out.append(f"{root}/{file}: product {p!r} is listed in {NAME} (version {stmt.version}) but its plan is "
                   "missing (a withheld product)")
    for key, names in sorted(_groups(missing - set(products), present).items()):
        if key.endswith("/"):
            out.append(f"{root}/{key}: missing, with the {len(names)} file(s) {NAME} lists under it")
        else:
            out.append(f"{root}/{key}: listed in {NAME} but missing")
    unlisted = {n for n in present - set(listed) if not done(n)}
    for key, names in sorted(_groups(unlisted, set(listed)).items()):
        if key.endswith("/"):
            out.append(f"{root}/{key}: {len(names)} file(s) not listed in {NAME} (not part of this publication)")
        else:
            out.append(f"{root}/{key}: not listed in {NAME} (not part of this publication)")
    for name in sorted(present & set(listed)):
        got = digests.get(name)
        if got is None or got == listed[name] or done(name):
            continue
        if name in reencoded and name in products:
            out.append(f"{root}/{name}: its envelope line is not fq's canonical encoding (sha256 {got[:16]}…): a "
                       f"re-encoded copy of a signed plan, not the line {NAME} lists for product {products[name]!r} "
                       f"({listed[name][:16]}…); fetch the published line")
            continue
        what = f" (the plan of product {products[name]!r}, version " \
               f"{stmt.predicate['products'][products[name]]['version']} listed)" if name in products else ""
        out.append(f"{root}/{name}: sha256 {got[:16]}… is not the {listed[name][:16]}… {NAME} lists{what}")
    return out


def replaced_bases(stmt: Statement, root: Path, present: set[str], digests: dict[str, str], nodes: dict[str, str],
                   users: dict[str, list[str]]) -> tuple[list[str], set[str]]:
    """Base directories that hold another base than the one the statement lists there (two base directories
    swapped, one copied over another, an older base put back): its verified manifest (``digests``; ``nodes``:
    manifest name -> the node it is the base of) is not the listed one. One line per directory, naming what it
    holds and how many of its files differ from the listing, instead of one per file (``users``: manifest name ->
    products of the plans pinning it). Returns (lines, the directories: nothing under them is reported again)."""
    lines, dirs = [], set()
    for node, b in sorted(stmt.predicate["bases"].items()):
        m = b["manifest"]
        got = digests.get(m)
        if got is None or got == b["manifest_sha256"] or m not in nodes:
            continue
        d = m.rsplit("/", 1)[0]
        here = {n for n in present if n.startswith(d + "/")}
        listed = {n for n in stmt.files if n.startswith(d + "/")}
        different = sorted(n for n in here & listed if digests.get(n) not in (None, stmt.files[n]))
        groups = ((different, "different"), (sorted(listed - here), "missing"), (sorted(here - listed), "not listed"))
        names = [n for group, _ in groups for n in group]
        counts = ", ".join(f"{len(group)} {what}" for group, what in groups if group)
        if len(names) <= 3:  # a few: name them (relative to the directory)
            counts += ": " + ", ".join(n[len(d) + 1:] for n in names)
        products = sorted(users.get(m, []))
        needed = f" (needed by plan{'s' if len(products) > 1 else ''} {', '.join(products)})" if products else ""
        if nodes[m] != node:
            holds, cause = f"the base of node {nodes[m]}", "; a swapped or copied base directory"
        else:
            holds, cause = f"another base manifest of node {node}", ""
        lines.append(f"{root}/{d}/: holds {holds}, not the base {NAME} lists there (its {MANIFEST_NAME} sha256 "
                     f"{got[:16]}…, listed: node {node}'s {b['manifest_sha256'][:16]}…): {len(names)} of its files "
                     f"differ from the listing ({counts}){cause}{needed}")
        dirs.add(d)
    return lines, dirs
