"""Budgeted bases resolved: a recipe base with ``bits`` gets its K per unit from a measured allocation.

A budgeted base quantizes every routed expert and every non-expert class the source has (attention, shared experts,
dense MLP, the head), each allocation unit (fq.allocation.units) at the K the allocation (fq-allocation/1) solved at
the base's budget: routed experts per layer as a fq.core.kbits spec (gate and up at the ``routed_gate_up`` unit's K,
down at ``routed_down``'s), each class per layer in its ``skeleton`` (an int where every layer has one K).

``resolve_budgets`` is pure: the recipe, the source's metadata and the allocation document in, a recipe whose
budgeted bases are resolved out. Without an allocation (the campaign has not measured it yet) ``provisional``
resolves every unit at the budget's nearest K: a plan of the right shape for pricing and for the DAG's measurement
phase, never encoded (the campaign's targets are then the allocation alone).
"""
from __future__ import annotations

from dataclasses import replace

from fq.allocation import document
from fq.core import kbits
from fq.errors import FqError
from fq.planning.recipe import LINEAR_CLASSES, Recipe, expert_owners

# allocation unit kind -> recipe linear class (the routed units are the experts')
UNIT_CLASS = {"attention": "attention", "shared": "shared", "dense": "dense", "head": "head"}


def _unit(cls: str, layer: int | None) -> str:
    return "head" if cls == "head" else f"L{layer}.{cls}"


def source_units(source) -> dict[str, tuple[str, int | None]]:
    """unit -> (class or "routed_gate_up"/"routed_down", layer) of every allocation unit the source has."""
    from fq.model.linears import source_linears

    out = {}
    for cls, layers in source_linears(source).items():
        for layer in layers:
            out[_unit(cls, layer)] = (cls, layer)
    for layer in source.moe_layers:
        out[f"L{layer}.routed_gate_up"] = ("routed_gate_up", layer)
        out[f"L{layer}.routed_down"] = ("routed_down", layer)
    return out


def _resolved(node, ks: dict, units: dict):
    experts = kbits.node({layer: {"gate": ks[f"L{layer}.routed_gate_up"], "up": ks[f"L{layer}.routed_gate_up"],
                                  "down": ks[f"L{layer}.routed_down"]}
                          for (kind, layer) in units.values() if kind == "routed_gate_up"})
    skeleton = []
    for cls in LINEAR_CLASSES:
        per_layer = tuple((layer, ks[u]) for u, (kind, layer) in sorted(
            units.items(), key=lambda kv: -1 if kv[1][1] is None else kv[1][1]) if kind == cls)
        if per_layer:
            Ks = {k for _, k in per_layer}
            skeleton.append((cls, next(iter(Ks)) if len(Ks) == 1 else per_layer))
    return replace(node, K=experts, skeleton=tuple(skeleton))


def resolve_budgets(recipe: Recipe, source, allocation: dict | None, where: str = "allocation") -> Recipe:
    """``recipe`` with each budgeted base resolved against ``allocation`` (an fq-allocation/1 document, checked with
    fq.allocation.document.parse), or provisionally (every unit at the budget's nearest K) when it is None."""
    if not recipe.budgeted:
        return recipe
    units = source_units(source)
    if allocation is not None:
        have = set(allocation["units"])
        missing, extra = sorted(set(units) - have), sorted(have - set(units))
        if missing or extra:
            raise FqError(f"{where}: its units are not the source's allocation units"
                          + (f"; missing {', '.join(missing[:8])}" if missing else "")
                          + (f"; not in the source {', '.join(extra[:8])}" if extra else "")
                          + ": measure it on this source (fq allocate, or the campaign's sensitivity job)")
        if allocation["codebook"] != recipe.budgeted[0].codebook or len({n.codebook for n in recipe.budgeted}) > 1:
            raise FqError(f"{where}: codebook {allocation['codebook']!r} was measured; the budgeted bases of recipe "
                          f"{recipe.source} use {', '.join(sorted({n.codebook for n in recipe.budgeted}))}")
    nodes = []
    for n in recipe.nodes:
        if n.is_budgeted:
            if allocation is not None:
                ks = document.allocation_at(allocation, n.bits, where)
            else:
                k = min(8, max(1, round(n.bits)))
                ks = {u: k for u in units}
            n = _resolved(n, ks, units)
        nodes.append(n)
    owners = expert_owners(nodes)
    nodes = tuple(replace(n, experts_from=owners.get(n.name)) for n in nodes)
    return Recipe(name=recipe.name, description=recipe.description, nodes=nodes, products=recipe.products,
                  sha256=recipe.sha256, source=recipe.source)


def resolve_args(recipe: Recipe, source, path: str | None):
    """(recipe resolved, the allocation document or None) for a command's ``--allocation FILE``: checked against the
    source; without a file a budgeted base is resolved provisionally (``resolve_budgets``)."""
    if path is None or not recipe.budgeted:
        return resolve_budgets(recipe, source, None), None
    doc = document.load(path)
    check_source(doc, source, str(path))
    return resolve_budgets(recipe, source, doc, f"--allocation {path}"), doc


def check_source(doc: dict, source, where: str) -> None:
    """Refuse an allocation measured on another model than ``source`` (its config.json's sha256)."""
    if doc["model"].get("config_sha256") != source.config_sha256:
        raise FqError(f"{where}: model.config_sha256 {str(doc['model'].get('config_sha256'))[:16]}… is not the "
                      f"source's config.json ({source.config_sha256[:16]}…): the allocation was measured on another "
                      "model")


def allocation_table(recipe: Recipe, source) -> str:
    """The per-layer picture of every resolved budgeted base: one row per layer, K per unit."""
    lines = []
    units = source_units(source)
    layers = sorted({layer for _, layer in units.values() if layer is not None})
    for n in recipe.budgeted:
        if n.K is None:
            continue
        skel = dict(n.skeleton)

        def k_of(cls, layer):
            v = skel.get(cls)
            if v is None:
                return "-"
            if isinstance(v, int):
                return str(v)
            return str(dict(v).get(layer, "-"))

        lines += [f"budgeted base {n.name}: {n.bits:g} bits; K per unit (experts: gate/up, down)",
                  f"  {'layer':>5} {'attention':>9} {'dense':>5} {'shared':>6} {'experts':>9}  {'':<24}"]
        for layer in layers:
            if layer in source.moe_layers:
                spec = n.K_at(layer)
                gu, d = kbits.proj(spec, "gate"), kbits.proj(spec, "down")
                ex = f"{gu}/{d}"
            else:
                gu = d = 0
                ex = "-"
            bar = "#" * gu + "+" * d
            lines.append(f"  {layer:>5} {k_of('attention', layer):>9} {k_of('dense', layer):>5} "
                         f"{k_of('shared', layer):>6} {ex:>9}  {bar}")
        if "head" in skel:
            lines.append(f"  {'head':>5} K{k_of('head', None)}")
    return "\n".join(lines)
