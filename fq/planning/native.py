"""A chain product's native comparison, like with like: the one rule ``fq eval``, the report and the campaign's
native jobs share.

A product of more than one node at B bits (its chain's K summed) is compared with the published single-node product
(a base) that differs from it in its routed experts' encoding alone:

- its K is B and its codebook the chain's base's;
- the chain's last node covers every routed expert (a hot stage has B bits on its experts only);
- the same linear nodes on every non-expert class, by digest (``LinearNode.digest``: class, K, codebook and the
  nodes a residual corrects), a class kept as published on both sides counting as the same. Equal bits per class
  are not enough (a K2 residual on K4 attention is 6 bits, as a base's K6 attention, but other weights): a chain
  whose stage corrects linears has no base's like.

Several (alike but for their names): the alphabetically first. None: the one-pass K=B encode of the last node's
experts in the product's own verified state (``fq.runtime.evaluate.native_tensors``: every linear the product's,
residuals included), like with like by construction; it exists with ``compare_native`` and B <= 8.

    native_bases(likes) -> {product: base product}                 # each chain that has one
    recipe_likes(recipe, selections) -> {product: (nodes, Like)}   # from a recipe and Plan.selections
    plan_likes(plans) -> {product: (nodes, Like)}                  # from signed product plans (fq eval)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from fq.core import kbits


@dataclass(frozen=True)
class Like:
    bits: int | str  # K summed over the chain (a chain with a budgeted base's per-unit K: their JSON, its own like)
    codebook: str  # the chain's base's
    linears: frozenset  # digests of every linear node whose reconstruction the product sums (empty: experts-only)
    whole: bool  # its last node covers every routed expert (a base's always does)


def native_bases(likes: Mapping[str, tuple[int, Like]]) -> dict[str, str]:
    """product -> the single-node product it is compared with, for each product of more than one node that has one
    (``likes``: product -> (chain length, Like))."""
    bases = sorted(name for name, (nodes, _) in likes.items() if nodes == 1)
    out = {}
    for name, (nodes, like) in sorted(likes.items()):
        match = next((b for b in bases if likes[b][1] == like), None) if nodes > 1 else None
        if match is not None:
            out[name] = match
    return out


def recipe_likes(recipe, selections: Mapping) -> dict[str, tuple[int, Like]]:
    """Every product of ``recipe`` (``fq.planning.recipe.Recipe``); ``selections``: node -> the plan's resolved
    selection (``CampaignPlan.selections``: None where the node covers every expert of every MoE layer)."""
    out = {}
    for prod in recipe.products:
        nodes = [recipe.node(n) for n in prod.chain]
        linears = frozenset(ln.digest for n in prod.chain for _, ln, _ in recipe.linear_assignments(n))
        out[prod.name] = (len(nodes), Like(_bits([n.to_json()["K"] for n in nodes]), nodes[0].codebook, linears,
                                           selections[prod.chain[-1]] is None))
    return out


def plan_likes(plans: Mapping[str, Mapping]) -> dict[str, tuple[int, Like]]:
    """The same from signed product plans (product -> plan predicate: ``chain``, ``fragments``, ``linears``,
    ``stage_linears``, as ``fq.provenance.assembly.build_assembly`` writes them)."""
    out = {}
    for name, plan in plans.items():
        chain = plan["chain"]
        covered: dict = {}
        for f in plan["fragments"]:
            covered.setdefault(f["node"], set()).update((f["layer"], e["expert"]) for e in f["experts"])
        linears = frozenset(f["digest"] for f in (*plan.get("linears", ()), *plan.get("stage_linears", ())))
        whole = covered.get(chain[-1]["node"], set()) == covered.get(chain[0]["node"])
        out[name] = (len(chain), Like(_bits([n["K"] for n in chain]), chain[0]["codebook"], linears, whole))
    return out


def _bits(Ks: list):
    """K summed over a chain, or where a node's K is per unit (fq.core.kbits) the chain's K as JSON."""
    if all(kbits.is_one(k) for k in Ks):
        return sum(Ks)
    return json.dumps(Ks, sort_keys=True)
