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
from fq.allocation.error_model import distortion
from fq.core import kbits
from fq.errors import FqError
from fq.planning.recipe import LINEAR_CLASSES, Recipe, SelectionRule, expert_owners

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


def stage_choice(stage, parent_K, allocation: dict, where: str) -> list[tuple[int, int, float, int]]:
    """The experts a budgeted stage encodes: [(layer, expert, predicted KL saved, bytes)], most saved per byte first,
    while they fit its budget (``stage.bits`` over the allocated weights). An expert's residual at K on a parent at
    Kp leaves d(Kp) * d(K) of its error (a trellis code keeps d(K) of the energy it is given: fq.allocation
    .error_model), so it saves q * d(Kp) * (1 - d(K)) of predicted KL, q its measured quadratic form (gate and up at
    the parent's gate/up K, down at its down K). Every expert of a layer stores the same bytes at K."""
    experts = allocation.get("experts")
    if not experts:
        raise FqError(f"{where}: no per-expert measurement (experts), which a budgeted stage ranks experts by: "
                      "measure it again with this fq (fq allocate, or the campaign's sensitivity job)")
    K, cb = stage.K, stage.codebook
    budget = stage.bits * allocation["weights"] / 8
    cands = []
    for lkey, ex in experts.items():
        layer = int(lkey[1:])
        try:
            per = (allocation["units"][f"{lkey}.routed_gate_up"][str(K)]["bytes"]
                   + allocation["units"][f"{lkey}.routed_down"][str(K)]["bytes"]) / len(ex)
        except KeyError:
            raise FqError(f"{where}: units.{lkey}.routed_*: no option at K{K}, stage {stage.name!r}'s K; measure with "
                          f"K{K} among the candidates") from None
        Kp = kbits.at_layer(parent_K, layer)
        for e, q in ex.items():
            saved = (q["gate_up"] * distortion(kbits.proj(Kp, "gate"), cb)
                     + q["down"] * distortion(kbits.proj(Kp, "down"), cb)) * (1 - distortion(K, cb))
            cands.append((-saved / per, layer, int(e), saved, per))
    chosen, used = [], 0.0
    for _, layer, e, saved, per in sorted(cands):
        if used + per <= budget:
            chosen.append((layer, e, saved, int(round(per))))
            used += per
    return chosen


def _stage_selection(stage, parent_K, allocation: dict | None, source, where: str) -> SelectionRule:
    """A budgeted stage's experts as an explicit per-layer selection (``stage_choice``); without an allocation,
    provisionally the first experts of every layer, as many as the budget would buy over the experts' weights."""
    if allocation is not None:
        chosen = stage_choice(stage, parent_K, allocation, where)
        if not chosen:
            raise FqError(f"{where}: stage {stage.name!r}'s budget +{stage.bits:g} bits buys no expert's residual at "
                          f"K{stage.K}; raise it or drop the stage")
        layers: dict = {}
        for layer, e, _, _ in chosen:
            layers.setdefault(layer, []).append(e)
    else:
        n = max(1, min(source.n_experts, round(source.n_experts * stage.bits / stage.K)))
        layers = {layer: list(range(n)) for layer in source.moe_layers}
    return SelectionRule("layers", layers=tuple((l, tuple(sorted(e))) for l, e in sorted(layers.items())))


def fewest_bits(source, K: int = 1) -> float:
    """The bits of the smallest allocation (every unit at ``K``) over the allocated weights, from the config alone:
    a budget below it cannot be met (fq.allocation.solve refuses it again, from the measured sizes)."""
    from fq.allocation.solve import linear_bytes
    from fq.model.source import PROJECTIONS
    from fq.planning.model_bits import linear_shapes

    n_bytes = n_weights = 0
    for cls, (o, i) in linear_shapes(source).values():
        if cls != "other":
            n_bytes, n_weights = n_bytes + linear_bytes(o, i, K), n_weights + o * i
    for proj in PROJECTIONS:
        o, i = source.expert_shape(proj)
        n = len(source.moe_layers) * source.n_experts
        n_bytes, n_weights = n_bytes + n * linear_bytes(o, i, K), n_weights + n * o * i
    return 8 * n_bytes / n_weights


def resolve_budgets(recipe: Recipe, source, allocation: dict | None, where: str = "allocation") -> Recipe:
    """``recipe`` with each budgeted base resolved against ``allocation`` (an fq-allocation/1 document, checked with
    fq.allocation.document.parse), or provisionally (every unit at the budget's nearest K) when it is None; and each
    budgeted stage's experts chosen (``stage_choice``; provisionally the first of every layer)."""
    if not recipe.needs_allocation:
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
        used = {n.codebook for n in recipe.nodes if n.is_budgeted}
        if used != {allocation["codebook"]}:
            raise FqError(f"{where}: codebook {allocation['codebook']!r} was measured; the budgeted nodes of recipe "
                          f"{recipe.source} use {', '.join(sorted(used))}")
    least = fewest_bits(source) if recipe.budgeted else 0.0
    low = [n for n in recipe.budgeted if n.bits < least]
    if low:
        raise FqError(f"recipe {recipe.source}: base {low[0].name!r} bits {low[0].bits:g}: below the smallest "
                      f"allocation of {source.origin}, every unit at K1 ({least:.3f} bits over its linears)")
    nodes, done = [], {}
    for n in recipe.nodes:  # topological: a stage's parent is resolved first
        if n.is_budgeted and n.is_base:
            if allocation is not None:
                ks = document.allocation_at(allocation, n.bits, where)
            else:
                k = min(8, max(1, round(n.bits)))
                ks = {u: k for u in units}
            n = _resolved(n, ks, units)
        elif n.is_budgeted:
            n = replace(n, experts=_stage_selection(n, done[n.parent].K, allocation, source, where))
        done[n.name] = n
        nodes.append(n)
    owners = expert_owners(nodes)
    nodes = tuple(replace(n, experts_from=owners.get(n.name)) for n in nodes)
    return Recipe(name=recipe.name, description=recipe.description, nodes=nodes, products=recipe.products,
                  sha256=recipe.sha256, source=recipe.source)


def resolve_args(recipe: Recipe, source, path: str | None):
    """(recipe resolved, the allocation document or None) for a command's ``--allocation FILE``: checked against the
    source; without a file a budgeted base is resolved provisionally (``resolve_budgets``)."""
    if path is None or not recipe.needs_allocation:
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
    """The per-layer picture of every resolved budgeted base (K per unit, one row per layer) and of the experts each
    budgeted stage on it chose."""
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
            return str(v) if kbits.is_one(v) else str(dict(v).get(layer, "-"))

        stages = [s for s in recipe.budgeted_stages if s.parent == n.name and s.experts.mode == "layers"]
        head = f"  {'layer':>5} {'attention':>9} {'dense':>5} {'shared':>6} {'gate/up':>7} {'down':>4}"
        head += "".join(f"  {s.name + ' (K' + str(s.K) + ' on experts)':<28}" for s in stages)
        lines += [f"budgeted base {n.name}: {n.bits:g} bits; K per unit", head.rstrip()]
        for layer in layers:
            moe = layer in source.moe_layers
            spec = n.K_at(layer) if moe else None
            row = (f"  {layer:>5} {k_of('attention', layer):>9} {k_of('dense', layer):>5} {k_of('shared', layer):>6} "
                   f"{kbits.proj(spec, 'gate') if moe else '-':>7} {kbits.proj(spec, 'down') if moe else '-':>4}")
            for s in stages:
                chosen = s.experts.layer_map().get(layer, ())
                row += f"  {(', '.join(map(str, chosen)) or '-') if moe else '':<28}"
            lines.append(row.rstrip())
        if "head" in skel:
            lines.append(f"  {'head':>5} K{k_of('head', None)}")
        for s in stages:
            count = sum(len(e) for _, e in s.experts.layers)
            lines.append(f"  stage {s.name}: +{s.bits:g} bits buy a K{s.K} residual on {count} of "
                         f"{len(source.moe_layers) * source.n_experts} experts (most predicted KL saved per byte)")
    return "\n".join(lines)
