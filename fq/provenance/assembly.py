"""Assemblies: the signed plan of one product, and the consumer's checks of it.

A product is a chain base -> stage -> ...; its plan (predicate ``fq-assembly/1``, schema
``fq/schemas/fq-assembly.schema.json``) names the campaign identity, the recipe it was built from
(``recipe_sha256``), the base (node, directory, manifest name + digest), the runtime constants and the
recipe's node digest of every chain node (K: a ``fq.core.kbits`` node spec as JSON, one K or K per layer and
projection; codebook; digest: every fragment of the node must attest
that ``node_digest``, so a fragment encoded for an older definition of its node is refused), and
every fragment with its sha256, attestation digest, header digest, parent edge and per-expert byte ranges — so a
consumer can narrow to chosen experts before reading any payload. ``version`` is monotonic per
(signer, product), across campaigns; ``expires`` is an explicit UTC timestamp (``YYYY-MM-DDTHH:MM:SSZ``). The plan is
an in-toto Statement (subjects: every fragment and the base manifest) in the same DSSE envelope as
fragments, stored at ``ROOT/assemblies/PRODUCT.assembly.intoto.jsonl``; fragment names are relative
to ROOT.

    build_assembly(root, product=, chain=, fragments=, base_dir=, campaign=, recipe_sha256=, version=, expires=,
                   public_key=) -> dict
    write_assembly(root, plan, key) -> Path
    read_assembly(path, public_key, now=, state=None, min_version=None) -> SignedPlan
    PlanState(path)   # highest version seen per (signer, product) and per signer's publication: refuses
                      # rollback (across campaigns) and same-version swaps
    check_product_name(plan)  # the file name PRODUCT.assembly.intoto.jsonl is the product the signed plan names
"""
from __future__ import annotations

import datetime as dt
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fq.core import atomic, kbits
from fq.core.canonical import dumps, load, loads as load_bytes, pretty, sha256_hex
from fq.core.safepath import check_name, read_regular, split_path
from fq.errors import FqError
from fq.provenance.attest import dsse
from fq.provenance.attest.campaign import campaign_digest
from fq.provenance.attest.fragment import SHA256_HEX, check_node_digest, verify_shard
from fq.provenance.attest.keys import fingerprint
from fq.provenance.attest.statement import ASSEMBLY, parse_statement, statement, validate_predicate
from fq.provenance.fragments import check_node
from fq.provenance.manifest import MANIFEST_NAME, read_base_manifest

FORMAT = "fq-assembly/1"
SUFFIX = ".assembly.intoto.jsonl"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def assembly_name(product: str) -> str:
    return f"assemblies/{check_node(product, 'product')}{SUFFIX}"


def format_time(t: dt.datetime | str) -> str:
    if isinstance(t, str):
        parse_time(t, "expires")
        return t
    if t.tzinfo is None:
        raise FqError("expires: give a timezone-aware datetime (UTC)")
    return t.astimezone(dt.timezone.utc).strftime(TIME_FORMAT)


def parse_time(text: str, where: str) -> dt.datetime:
    try:
        return dt.datetime.strptime(text, TIME_FORMAT).replace(tzinfo=dt.timezone.utc)
    except (TypeError, ValueError):
        raise FqError(f"{where}: {text!r} is not a UTC time YYYY-MM-DDTHH:MM:SSZ") from None


def check_chain(chain: list[dict], where: str) -> None:
    """A chain is one base then stages, each stage's parent the node before it; node names unique; every node's K a
    node spec (``fq.core.kbits.node``)."""
    if not chain or chain[0]["role"] != "base" or chain[0]["parent"] is not None:
        raise FqError(f"{where}: chain must start with a base node that has no parent")
    seen = set()
    for i, n in enumerate(chain):
        kbits.node(n["K"], f"{where}: chain[{i}] {n['node']!r} K")
        if n["node"] in seen:
            raise FqError(f"{where}: node {n['node']!r} appears twice in the chain")
        seen.add(n["node"])
        if i and (n["role"] != "stage" or n["parent"] != chain[i - 1]["node"]):
            raise FqError(f"{where}: chain[{i}] {n['node']!r} must be a stage whose parent is {chain[i - 1]['node']!r}")


def check_fragments(plan: dict, where: str) -> None:
    """Internal consistency of a plan: unique (node, layer, block), constants from the chain, every stage
    fragment's parent edge names the parent node's fragment of the same block, experts nested, each
    fragment's expert ranges contiguous and ending at its size (fq's fragment layout)."""
    chain = {n["node"]: n for n in plan["chain"]}
    base_dir = plan["base"]["dir"]
    by_key = {}
    for f in plan["fragments"]:
        check_name(f["name"], f"{where}: fragment name")
        if f["node"] not in chain:
            raise FqError(f"{where}: fragment {f['name']} belongs to node {f['node']!r}, which is not in the chain")
        k = (f["node"], f["layer"], f["block"])
        if k in by_key:
            raise FqError(f"{where}: two fragments for node {k[0]} layer {k[1]} block {k[2]}")
        by_key[k] = f
        if (chain[f["node"]]["role"] == "base") != f["name"].startswith(base_dir + "/"):
            raise FqError(f"{where}: fragment {f['name']}: base fragments live under {base_dir}/, stage fragments not")
        ranges = [(e["offset"], e["offset"] + e["length"]) for e in f["experts"]]
        if [e["expert"] for e in f["experts"]] != sorted({e["expert"] for e in f["experts"]}) or \
                any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
            raise FqError(f"{where}: fragment {f['name']}: experts must be ascending with disjoint ranges")
        if any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            raise FqError(f"{where}: fragment {f['name']}: expert byte ranges leave gaps; a fragment's experts are "
                          "contiguous")
        if f["size"] != ranges[-1][1]:
            raise FqError(f"{where}: fragment {f['name']}: size {f['size']} is not where its last expert's bytes end "
                          f"({ranges[-1][1]}); a fragment holds nothing after its experts")
    for (node, layer, block), f in by_key.items():
        parent = chain[node]["parent"]
        if parent is None:
            if f["parent"] is not None:
                raise FqError(f"{where}: base fragment {f['name']} names a parent")
            continue
        pf = by_key.get((parent, layer, block))
        if pf is None:
            raise FqError(f"{where}: stage fragment {f['name']} has no {parent} fragment for layer {layer} block {block}")
        edge = {"name": pf["name"].rsplit("/", 1)[-1], "sha256": pf["sha256"]}
        if f["parent"] != edge:
            got = f["parent"] or {"name": None, "sha256": "-"}
            raise FqError(f"{where}: stage fragment {f['name']} records parent {got['name']} sha256 "
                          f"{got['sha256'][:16]}…, but the plan's {parent} fragment is {edge['name']} sha256 "
                          f"{edge['sha256'][:16]}… (chain edge broken)")
        missing = {e["expert"] for e in f["experts"]} - {e["expert"] for e in pf["experts"]}
        if missing:
            raise FqError(f"{where}: stage fragment {f['name']} corrects experts {sorted(missing)} its parent lacks")


def check_geometry(predicates: list[dict], infos: list, where: str) -> None:
    """Every node of a chain must have the same (in, out) for each (layer, expert, projection)."""
    seen: dict[tuple, tuple[int, int, str]] = {}
    for p, info in zip(predicates, infos):
        for (expert, proj), lin in info.linears.items():
            g = (lin.in_features, lin.out_features)
            first = seen.setdefault((p["layer"], expert, proj), (*g, info.name))
            if first[:2] != g:
                raise FqError(f"{where}: {info.name} expert {expert} {proj} is {g[0]}x{g[1]} (in x out), "
                              f"{first[2]} has {first[0]}x{first[1]}; a chain must keep the geometry")


def payload_bytes(plan: dict) -> int:
    """The bytes a product's plan names: its expert fragments and, for a whole-model base, its linear fragments, and
    its stages' residuals on non-expert linears."""
    return sum(f["size"] for f in plan["fragments"]) + sum(f["size"] for f in plan.get("linears", ())) + \
        sum(f["size"] for f in plan.get("stage_linears", ()))


def _unit(layer: int | None) -> str:
    return "the head" if layer is None else f"layer {layer}"


def check_stage_linears(plan: dict, where: str) -> None:
    """A plan's stage residuals on non-expert linears: each in its stage's directory, one per (stage, class, layer),
    stages in chain order, and each naming as its parent the linear fragment of the same class and layer that the
    chain reconstructs before it (the base's linear fragment, or the previous stage's residual on it)."""
    chain = {n["node"]: i for i, n in enumerate(plan["chain"])}
    last: dict = {}  # (class, layer) -> {name, sha256} of the chain's last linear fragment of it so far
    for f in plan.get("linears", ()):
        last[(f["class"], f["layer"])] = {"name": f["name"].rsplit("/", 1)[-1], "sha256": f["sha256"]}
    seen, order = set(), []
    for f in plan.get("stage_linears", ()):
        check_name(f["name"], f"{where}: stage linear name")
        i = chain.get(f["stage"])
        if not i:
            raise FqError(f"{where}: linear fragment {f['name']} belongs to {f['stage']!r}, which is not a stage of the "
                          f"chain")
        if not f["name"].startswith(f"stages/{f['stage']}/"):
            raise FqError(f"{where}: linear fragment {f['name']} of stage {f['stage']} lies outside stages/{f['stage']}/")
        key = (f["stage"], f["class"], f["layer"])
        if key in seen:
            raise FqError(f"{where}: two linear fragments of stage {key[0]} for {key[1]} layer {key[2]}")
        seen.add(key)
        order.append(i)
        want = last.get((f["class"], f["layer"]))
        if want is None:
            raise FqError(f"{where}: linear fragment {f['name']} is a residual on {f['class']} "
                          f"{_unit(f['layer'])}"
                          f", which the chain before stage {f['stage']} does not quantize")
        if f["parent"] != want:
            raise FqError(f"{where}: linear fragment {f['name']} records parent {f['parent']['name']} sha256 "
                          f"{f['parent']['sha256'][:16]}…, but the chain's {f['class']} fragment before it is "
                          f"{want['name']} sha256 {want['sha256'][:16]}… (chain edge broken)")
        last[(f["class"], f["layer"])] = {"name": f["name"].rsplit("/", 1)[-1], "sha256": f["sha256"]}
    if order != sorted(order):
        raise FqError(f"{where}: stage linear fragments are not in chain order")


def plan_subjects(plan: dict) -> list[tuple[str, str]]:
    """What a plan's statement signs: every expert fragment, every stage residual on linears, the base manifest
    (the base's own linear fragments are covered by the manifest)."""
    return [(f["name"], f["sha256"]) for f in plan["fragments"]] + \
        [(f["name"], f["sha256"]) for f in plan.get("stage_linears", ())] + \
        [(plan["base"]["manifest"]["name"], plan["base"]["manifest"]["sha256"])]


def _linear_entry(root, lin: dict, base_dir: str, manifest, public_key, campaign: dict, product: str) -> dict:
    """One linear fragment of a whole-model base, verified, as the plan lists it."""
    name = lin["name"]
    att = verify_shard(root, name, public_key, campaign)
    p = att.predicate
    if p["kind"] != "linear":
        raise FqError(f"{name}: a {p['kind']} shard is not a linear fragment")
    if p["node_digest"] != lin["digest"]:
        raise FqError(f"{name}: attests node_digest {p['node_digest'][:16]}…, the base's linear node {p['node']} is "
                      f"{lin['digest'][:16]}…")
    rel = name[len(base_dir) + 1:] if name.startswith(base_dir + "/") else None
    if rel is None or (manifest.files.get(rel) or (None,))[0] != att.sha256:
        raise FqError(f"plan {product}: linear fragment {name} is not in {base_dir} as its base manifest lists it")
    return {"name": name, "sha256": att.sha256, "attestation_sha256": att.attestation_sha256, "node": p["node"],
            "class": p["class"], "layer": p["layer"], "K": p["K"], "codebook": p["codebook"], "digest": p["node_digest"],
            "size": manifest.files[rel][1]}


def _stage_linear_entry(root, lin: dict, chain: dict, public_key, campaign: dict) -> dict:
    """One stage's residual on non-expert linears (``lin``: {name, digest, stage}), verified, as the plan lists it."""
    name = lin["name"]
    att = verify_shard(root, name, public_key, campaign)
    p = att.predicate
    if p["kind"] != "linear" or p["role"] != "stage":
        raise FqError(f"{name}: a {p['kind']} {p['role']} shard is not a stage's residual on linears")
    if p["node_digest"] != lin["digest"]:
        raise FqError(f"{name}: attests node_digest {p['node_digest'][:16]}…, the stage's linear node {p['node']} is "
                      f"{lin['digest'][:16]}…")
    if p["codebook"] != chain[lin["stage"]]["codebook"]:
        raise FqError(f"{name}: codebook {p['codebook']}, stage {lin['stage']} encodes with {chain[lin['stage']]['codebook']}")
    return {"name": name, "sha256": att.sha256, "attestation_sha256": att.attestation_sha256, "stage": lin["stage"],
            "node": p["node"], "class": p["class"], "layer": p["layer"], "K": p["K"], "codebook": p["codebook"],
            "digest": p["node_digest"], "parent": p["parent"], "size": p["shard"]["size"],
            "header_sha256": p["shard"]["header_sha256"]}


def build_assembly(root: str | os.PathLike, *, product: str, chain: list[dict], fragments: list[str],
                   base_dir: str, campaign: dict, recipe_sha256: str, version: int, expires: dt.datetime | str,
                   public_key: Ed25519PublicKey, linears: list[dict] | None = None,
                   stage_linears: list[dict] | None = None) -> dict:
    """The plan of ``product``: verifies every named fragment (signature and bytes) and the base manifest
    under ``public_key``, requires each fragment's attested node_digest to be its chain entry's ``digest``
    (``Recipe.node_digest``), re-derives K/codebook per node from the fragments, and checks the chain.
    ``linears``: a whole-model base's linear fragments, [{name, digest}] (``LinearNode.digest``), each verified
    and required to be listed in the base manifest with its bytes. ``stage_linears``: the chain's stages' residuals
    on non-expert linears, [{name, digest, stage}], each verified (kind linear, role stage, its node digest) and its
    parent edge checked (``check_stage_linears``)."""
    check_name(base_dir, "base_dir")
    if not (isinstance(recipe_sha256, str) and SHA256_HEX.fullmatch(recipe_sha256)):
        raise FqError(f"plan {product}: recipe_sha256 {recipe_sha256!r} is not a sha256 hex digest")
    for i, n in enumerate(chain):
        if not isinstance(n, dict) or set(n) != {"node", "role", "K", "codebook", "parent", "digest"}:
            raise FqError(f"plan {product}: chain[{i}] must be {{node, role, K, codebook, parent, digest}}, got {n!r}")
        if not (isinstance(n["digest"], str) and SHA256_HEX.fullmatch(n["digest"])):
            raise FqError(f"plan {product}: chain[{i}] digest {n['digest']!r} is not a sha256 hex digest "
                          "(Recipe.node_digest)")
    check_chain(chain, f"plan {product}")
    manifest = read_base_manifest(Path(root) / base_dir, public_key, campaign)
    nodes = {n["node"]: n for n in chain}
    entries, predicates, verified = [], [], []
    for name in sorted(fragments):
        att = verify_shard(root, name, public_key, campaign)
        p = att.predicate
        predicates.append(p)
        verified.append(att)
        if p["kind"] != "expert":
            raise FqError(f"{name}: a {p['kind']} shard is not a fragment of a chain node")
        node = nodes.get(p["node"])
        if node is None:
            raise FqError(f"{name}: fragment of node {p['node']!r}, which is not in {product}'s chain")
        check_node_digest(att, node["digest"], f"plan {product}")
        want = kbits.of_layout(kbits.node_at(node["K"], p["layer"], f"plan {product}: chain node {p['node']} K"),
                               att.info.meta["layout"].projections)
        for proj, K in want.items():  # exllamav3: one K per projection of a layer, for all its experts
            derived = {(lin.K, lin.codebook) for (_, pr), lin in att.info.linears.items() if pr == proj}
            if derived != {(K, node["codebook"])}:
                at = "" if kbits.is_one(kbits.node(node["K"])) else f" {proj} at layer {p['layer']}"
                raise FqError(f"{name}: tensors are {sorted(derived)}, the chain says{at} K={K} {node['codebook']}")
        if p["role"] != node["role"]:
            raise FqError(f"{name}: fragment role {p['role']}, the chain says {node['role']}")
        entries.append({"name": name, "sha256": att.sha256, "attestation_sha256": att.attestation_sha256,
                        "node": p["node"], "layer": p["layer"], "block": p["block"], "size": p["shard"]["size"],
                        "header_sha256": p["shard"]["header_sha256"], "parent": p["parent"],
                        "experts": p["experts"]})
    check_geometry(predicates, [verify.info for verify in verified], f"plan {product}")
    order = {n["node"]: i for i, n in enumerate(chain)}
    entries.sort(key=lambda f: (order[f["node"]], f["layer"], f["block"]))
    layouts = {dumps(p["layout"]) for p in predicates}
    if len(layouts) > 1:
        raise FqError(f"plan {product}: fragments use {len(layouts)} different expert layouts; a product has one")
    plan = {"format": FORMAT, "product": product, "version": version, "expires": format_time(expires),
            "campaign": campaign, "recipe_sha256": recipe_sha256,
            "layout": predicates[0]["layout"] if predicates else {},
            "base": {"node": chain[0]["node"] if chain else "", "dir": base_dir,
                     "manifest": {"name": f"{base_dir}/{MANIFEST_NAME}", "sha256": manifest.sha256}},
            "chain": chain, "fragments": entries}
    if linears:
        plan["linears"] = [_linear_entry(root, lin, base_dir, manifest, public_key, campaign, product)
                           for lin in sorted(linears, key=lambda x: x["name"])]
    if stage_linears:
        for lin in stage_linears:
            if lin.get("stage") not in nodes or nodes[lin["stage"]]["role"] != "stage":
                raise FqError(f"plan {product}: linear fragment {lin.get('name')} names {lin.get('stage')!r}, not a "
                              f"stage of the chain")
        plan["stage_linears"] = [_stage_linear_entry(root, lin, nodes, public_key, campaign)
                                 for lin in sorted(stage_linears, key=lambda x: (order[x["stage"]], x["name"]))]
    validate_predicate(ASSEMBLY, plan, f"plan {product}")
    check_chain(chain, f"plan {product}")
    check_fragments(plan, f"plan {product}")
    check_stage_linears(plan, f"plan {product}")
    if manifest.node != chain[0]["node"]:
        raise FqError(f"plan {product}: {base_dir} is the base of {manifest.node!r}, the chain starts at {chain[0]['node']!r}")
    for f in entries:
        if f["node"] == chain[0]["node"] and f["name"][len(base_dir) + 1:] not in manifest.files:
            raise FqError(f"plan {product}: base fragment {f['name']} is not listed in the base manifest")
    return plan


def sign_assembly(plan: dict, key: Ed25519PrivateKey) -> bytes:
    return dsse.envelope_line(dsse.sign(statement(plan_subjects(plan), ASSEMBLY, plan), key))


def write_assembly(root: str | os.PathLike, plan: dict, key: Ed25519PrivateKey) -> Path:
    if plan["campaign"]["signer"] != fingerprint(key):
        raise FqError(f"plan {plan['product']}: campaign names another signer than this key")
    path = Path(root) / assembly_name(plan["product"])
    atomic.write_bytes(path, sign_assembly(plan, key))
    return path


@dataclass(frozen=True)
class SignedPlan:
    path: str
    sha256: str  # of the envelope line: what state files, adapters and the publication statement record
    predicate: dict
    statement_sha256: str = ""  # of the signed statement inside the envelope (the same for a re-encoded line)
    canonical: bool = True  # the line is fq's canonical encoding of its envelope (what finalize writes)

    @property
    def campaign_digest(self) -> str:
        return campaign_digest(self.predicate["campaign"])

    @property
    def signer(self) -> str:
        return self.predicate["campaign"]["signer"]


class PlanState:
    """Highest version seen per signer and product name, and of the signer's publication statements,
    kept in a small JSON file (``--state``).

    Keys: ``SIGNER/product/NAME`` (a plan) and ``SIGNER/publication`` (a publication statement), SIGNER
    being the key's fingerprint: versions are monotonic across every campaign that key signed, so a
    complete older campaign is refused as a rollback too. Values: ``{version, sha256, statement_sha256}``
    (the envelope line's digest and its signed statement's). Refuses an older version (rollback) and a
    different document under an already-seen version. Entries of older fq versions (keyed by campaign
    digest) are kept and no longer consulted.
    """

    FIELDS = {"version", "sha256", "statement_sha256"}

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def _load(self) -> dict:
        if not self.path.exists():
            return {}
        obj = load(self.path)
        if not isinstance(obj, dict) or not all(isinstance(v, dict) and {"version", "sha256"} <= set(v) <= self.FIELDS
                                                 and type(v["version"]) is int and isinstance(v["sha256"], str)
                                                 and isinstance(v.get("statement_sha256", ""), str)
                                                 for v in obj.values()):
            raise FqError(f"{self.path}: plan state must map signer/product to {{version, sha256, statement_sha256}}")
        return obj

    def validate(self) -> None:
        """Refuse a state file fq cannot read, once, before anything is verified against it."""
        self._load()

    @staticmethod
    def plan_key(plan: SignedPlan) -> str:
        return f"{plan.signer}/product/{plan.predicate['product']}"

    @staticmethod
    def publication_key(signer: str) -> str:
        return f"{signer}/publication"

    def _check(self, key: str, version: int, sha256: str, statement_sha256: str, where: str, what: str,
               label: str) -> None:
        seen = self._load().get(key)
        if seen is None:
            return
        if version < seen["version"]:
            raise FqError(f"{where}: {what} version {version} is older than version {seen['version']} already "
                          f"seen for {label} (rollback refused); versions rise per signer, across its campaigns")
        if version == seen["version"] and sha256 != seen["sha256"]:
            if statement_sha256 and seen.get("statement_sha256") == statement_sha256:
                raise FqError(f"{where}: the envelope is encoded differently from the {what} seen for {label} "
                              f"version {version}: the same signed statement, but line sha256 {sha256[:16]}…, not "
                              f"{seen['sha256'][:16]}… (a re-encoded copy of the published line; fetch the original)")
            raise FqError(f"{where}: a different {what} with the same version {version} was already seen "
                          f"for {label}; a changed {what} needs a higher version")

    def check(self, plan: SignedPlan) -> None:
        self._check(self.plan_key(plan), plan.predicate["version"], plan.sha256, plan.statement_sha256, plan.path,
                    "plan", plan.predicate["product"])

    def check_publication(self, pub) -> None:
        """``pub``: a verified ``fq.provenance.publication.Statement``."""
        self._check(self.publication_key(pub.signer), pub.version, pub.sha256, pub.statement_sha256, pub.path,
                    "publication", f"signer {pub.signer[:16]}…")

    def _record(self, key: str, version: int, sha256: str, statement_sha256: str) -> None:
        state = self._load()
        if state.get(key, {}).get("version", 0) <= version:
            state[key] = {"version": version, "sha256": sha256, "statement_sha256": statement_sha256}
            atomic.write_text(self.path, pretty(state))

    def record(self, plan: SignedPlan) -> None:
        self._record(self.plan_key(plan), plan.predicate["version"], plan.sha256, plan.statement_sha256)

    def record_publication(self, pub) -> None:
        self._record(self.publication_key(pub.signer), pub.version, pub.sha256, pub.statement_sha256)


def read_assembly(path: str | os.PathLike, public_key: Ed25519PublicKey, *, now: dt.datetime | None = None,
                  state: PlanState | None = None, min_version: int | None = None) -> SignedPlan:
    """Verify a plan: signature first, then statement and schema, signer, chain, expiry, version."""
    directory, name = split_path(path)
    where = str(path)
    data = read_regular(directory, name, where)
    payload = dsse.open_envelope(data, public_key, where)
    subjects, plan = parse_statement(payload, where, ASSEMBLY)
    if plan["campaign"]["signer"] != fingerprint(public_key):
        raise FqError(f"{where}: campaign identity names signer {plan['campaign']['signer'][:16]}…, not the pinned key")
    if subjects != plan_subjects(plan):
        raise FqError(f"{where}: statement subjects differ from the plan's fragments and manifest")
    check_chain(plan["chain"], where)
    check_fragments(plan, where)
    check_stage_linears(plan, where)
    now = now or dt.datetime.now(dt.timezone.utc)
    expires = parse_time(plan["expires"], f"{where}: expires")
    if now >= expires:
        raise FqError(f"{where}: plan expired at {plan['expires']} (now {now.strftime(TIME_FORMAT)})")
    if min_version is not None and plan["version"] < min_version:
        raise FqError(f"{where}: plan version {plan['version']} is older than the required minimum {min_version}")
    result = SignedPlan(where, sha256_hex(data), plan, sha256_hex(payload), is_canonical_line(data))
    if state is not None:
        state.check(result)
    return result


PRODUCT_FILE = re.compile(r"(.+)" + re.escape(SUFFIX))


def is_canonical_line(data: bytes) -> bool:
    """Whether an envelope line is byte for byte what fq writes (``dsse.envelope_line``): a re-encoded copy of a
    signed line (other whitespace, key order or escapes) still verifies, but has another sha256."""
    try:
        return dsse.envelope_line(load_bytes(data)) == data
    except (FqError, ValueError):
        return False


def check_product_name(plan: SignedPlan) -> None:
    """The consumer names the product it wants by the plan's file name, ``PRODUCT.assembly.intoto.jsonl``:
    a plan signed for another product (copied over this one's file) is refused, naming what it is."""
    name = Path(plan.path).name
    m = PRODUCT_FILE.fullmatch(name)
    product = plan.predicate["product"]
    if not m:
        raise FqError(f"{plan.path}: file name does not match its product {product!r} (a plan is "
                      f"PRODUCT{SUFFIX}, and the consumer asks for a product by that name)")
    if m[1] != product:
        raise FqError(f"{plan.path}: file name does not match its product {product!r}: the file asks for product "
                      f"{m[1]!r}, the signed plan is product {product!r} (a plan copied under another product's name)")


def campaign_root(plan_path: str | os.PathLike) -> Path:
    """ROOT of ``ROOT/assemblies/X.assembly.intoto.jsonl``; anything else needs an explicit root."""
    p = Path(plan_path)
    if p.parent.name != "assemblies":
        raise FqError(f"{plan_path}: not inside an assemblies/ directory; pass the campaign root explicitly (--root)")
    return p.parent.parent
