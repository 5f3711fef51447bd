"""The campaign identity: what one run is, carried inside every attestation and every plan.

    {"name", "source": {"repo", "revision"}, "block_size",
     "signer": <key fingerprint>, "encoder": <encoder identity digest>}

The recipe is deliberately not part of it: changing one node of the recipe must leave every fragment
of the untouched nodes valid. What a fragment was encoded for is its own ``node_digest`` (the recipe's
digest of that node and its ancestors, ``fq.planning.recipe.Recipe.node_digest``), which a plan's chain pins
per node; the plan also records the whole recipe's ``recipe_sha256``.

Its digest (``campaign_digest``) is the sha256 of its canonical JSON. A consumer requires the same
identity in every fragment it uses and the signer to be the key it pinned.
"""
from __future__ import annotations

from fq.core.canonical import dumps, sha256_hex
from fq.errors import FqError


def campaign_identity(*, name: str, source_repo: str, source_revision: str, block_size: int, signer: str,
                      encoder: str) -> dict:
    ident = {"name": name, "source": {"repo": source_repo, "revision": source_revision},
             "block_size": block_size, "signer": signer, "encoder": encoder}
    # Same schema the signed documents are checked against, so a bad identity fails here, not at verify.
    from fq.provenance.attest.statement import _validator
    errors = list(_validator("fq-common.schema.json").evolve(
        schema={"$ref": "https://fq.dev/schemas/fq-common.schema.json#/$defs/campaign"}).iter_errors(ident))
    if errors:
        e = errors[0]
        field = ".".join(str(p) for p in e.absolute_path) or "campaign"
        raise FqError(f"campaign identity: {field}: {e.message}")
    return ident


def campaign_digest(ident: dict) -> str:
    return sha256_hex(dumps(ident))


def require_same(ident: dict, expected: dict, where: str) -> None:
    """Refuse a document from another campaign, naming the first field that differs."""
    if ident == expected:
        return
    for k in sorted(set(ident) | set(expected)):
        if ident.get(k) != expected.get(k):
            raise FqError(f"{where}: campaign identity differs in {k!r} ({ident.get(k)!r} vs expected "
                          f"{expected.get(k)!r}); it belongs to another campaign")
