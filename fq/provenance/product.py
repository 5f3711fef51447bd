"""One product opened for a consumer: the one set of plan checks that ``fq verify``, ``fq combine``,
``fq mesh-plan`` and ``fq tp-export`` share, so that they cannot disagree about a plan.

``open_product(plan_path, key)`` checks, in this order (nothing is read before what vouches for it):

1. the plan (``fq.provenance.assembly.read_assembly``): signature under the pinned key, statement, schema, signer,
   chain, fragment edges, expiry, ``--min-version``;
2. its file name: the consumer asks for a product by ``PRODUCT.assembly.intoto.jsonl``, and a plan signed
   for another product (copied over this one) is refused, naming the product it is;
3. the version state (``fq.provenance.assembly.PlanState``, keyed by signer and product: a rollback across campaigns);
4. the publication statement, when ``ROOT/publication.intoto.jsonl`` is present (``fq.provenance.publication``):
   signature, signer, the plan's campaign, the plan must be the one it lists for the product (sha256), and
   its version passes the state too. Absent, the plan stands on its own signature: a consumer of one plan
   reads nothing the plan does not vouch for, and withheld *other* products are ``fq verify``'s concern.

Then, per fragment a consumer uses, ``VerifiedProduct.check_fragment`` (its attestation against the plan entry and
the chain node: digests, node, layer, block, parent, experts, size, header digest, node digest, role, K,
codebook; and one objective per layer: every fragment of a layer names the same Hessian, or none) and
``VerifiedProduct.check_header`` (the shard's header against the attestation, its size against the plan). What each
attestation's ``quant_args`` says agrees with the rest of it already (``attest.fragment.check_quant_args``, run
on every attestation read).

    open_product(plan_path, public_key, *, root=None, now=None, state=None, min_version=None,
                 publication=BESIDE) -> VerifiedProduct
"""
from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fq.core import kbits
from fq.errors import FqError
from fq.provenance.assembly import SignedPlan, PlanState, campaign_root, check_product_name, read_assembly
from fq.provenance.attest.fragment import Attested, check_header, check_node_digest
from fq.provenance.publication import NAME as PUBLICATION_NAME, Statement, read_publication

BESIDE = "beside"  # read ROOT/publication.intoto.jsonl when it is there


@dataclass
class VerifiedProduct:
    plan: SignedPlan
    root: Path
    publication: Statement | None
    objectives: dict = field(default_factory=dict)  # layer -> (objective, first fragment checked): one per layer

    @property
    def predicate(self) -> dict:
        return self.plan.predicate

    def node(self, name: str) -> dict:
        return next(n for n in self.predicate["chain"] if n["node"] == name)

    def check_fragment(self, att: Attested, f: dict, where: str, plan_where: str | None = None) -> None:
        """A fragment's verified attestation against its plan entry ``f`` and its chain node. ``where`` prefixes
        the messages; ``plan_where`` (default ``where``) the node-digest one, which names the fragment itself."""
        p = att.predicate
        if att.attestation_sha256 != f["attestation_sha256"]:
            raise FqError(f"{where}: attestation is not the one the plan names (its sha256 is "
                          f"{att.attestation_sha256[:16]}…, the plan names {f['attestation_sha256'][:16]}…)")
        if att.sha256 != f["sha256"]:
            raise FqError(f"{where}: the attestation signs shard bytes of sha256 {att.sha256[:16]}…, the plan names "
                          f"{f['sha256'][:16]}…")
        if p["kind"] != "expert":
            raise FqError(f"{where}: a {p['kind']} shard, the plan names an expert fragment")
        for k in ("node", "layer", "block", "parent", "experts"):
            if p[k] != f[k]:
                raise FqError(f"{where}: attestation and plan disagree on {k}")
        _check_shard(p, f, where)
        node = self.node(f["node"])
        check_node_digest(att, node["digest"], plan_where or where)
        got_K = kbits.fragment(p["K"], f"{where}: attested K")
        want_K = kbits.node_at(node["K"], p["layer"], f"{where}: the plan's chain node {node['node']} K")
        if (p["role"], got_K, p["codebook"]) != (node["role"], want_K, node["codebook"]):
            raise FqError(f"{where}: attested {p['role']} {k_text(got_K)} {p['codebook']}, the plan's chain "
                          f"says {node['role']} {k_text(want_K)} {node['codebook']}"
                          + (f" at layer {p['layer']}" if not kbits.is_one(kbits.node(node["K"])) else ""))
        got = objective(p)
        first = self.objectives.setdefault(p["layer"], (got, att.name))
        if first[0] != got:
            raise FqError(f"{where}: encoded against {got}, but {first[1]} of the same layer {p['layer']} against "
                          f"{first[0]}; a campaign binds one Hessian per layer")

    def check_linear(self, att: Attested, f: dict, where: str) -> None:
        """A whole-model base's linear fragment (verified attestation) against its plan entry ``f``: the same
        attestation and bytes, kind, linear node digest, class, layer, K and codebook."""
        check_linear_entry(att, f, where)

    def check_stage_linear(self, att: Attested, f: dict, where: str) -> None:
        """A stage's residual on non-expert linears (verified attestation) against its plan entry ``f``: the same
        attestation and bytes, kind linear, role stage, the linear node digest, class, layer, K, codebook, its
        parent edge, and the shard's size and header digest."""
        p = att.predicate
        _check_same_bytes(att, f, where)
        if p["kind"] != "linear" or p["role"] != "stage":
            raise FqError(f"{where}: a {p['kind']} {p['role']} shard, the plan names a stage's linear fragment")
        _check_linear_fields(p, f, where, LINEAR_FIELDS + (("parent", "parent"),))
        _check_shard(p, f, where)

    def check_header(self, att: Attested, header, f: dict, where: str) -> None:
        """The shard's safetensors header as read: the attested one, and the size the plan names."""
        check_header(att, header, where)
        if header.file_size != f["size"]:
            raise FqError(f"{where}: {header.file_size} bytes, the plan says {f['size']}")

    def refuse_stage_linears(self, consumer: str) -> None:
        """For a consumer that carries routed-expert stages only: refuse a product whose stages also correct
        non-expert linears (plan ``stage_linears``), rather than silently drop those residuals."""
        n = len(self.predicate.get("stage_linears", ()))
        if n:
            stages = sorted({f["stage"] for f in self.predicate["stage_linears"]})
            raise FqError(f"{self.plan.path}: product {self.predicate['product']}'s stage(s) {', '.join(stages)} also "
                          f"correct non-expert linears ({n} linear residual fragment(s), plan stage_linears); "
                          f"{consumer} carries routed-expert stages only. Load the product from its published tree "
                          f"with fq's CPU runtime (fq.runtime.load.load_product, fq eval) instead")

    def record(self, state: PlanState | None) -> None:
        if state is not None:
            state.record(self.plan)
            if self.publication is not None:
                state.record_publication(self.publication)


def k_text(spec) -> str:
    """A fragment spec in messages: ``K=3``, or per projection ``gate/up K2, down K3``."""
    return f"K={spec}" if kbits.is_one(spec) else kbits.describe(spec)


# (plan entry field, attested predicate field) of a linear fragment
LINEAR_FIELDS = (("node", "node"), ("class", "class"), ("layer", "layer"), ("K", "K"), ("codebook", "codebook"),
                 ("digest", "node_digest"))


def check_linear_entry(att, f: dict, where: str) -> None:
    """A base's linear fragment (``att``: its attestation's sha256, its shard's and its predicate) against the plan
    entry ``f``: the same attestation and bytes, kind, linear node digest, class, layer, K and codebook."""
    p = att.predicate
    _check_same_bytes(att, f, where)
    if p["kind"] != "linear":
        raise FqError(f"{where}: a {p['kind']} shard, the plan names a linear fragment")
    _check_linear_fields(p, f, where, LINEAR_FIELDS)


def _check_same_bytes(att: Attested, f: dict, where: str) -> None:
    """The attestation file and the shard it signs are the ones the plan entry names; the message says which of
    the two differs, with the digest each document states."""
    if att.attestation_sha256 != f["attestation_sha256"]:
        raise FqError(f"{where}: its attestation file is not the one the plan names (the file's sha256 is "
                      f"{att.attestation_sha256[:16]}…, the plan names {f['attestation_sha256'][:16]}…)")
    if att.sha256 != f["sha256"]:
        raise FqError(f"{where}: the attestation signs shard bytes of sha256 {att.sha256[:16]}…, the plan names "
                      f"{f['sha256'][:16]}…")


def _check_linear_fields(p: dict, f: dict, where: str, fields) -> None:
    for k, pk in fields:
        if p[pk] != f[k]:
            raise FqError(f"{where}: attestation and plan disagree on {k} ({p[pk]!r} attested, {f[k]!r} in the plan)")


def _check_shard(p: dict, f: dict, where: str) -> None:
    """The attested shard's size and header digest against the plan entry's."""
    for k in ("size", "header_sha256"):
        if p["shard"][k] != f[k]:
            raise FqError(f"{where}: attestation and plan disagree on the shard's {k} "
                          f"({p['shard'][k]!r} attested, {f[k]!r} in the plan)")


def objective(pred: dict) -> str:
    """What an expert fragment was encoded against, in words: its Hessian's sha256, or weight-only
    (``fq.provenance.attest.fragment.check_quant_args`` has checked the two agree with the objective)."""
    h = pred["quant_args"].get("hessian")
    return "weight-only" if h is None else f"Hessian {h['sha256']}"


def open_product(plan_path: str | os.PathLike, public_key: Ed25519PublicKey, *, root: str | os.PathLike | None = None,
                 now: dt.datetime | None = None, state: PlanState | None = None, min_version: int | None = None,
                 publication: str | Statement | None = BESIDE) -> VerifiedProduct:
    """``publication``: ``BESIDE`` (the statement at ROOT when present), a verified ``Statement`` (``fq verify``
    of a tree, which reads it once), or None (not consulted)."""
    plan = read_assembly(plan_path, public_key, now=now, min_version=min_version)
    check_product_name(plan)
    if state is not None:
        state.check(plan)
    root = Path(root) if root is not None else campaign_root(plan_path)
    stmt = None
    if publication == BESIDE:
        if os.path.lexists(root / PUBLICATION_NAME):
            # read on its own terms: a plan of another campaign is the plan's problem, not the genuine statement's
            stmt = read_publication(root, public_key)
            if state is not None:
                state.check_publication(stmt)
    elif isinstance(publication, Statement):
        stmt = publication
    if stmt is not None:
        stmt.require_plan(plan)
    return VerifiedProduct(plan, root, stmt)
