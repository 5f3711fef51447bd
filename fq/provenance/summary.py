"""The campaign summary (``campaign_summary.json``): unsigned, but every value it states is bound to the
signed documents of the tree it describes.

finalize writes it beside ``published/``; promotion ships it at the root of the published tree (a local
generation, a Hub repository), where ``fq verify`` would otherwise have to call it an unaccounted file.
It is a view of the signed publication statement (``fq.provenance.publication``): ``summary_view(predicate)`` is what
finalize writes, and ``check_summary_publication`` requires the file to be exactly that, field by field
(recipe name, bpw and plan identity included). Without a verified publication statement (it is missing or
refused, which is its own problem) ``check_summary`` still binds what the verified plans state: the campaign
identity, every product's plan file and its sha256, the chain, the payload bytes, the recipe digest and each
base's manifest digest, and the products must be exactly the plans in ``assemblies/``.
"""
from __future__ import annotations

from fq.core import canonical
from fq.provenance.assembly import SUFFIX, SignedPlan, payload_bytes

SUMMARY_NAME = "campaign_summary.json"
FORMAT = "fq-campaign-summary/1"


SUMMARY_FIELDS = ("file", "sha256", "chain", "bpw", "bytes")  # of a product, as the summary states them


def summary_view(pred: dict) -> dict:
    """The campaign summary a publication statement's predicate implies."""
    return {"format": FORMAT, "campaign": pred["campaign"], "recipe": pred["recipe"],
            "plan_identity_sha256": pred["plan_identity_sha256"],
            "bases": {b: {"manifest_sha256": e["manifest_sha256"]} for b, e in pred["bases"].items()},
            "products": {p: {k: e[k] for k in SUMMARY_FIELDS} for p, e in pred["products"].items()}}


def _differences(got, want, path: str) -> list[tuple[str, object, object]]:
    """(path, got, want) of every leaf where two JSON values differ; objects are compared key by key."""
    if isinstance(got, dict) and isinstance(want, dict):
        out = []
        for k in sorted(set(got) | set(want)):
            sub = f"{path}.{k}" if path else k
            if k not in want:
                out.append((sub, got[k], None))
            elif k not in got:
                out.append((sub, None, want[k]))
            else:
                out += _differences(got[k], want[k], sub)
        return out
    if got != want or type(got) is not type(want):
        return [(path or "(document)", got, want)]
    return []


def check_summary_publication(data: bytes, where: str, publication: dict, signed_by: str) -> list[str]:
    """Problems of a summary against a verified publication statement's predicate: it must state exactly
    what ``summary_view`` derives from it; one line per differing field. ``signed_by``: the statement's
    file, named in the messages."""
    doc, problem = _parse(data, where)
    if problem:
        return [problem]
    out = []
    for path, got, want in _differences(doc, summary_view(publication), ""):
        if want is None:
            out.append(f"{where}: {path} is not in the signed publication ({signed_by})")
        elif got is None:
            out.append(f"{where}: {path} is missing; the signed publication ({signed_by}) says {_short(want)}")
        else:
            out.append(f"{where}: {path} is {_short(got)}, the signed publication ({signed_by}) says {_short(want)}")
    return out


def _parse(data: bytes, where: str) -> tuple[dict | None, str | None]:
    """The summary document, or the one problem that stops its checks."""
    try:
        doc = canonical.loads(data, where)
    except ValueError as e:
        return None, str(e)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None, f"{where}: not an {FORMAT} document"
    return doc, None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _plan_name(product: str) -> str:
    return f"assemblies/{product}{SUFFIX}"


def check_summary(data: bytes, where: str, plans: dict[str, SignedPlan], campaign: dict | None,
                  unverified: set[str] = frozenset()) -> list[str]:
    """Problems of a summary against ``plans`` (tree-relative plan name -> verified Plan) and the tree's
    campaign identity; one line each. ``unverified``: plan files present but refused (already reported
    as their own problems, so not again here)."""
    doc, problem = _parse(data, where)
    if problem:
        return [problem]
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
                "bytes": payload_bytes(p)}
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
