"""``fq verify``: check a shard, a directory of shards, or a published campaign against a pinned key.

Every file in a verified tree must be accounted for:

- ``*.safetensors``: a fragment or skeleton shard with its ``.intoto.jsonl`` beside it (signature
  first, then the shard re-hashed in one pass and compared with every attested range);
- ``*.safetensors.intoto.jsonl``: must have its shard;
- ``fq-manifest.intoto.jsonl``: a base manifest; every file under its directory is listed and re-hashed;
- ``assemblies/*.assembly.intoto.jsonl``: a plan; verified (signature, chain, expiry, version), and each
  fragment it names must be present under the campaign root with the named digests and attest its
  chain entry's node digest;
- ``campaign_summary.json`` at the root: accounted for by ``fq.summary.check_summary`` (every value it
  states that a signed document also states must agree with it);
- any other file must be listed by a base manifest above it. Symlinks, FIFOs, devices and leftover
  ``.tmp-*`` files are problems. All documents must carry one campaign identity, and all fragments of
  one node one node_digest (a fragment left over from an older definition of its node is stale).

Problems are collected, one line each; nothing raises past ``verify_path`` except usage errors. A
directory given as a symlink (a promoted ``published`` link) is verified where it points; symlinks inside
the tree stay problems.

    verify_path(path, public_key, now=None, state=None, summary=None) -> Report
"""
from __future__ import annotations

import datetime as dt
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fq.assembly import PRODUCT_FILE, SUFFIX, PlanState, check_geometry, read_assembly
from fq.attest.campaign import campaign_digest
from fq.attest.fragment import Attested, check_node_digest, verify_shard
from fq.errors import FqError
from fq.manifest import MANIFEST_NAME, check_base_files, read_base_manifest
from fq.safepath import describe_mode, read_regular, split_path
from fq.summary import SUMMARY_NAME, check_summary

ATT_SUFFIX = ".safetensors.intoto.jsonl"


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    shards: int = 0
    manifests: int = 0
    assemblies: int = 0
    campaigns: dict = field(default_factory=dict)  # campaign digest -> (first document naming it, identity)

    @property
    def ok(self) -> bool:
        return not self.problems

    def campaign(self, ident: dict, where: str) -> None:
        d = campaign_digest(ident)
        if self.campaigns and d not in self.campaigns:
            first_where, first = next(iter(self.campaigns.values()))
            field = next(k for k in sorted(set(ident) | set(first)) if ident.get(k) != first.get(k))
            self.problems.append(f"{where}: campaign identity differs in {field!r} from {first_where}'s "
                                 "(two campaigns in one tree)")
        self.campaigns.setdefault(d, (where, ident))


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else describe_mode(mode)


def _check_plan(report: Report, path: Path, root: Path, public_key, now, state, verified: dict[str, Attested],
                failed: frozenset[str] = frozenset()):
    result = read_assembly(path, public_key, now=now, state=state)
    plan = result.predicate
    m = PRODUCT_FILE.fullmatch(path.name)
    if not m or m[1] != plan["product"]:
        raise FqError(f"{path}: file name does not match its product {plan['product']!r}")
    report.campaign(plan["campaign"], str(path))
    manifest_name = plan["base"]["manifest"]["name"]
    manifest = read_base_manifest(root / plan["base"]["dir"], public_key, plan["campaign"])
    if manifest.sha256 != plan["base"]["manifest"]["sha256"]:
        raise FqError(f"{path}: {manifest_name} is not the base manifest the plan pins")
    atts = []
    for f in plan["fragments"]:
        if f["name"] in failed:
            continue  # already reported as its own problem
        att = verified.get(f["name"]) or verify_shard(root, f["name"], public_key, plan["campaign"])
        atts.append(att)
        if (att.sha256, att.attestation_sha256) != (f["sha256"], f["attestation_sha256"]):
            raise FqError(f"{path}: fragment {f['name']} or its attestation is not the one the plan names")
        p = att.predicate
        if any(p[k] != f[k] for k in ("node", "layer", "block", "parent", "experts")):
            raise FqError(f"{path}: fragment {f['name']} differs from the plan's entry")
        node = next(n for n in plan["chain"] if n["node"] == f["node"])
        check_node_digest(att, node["digest"], str(path))
        if (p["role"], p["K"], p["codebook"]) != (node["role"], node["K"], node["codebook"]):
            raise FqError(f"{path}: {f['name']} is attested {p['role']} K={p['K']} {p['codebook']}, the plan's "
                          f"chain says {node['role']} K={node['K']} {node['codebook']}")
    check_geometry([a.predicate for a in atts], [a.info for a in atts], str(path))
    return result


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
        else:
            report.problems.append(f"{path}: not an fq shard, attestation, manifest or assembly")
    except FqError as e:
        report.problems.append(str(e))
    return report


def _verify_tree(report: Report, root: Path, public_key, now, state, summary=None) -> None:
    files: list[str] = []
    unusable: set[str] = set()  # symlinks and special files: reported once, not again as missing
    for dirpath, dirnames, filenames in os.walk(root):
        for d in list(dirnames):
            if os.path.islink(os.path.join(dirpath, d)):
                report.problems.append(f"{Path(dirpath, d)}: is a symlink; a published tree holds only real files")
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
            else:
                files.append(rel)
    present = set(files)
    covered: set[str] = set()
    verified: dict[str, Attested] = {}
    failed: set[str] = set(unusable)
    for rel in files:
        p = root / rel
        if rel.endswith(".safetensors"):
            covered.add(rel)
            try:
                att = verify_shard(root, rel, public_key)
                report.campaign(att.predicate["campaign"], rel)
                verified[rel] = att
                report.shards += 1
            except FqError as e:
                report.problems.append(str(e))
                failed.add(rel)
        elif rel.endswith(ATT_SUFFIX):
            covered.add(rel)
            if rel[: -len(".intoto.jsonl")] not in present | unusable:
                report.problems.append(f"{p}: attestation without its shard {rel[: -len('.intoto.jsonl')]}")
        elif p.name == MANIFEST_NAME:
            covered.add(rel)
            base = p.parent
            try:
                manifest = read_base_manifest(base, public_key)
                report.campaign(manifest.campaign, rel)
                report.problems += check_base_files(base, manifest)
                prefix = base.relative_to(root).as_posix()
                covered.update(n if prefix == "." else f"{prefix}/{n}" for n in manifest.files)
                report.manifests += 1
            except FqError as e:
                report.problems.append(str(e))
    _check_edges(report, verified)
    _check_node_digests(report, verified)
    plans = {}
    for rel in files:
        if rel.endswith(SUFFIX) and Path(rel).parent.name == "assemblies":
            covered.add(rel)
            plan_root = (root / rel).parent.parent
            try:
                prefix = plan_root.relative_to(root).as_posix()
                def scope(names):
                    return {k[len(prefix) + 1:] if prefix != "." else k for k in names
                            if prefix == "." or k.startswith(prefix + "/")}
                scoped = {k: verified[(prefix + "/" + k) if prefix != "." else k] for k in scope(verified)}
                plans[rel] = _check_plan(report, root / rel, plan_root, public_key, now, state, scoped,
                                         frozenset(scope(failed)))
                report.assemblies += 1
            except FqError as e:
                report.problems.append(str(e))
    if SUMMARY_NAME in present or summary is not None:
        covered.add(SUMMARY_NAME)
        src, name = (root, SUMMARY_NAME) if SUMMARY_NAME in present else split_path(summary)
        where = str(Path(src, name))
        try:
            data = read_regular(src, name, where)
            idents = [ident for _, ident in report.campaigns.values()]
            top = {k: v for k, v in plans.items() if Path(k).parent.as_posix() == "assemblies"}
            unverified = {k for k in present if Path(k).parent.as_posix() == "assemblies" and k not in top}
            report.problems += check_summary(data, where, top, idents[0] if len(idents) == 1 else None, unverified)
        except FqError as e:
            report.problems.append(str(e))
    for rel in files:
        if rel not in covered:
            report.problems.append(f"{root / rel}: not covered by any attestation or base manifest")
    if not files and not report.problems:
        report.problems.append(f"{root}: no files to verify")


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
