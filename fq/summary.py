"""The campaign summary (``campaign_summary.json``): unsigned, but every checkable value it states is
bound to the signed documents of the tree it describes.

finalize writes it beside ``published/``; promotion ships it at the root of the published tree (a local
generation, a Hub repository), where ``fq verify`` would otherwise have to call it an unaccounted file.
``check_summary`` accounts for it: the campaign identity, every product's plan file and its sha256, the
chain, the payload bytes, the recipe digest and each base's manifest digest must be what the verified
plans say, and the products must be exactly the plans in ``assemblies/``. Only the informational fields
(recipe name, bpw, plan identity) are taken as written.
"""
from __future__ import annotations

from fq import canonical
from fq.assembly import SUFFIX, Plan

SUMMARY_NAME = "campaign_summary.json"
FORMAT = "fq-campaign-summary/1"


def _plan_name(product: str) -> str:
    return f"assemblies/{product}{SUFFIX}"


def check_summary(data: bytes, where: str, plans: dict[str, Plan], campaign: dict | None,
                  unverified: set[str] = frozenset()) -> list[str]:
    """Problems of a summary against ``plans`` (tree-relative plan name -> verified Plan) and the tree's
    campaign identity; one line each. ``unverified``: plan files present but refused (already reported
    as their own problems, so not again here)."""
    try:
        doc = canonical.loads(data, where)
    except ValueError as e:
        return [str(e)]
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return [f"{where}: not an {FORMAT} document"]
    problems = []
    if campaign is not None and doc.get("campaign") != campaign:
        problems.append(f"{where}: campaign identity is not the one the tree's signed documents carry")
    products = doc.get("products")
    if not isinstance(products, dict):
        return problems + [f"{where}: products must be an object"]
    listed = {_plan_name(p) for p in products}
    for name in sorted((set(plans) | set(unverified)) - listed):
        problems.append(f"{where}: plan {name} is not listed among the products")
    bases = doc.get("bases") if isinstance(doc.get("bases"), dict) else {}
    recipe = doc.get("recipe") if isinstance(doc.get("recipe"), dict) else {}
    for product, entry in sorted(products.items()):
        name = _plan_name(product)
        plan = plans.get(name)
        if name in unverified:
            continue
        if plan is None:
            problems.append(f"{where}: product {product!r} has no verified plan {name} in the tree")
            continue
        p = plan.predicate
        want = {"file": name, "sha256": plan.sha256, "chain": [n["node"] for n in p["chain"]],
                "bytes": sum(f["size"] for f in p["fragments"])}
        got = {k: entry.get(k) for k in want} if isinstance(entry, dict) else {}
        for k in want:
            if got.get(k) != want[k]:
                problems.append(f"{where}: products.{product}.{k} is {got.get(k)!r}, the signed plan says {want[k]!r}")
        if recipe.get("sha256") != p["recipe_sha256"]:
            problems.append(f"{where}: recipe.sha256 is not the recipe digest plan {name} names")
        base = p["base"]["node"]
        entry_base = bases.get(base)
        if not isinstance(entry_base, dict) or entry_base.get("manifest_sha256") != p["base"]["manifest"]["sha256"]:
            problems.append(f"{where}: bases.{base}.manifest_sha256 is not the manifest plan {name} pins")
    return problems
