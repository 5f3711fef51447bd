"""Campaign planning: blocks, windows, staging and retirement, peak disk, and the run identity.

``make_plan`` is pure: it takes a Recipe, a SourceModel and (for hot stages) ExpertUsage, and
returns a CampaignPlan; no file is read and no GPU touched. ``write_plan``/``load_plan`` move a plan to
and from disk (canonical JSON, atomic write, digest checked on load).

Disk model (W = windows_on_disk): window w's shards are fetched once window w-W has retired, so
while window w encodes, the shards of windows w-W+1..w are on disk. A shard is staged with the
first window that uses it and deleted when the last one retires: a shard straddling a window
boundary is kept, never fetched twice. Shards that hold no routed expert (embeddings, lm_head,
dense layers) are staged with window 0: no layer names them, yet every base needs their tensors.
Encoded fragments and skeleton copies stay local until finalize, so peak local bytes are the
source on disk plus everything written so far.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from fq.core import canonical, kbits
from fq.core.atomic import write_bytes
from fq.core.layer_ranges import check_partition, format_layers, parse_ranges
from fq.core.units import fmt_bytes
from fq.errors import FqError
from fq.model import families
from fq.model.source import PROJECTIONS, SourceModel
from fq.planning.recipe import Recipe, resolve_selections

PLAN_FORMAT = "fq-plan/1"
IDENTITY_FORMAT = "fq-run-identity/1"
DEFAULT_BLOCK_SIZE = 32
DEFAULT_WINDOWS_ON_DISK = 2


@dataclass(frozen=True)
class Block:
    """The unit of work and of commit: ``count`` consecutive experts of one layer."""

    layer: int
    first_expert: int
    count: int
    window: int
    shards: tuple[str, ...]  # source shards holding any tensor of these experts

    @property
    def name(self) -> str:
        return f"L{self.layer}-E{self.first_expert}"

    @property
    def experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.count)


@dataclass(frozen=True)
class Fragment:
    """One node's encoding of one block (only the experts its selection holds)."""

    node: str
    block: Block
    experts: tuple[int, ...]


@dataclass(frozen=True)
class Window:
    index: int
    layers: tuple[int, ...]
    stage: tuple[str, ...]  # fetched for this window (first use)
    keep: tuple[str, ...]  # fetched by an earlier window and still on disk here (straddlers)
    skeleton_only: tuple[str, ...]  # among ``stage``: shards holding no routed expert
    retire: tuple[str, ...]  # deleted when this window retires (last use)
    stage_bytes: int
    source_bytes: int  # source on disk while this window encodes (W windows' shards)
    output_bytes: int  # fragments + skeleton copies this window writes
    local_bytes: int  # source on disk + everything written up to and including this window


@dataclass(frozen=True, eq=False)
class CampaignPlan:
    identity: Mapping  # recipe sha256, source revision, block size, window partition, usage digest
    identity_sha256: str
    recipe: Mapping  # name, sha256, passes, encoded/nominal bpw, products
    source: Mapping  # SourceModel.summary() without the machine-specific origin
    block_size: int
    windows_on_disk: int
    nodes: tuple[Mapping, ...]  # topological: name, kind, parent, K, codebook, experts, digest
    products: tuple[Mapping, ...]  # name, chain, bpw
    selections: Mapping[str, Mapping[int, tuple[int, ...]] | None]  # None: all experts of every layer
    blocks: tuple[Block, ...]
    windows: tuple[Window, ...]
    straddling: Mapping[str, tuple[int, int]]  # shard -> (first window, last window)
    skeleton_only_shards: tuple[str, ...]
    bytes: Mapping[str, int]  # source_total, skeleton, outputs_total, peak_source, peak_local
    # whole-model bases: every linear node (one class at K bits, one codebook) with the layers it encodes and the
    # linears of each ({"name", "class", "K", "codebook", "digest", "layers": {"L"|"head": [tensor prefix, ...]}};
    # a stage's residual on a class also "parent" and "parent_digest": the linear node it corrects); a base's or
    # stage's node entry names the linear node of each class it encodes ("skeleton": {class: linear node})
    linears: tuple[Mapping, ...] = ()

    def linear_jobs(self) -> tuple[tuple[str, int | None], ...]:
        """(linear node, layer) of every linear fragment (layer None: the head), nodes in plan order."""
        return tuple((n["name"], None if l == "head" else int(l)) for n in self.linears for l in n["layers"])

    def linear(self, name: str) -> Mapping:
        for n in self.linears:
            if n["name"] == name:
                return n
        raise FqError(f"plan: no linear node {name!r} (linear nodes: {', '.join(n['name'] for n in self.linears) or 'none'})")

    def experts_from(self, node: str) -> str | None:
        """The base whose expert encoding base ``node`` publishes (recipe ``Node.experts_from``), or None."""
        return next(n for n in self.nodes if n["name"] == node).get("experts_from")

    def experts_of(self, node: str, layer: int) -> tuple[int, ...]:
        sel = self.selections[node]
        if sel is None:
            return tuple(range(self.source["n_experts"]))
        return sel.get(layer, ())

    def fragments(self) -> tuple[Fragment, ...]:
        """Every (node, block) with at least one selected expert, nodes in topological order."""
        out = []
        for node in self.nodes:
            for block in self.blocks:
                mine = self.experts_of(node["name"], block.layer)
                experts = tuple(e for e in mine if block.first_expert <= e < block.first_expert + block.count)
                if experts:
                    out.append(Fragment(node["name"], block, experts))
        return tuple(out)

    def window_of(self, layer: int) -> int:
        for w in self.windows:
            if layer in w.layers:
                return w.index
        raise FqError(f"plan: layer {layer} is in no window (windows cover {format_layers(l for w in self.windows for l in w.layers)})")

    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "identity": dict(self.identity),
            "identity_sha256": self.identity_sha256,
            "recipe": dict(self.recipe),
            "source": dict(self.source),
            "block_size": self.block_size,
            "windows_on_disk": self.windows_on_disk,
            "nodes": [dict(n) for n in self.nodes],
            "products": [dict(p) for p in self.products],
            "selections": {name: ("all" if sel is None else {str(l): list(e) for l, e in sel.items()})
                           for name, sel in self.selections.items()},
            "blocks": [{"layer": b.layer, "first_expert": b.first_expert, "count": b.count, "window": b.window,
                        "shards": list(b.shards)} for b in self.blocks],
            "windows": [{"index": w.index, "layers": list(w.layers), "stage": list(w.stage), "keep": list(w.keep),
                         "skeleton_only": list(w.skeleton_only), "retire": list(w.retire),
                         "stage_bytes": w.stage_bytes, "source_bytes": w.source_bytes,
                         "output_bytes": w.output_bytes, "local_bytes": w.local_bytes} for w in self.windows],
            "straddling_shards": {s: list(fl) for s, fl in self.straddling.items()},
            "skeleton_only_shards": list(self.skeleton_only_shards),
            "bytes": dict(self.bytes),
            "linears": [dict(n) for n in self.linears],
        }

    @classmethod
    def from_json(cls, doc: dict, source: str = "<plan>") -> "CampaignPlan":
        try:
            if doc.get("format") != PLAN_FORMAT:
                raise FqError(f"{source}: format: expected {PLAN_FORMAT!r}, got {doc.get('format')!r}")
            return cls(
                identity=doc["identity"], identity_sha256=doc["identity_sha256"], recipe=doc["recipe"],
                source=doc["source"], block_size=doc["block_size"], windows_on_disk=doc["windows_on_disk"],
                nodes=tuple(doc["nodes"]), products=tuple(doc["products"]),
                selections={name: (None if sel == "all" else {int(l): tuple(e) for l, e in sel.items()})
                            for name, sel in doc["selections"].items()},
                blocks=tuple(Block(b["layer"], b["first_expert"], b["count"], b["window"], tuple(b["shards"]))
                             for b in doc["blocks"]),
                windows=tuple(Window(w["index"], tuple(w["layers"]), tuple(w["stage"]), tuple(w["keep"]),
                                     tuple(w["skeleton_only"]), tuple(w["retire"]), w["stage_bytes"],
                                     w["source_bytes"], w["output_bytes"], w["local_bytes"]) for w in doc["windows"]),
                straddling={s: tuple(fl) for s, fl in doc["straddling_shards"].items()},
                skeleton_only_shards=tuple(doc["skeleton_only_shards"]), bytes=doc["bytes"],
                linears=tuple(doc.get("linears", ())),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise FqError(f"{source}: not a complete {PLAN_FORMAT} document ({type(e).__name__}: {e})") from None


# -- planning (pure) -------------------------------------------------------------------------------


def encoded_expert_bytes(source: SourceModel, K) -> int:
    """Bytes one node writes per expert: per projection the K-bit trellis (in*out*K/8), fp16 suh
    and svh, and the int32 codebook marker, at the stored (zero-padded) dims ``SourceModel.stored_shape``.
    ``K``: a fq.core.kbits fragment spec (one K, or K per projection)."""
    total = 0
    for proj in PROJECTIONS:
        out_f, in_f = source.stored_shape(proj)
        total += out_f * in_f * kbits.proj(K, proj) // 8 + 2 * (in_f + out_f) + 4
    return total


def make_plan(recipe: Recipe, source: SourceModel, *, usage=None, block_size: int = DEFAULT_BLOCK_SIZE,
              windows: str | Sequence | None = None, disk_budget: int | None = None,
              windows_on_disk: int = DEFAULT_WINDOWS_ON_DISK, allow_unloadable: bool = False,
              allocation_sha256: str | None = None) -> CampaignPlan:
    """The whole campaign as data. ``windows``: operator layer ranges ("3-12,13-40"), validated
    strictly; or ``disk_budget`` (bytes): the fewest balanced windows whose peak local bytes fit;
    neither: one window. A source family no EXL3 runtime loads is refused unless ``allow_unloadable``.
    A recipe with budgeted bases must be resolved first (fq.planning.budget.resolve_budgets);
    ``allocation_sha256`` names the allocation it was resolved with (part of the run identity)."""
    families.check_publishable(source.family_entry, source.exl3_problems, allow_unloadable, f"{source.origin}/config.json")
    block_size = _positive_int(block_size, "block_size")
    windows_on_disk = _positive_int(windows_on_disk, "windows_on_disk")
    selections = resolve_selections(recipe, source.moe_layers, source.n_experts, usage)
    if not recipe.resolved:
        names = ", ".join(n.name for n in recipe.nodes if n.is_budgeted)
        raise FqError(f"recipe {recipe.source}: budgeted node(s) {names} have no K per unit or experts yet: resolve "
                      "them against an allocation (fq.planning.budget.resolve_budgets)")
    layer_out = layer_output_bytes(recipe, source, {n: {l: len(e) for l, e in s.items()} for n, s in selections.items()})
    partition = choose_windows(source, layer_out, windows=windows, disk_budget=disk_budget,
                               windows_on_disk=windows_on_disk)
    sched = stage_schedule(source, partition, windows_on_disk, layer_out)

    layer_window = {l: w for w, layers in enumerate(partition) for l in layers}
    blocks = tuple(
        Block(layer, first, min(block_size, source.n_experts - first), layer_window[layer],
              source.block_shards(layer, first, min(block_size, source.n_experts - first)))
        for layer in source.moe_layers for first in range(0, source.n_experts, block_size))

    identity = {
        "format": IDENTITY_FORMAT,
        "recipe": recipe.name,
        "recipe_sha256": recipe.sha256,
        "source_revision": source.revision,
        "block_size": block_size,
        "windows": [list(layers) for layers in partition],
        "usage_sha256": usage.sha256 if (usage is not None and recipe.uses_hot) else None,
    }
    if recipe.needs_allocation:
        identity["allocation_sha256"] = allocation_sha256
    everything = tuple(range(source.n_experts))
    source_summary = {k: v for k, v in source.summary().items() if k != "origin"}
    return CampaignPlan(
        identity=identity,
        identity_sha256=canonical.sha256_hex(canonical.dumps(identity)),
        recipe={**recipe.summary(), "product_names": [p.name for p in recipe.products]},
        source=source_summary,
        block_size=block_size,
        windows_on_disk=windows_on_disk,
        nodes=tuple({**n.to_json(), "parent": n.parent, "digest": recipe.node_digest(n.name),
                     **({"bits": n.bits} if n.is_budgeted and n.is_base else {}),
                     **({"skeleton": node_skeleton(recipe, n.name)} if n.skeleton else {})}
                    for n in recipe.nodes),
        products=_products(recipe, source),
        selections={name: (None if all(e == everything for e in sel.values()) and len(sel) == len(source.moe_layers)
                           else {l: e for l, e in sel.items() if e}) for name, sel in selections.items()},
        blocks=blocks,
        windows=sched["windows"],
        straddling=sched["straddling"],
        skeleton_only_shards=source.skeleton_only_shards,
        bytes={"source_total": source.total_bytes, "skeleton": source.skeleton_bytes,
               "outputs_total": sum(w.output_bytes for w in sched["windows"]),
               "peak_source": max(w.source_bytes for w in sched["windows"]),
               "peak_local": max(w.local_bytes for w in sched["windows"])},
        linears=plan_linears(recipe, source),
    )


def node_skeleton(recipe: Recipe, name: str) -> dict:
    """A plan node's ``skeleton``: class -> the linear node it encodes on every layer, or for a budgeted base's class
    whose K varies per layer {layer ("head" for the head): linear node}."""
    out: dict = {}
    for cls, ln, layers in recipe.linear_assignments(name):
        if layers is None:
            out[cls] = ln.name
        else:
            out.setdefault(cls, {}).update({("head" if l is None else str(l)): ln.name for l in layers})
    return {cls: (dict(sorted(v.items(), key=lambda kv: -1 if kv[0] == "head" else int(kv[0])))
                  if isinstance(v, dict) else v) for cls, v in out.items()}


def _products(recipe: Recipe, source: SourceModel) -> tuple[dict, ...]:
    """Each product's chain and nominal bits over the experts; with whole-model bases in the recipe, also over the
    whole model and the head (fq.planning.model_bits: the source's linear shapes from its config)."""
    weights = layer_weights = None
    if recipe.linear_nodes:
        from fq.planning.model_bits import linear_layer_weights, linear_shapes, linear_weights

        shapes = linear_shapes(source)
        weights = linear_weights(source, shapes)
        layer_weights = linear_layer_weights(source, shapes) if recipe.budgeted else None
    out = []
    for p in recipe.products:
        entry = {"name": p.name, "chain": list(p.chain), "bpw": recipe.product_bpw(p)}
        if weights is not None:
            from fq.planning.model_bits import product_bits

            bits = product_bits(recipe, p, weights, layer_weights)
            entry.update(model_bpw=bits["model"], head_bits=bits["head"])
        out.append(entry)
    return tuple(out)


def linear_node_layers(recipe: Recipe) -> dict[str, set | None]:
    """linear node -> the layers its users need (None: every layer of its class), over every node of the recipe."""
    out: dict = {}
    for n in recipe.nodes:
        for _, ln, layers in recipe.linear_assignments(n.name):
            if layers is None or out.get(ln.name, set()) is None:
                out[ln.name] = None
            else:
                out.setdefault(ln.name, set()).update(layers)
    return out


def plan_linears(recipe: Recipe, source: SourceModel) -> tuple[dict, ...]:
    """The recipe's linear nodes against the source's non-expert linears (fq.model.linears): what each encodes (a
    budgeted base's per-K node: only the layers its allocation gives that K)."""
    from fq.model.linears import source_linears

    found = source_linears(source)
    needed = linear_node_layers(recipe)
    out = []
    for ln in recipe.linear_nodes:
        layers = found.get(ln.cls, {})
        if needed[ln.name] is not None:
            layers = {l: v for l, v in layers.items() if l in needed[ln.name]}
        if not layers:
            users = recipe.linear_users(ln.name)
            why = (" (tie_word_embeddings: the head is the embedding matrix, which stays as published)"
                   if ln.cls == "head" and source.tied_embeddings else "")
            raise FqError(f"recipe {recipe.source}: node(s) {', '.join(users)} quantize class {ln.cls!r} at K{ln.K}, "
                          f"but the source {source.origin} has no {ln.cls} linears{why}; set skeleton.{ln.cls} to 16")
        if len(ln.name) > 64:
            raise FqError(f"recipe {recipe.source}: linear node {ln.name!r} of node(s) {', '.join(recipe.linear_users(ln.name))} "
                          f"is {len(ln.name)} characters, a file name prefix takes at most 64: fewer stages on {ln.cls}")
        out.append({**ln.to_json(), "digest": ln.digest,
                    **({"parent_digest": ln.parent.digest} if ln.parent is not None else {}),
                    "layers": {("head" if l is None else str(l)): [x.name for x in v] for l, v in layers.items()}})
    return tuple(out)


def choose_windows(source: SourceModel, layer_out: Mapping[int, int], *, windows=None, disk_budget=None,
                   windows_on_disk: int = DEFAULT_WINDOWS_ON_DISK) -> tuple[tuple[int, ...], ...]:
    """The window partition: operator ranges (checked), or from a disk budget, or one window."""
    layers = source.moe_layers
    if windows is not None and disk_budget is not None:
        raise FqError("windows and disk budget are alternatives: give one (the budget computes windows)")
    if windows is not None:
        return check_partition(parse_ranges(windows), layers, windows)
    if disk_budget is None:
        return (tuple(layers),)
    budget = _positive_int(disk_budget, "disk budget")
    for m in range(1, len(layers) + 1):
        partition = balanced_partition(layers, m)
        sched = stage_schedule(source, partition, windows_on_disk, layer_out)
        if max(w.local_bytes for w in sched["windows"]) <= budget:
            return partition
    outputs = sum(layer_out.values()) + source.skeleton_bytes
    raise FqError(f"disk budget {fmt_bytes(budget)} is below the peak of even one-layer windows "
                  f"({fmt_bytes(max(w.local_bytes for w in sched['windows']))} with {windows_on_disk} window(s) on disk); "
                  f"encoded outputs and skeleton alone take {fmt_bytes(outputs)} before finalize")


def balanced_partition(layers: Sequence[int], m: int) -> tuple[tuple[int, ...], ...]:
    """``layers`` in ``m`` contiguous windows whose sizes differ by at most one (larger first)."""
    q, r = divmod(len(layers), m)
    out, i = [], 0
    for w in range(m):
        n = q + (1 if w < r else 0)
        out.append(tuple(layers[i:i + n]))
        i += n
    return tuple(out)


def stage_schedule(source: SourceModel, partition: Sequence[Sequence[int]], windows_on_disk: int,
                   layer_out: Mapping[int, int]) -> dict:
    """Per window: shards to fetch, keep and retire, and the bytes on disk (see module doc)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    used: dict[int, set[str]] = {}
    for w, layers in enumerate(partition):
        used[w] = set()
        for layer in layers:
            for shard in source.layer_shards(layer):
                first.setdefault(shard, w)
                last[shard] = w
                used[w].add(shard)
    skeleton_only = set(source.skeleton_only_shards)
    for shard in skeleton_only:  # consumed by skeleton extraction, staged with the first window
        first[shard] = last[shard] = 0
    size = source.shard_sizes
    W = windows_on_disk
    windows, written = [], 0
    for w, layers in enumerate(partition):
        stage = sorted(s for s in first if first[s] == w)
        keep = sorted(s for s in first if first[s] < w <= last[s])
        retire = sorted(s for s in first if last[s] == w)
        on_disk = [s for s in first if first[s] <= w and last[s] >= w - W + 1]
        out = sum(layer_out[l] for l in layers) + sum(source.shard_skeleton_bytes(s) for s in stage)
        written += out
        source_bytes = sum(size[s] for s in on_disk)
        windows.append(Window(index=w, layers=tuple(layers), stage=tuple(stage), keep=tuple(keep),
                              skeleton_only=tuple(s for s in stage if s in skeleton_only), retire=tuple(retire),
                              stage_bytes=sum(size[s] for s in stage), source_bytes=source_bytes,
                              output_bytes=out, local_bytes=source_bytes + written))
    straddling = {s: (first[s], last[s]) for s in sorted(first) if first[s] != last[s]}
    return {"windows": tuple(windows), "straddling": straddling}


def layer_output_bytes(recipe: Recipe, source: SourceModel, counts: Mapping[str, Mapping[int, int]]) -> dict[int, int]:
    """Fragment bytes each MoE layer adds, from per-node expert counts (fq.planning.recipe.selection_counts)."""
    return {layer: sum(encoded_expert_bytes(source, n.K_at(layer)) * counts[n.name].get(layer, 0)
                       for n in recipe.nodes) for layer in source.moe_layers}


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FqError(f"{what}: expected a positive integer, got {value!r}")
    return value


# -- files and tables -----------------------------------------------------------------------------


def write_plan(path: str | Path, plan: CampaignPlan) -> str:
    """Write the plan as canonical JSON (atomically) with its own digest; returns the digest."""
    doc = plan.to_json()
    digest = canonical.sha256_hex(canonical.dumps(doc))
    write_bytes(path, canonical.dumps({**doc, "plan_sha256": digest}) + b"\n")
    return digest


def load_plan(path: str | Path) -> CampaignPlan:
    """Read a plan file, refusing one whose digest does not match its content."""
    path = Path(path)
    doc = canonical.load(path)
    if not isinstance(doc, dict) or "plan_sha256" not in doc:
        raise FqError(f"{path}: not an {PLAN_FORMAT} file (no plan_sha256)")
    claimed = doc.pop("plan_sha256")
    actual = canonical.sha256_hex(canonical.dumps(doc))
    if claimed != actual:
        raise FqError(f"{path}: plan_sha256 {claimed} does not match the content ({actual}): the plan was edited")
    plan = CampaignPlan.from_json(doc, str(path))
    if canonical.sha256_hex(canonical.dumps(dict(plan.identity))) != plan.identity_sha256:
        raise FqError(f"{path}: identity_sha256 does not match the identity it names")
    return plan


def plan_table(plan: CampaignPlan) -> str:
    r, s, b = plan.recipe, plan.source, plan.bytes
    frags = plan.fragments()
    lines = [
        f"plan {r['recipe']} on {s['model_type'] or s['family']} @ {s['revision']}",
        f"  run identity {plan.identity_sha256}",
        f"  {r['passes']} passes emitting {r['encoded_bpw']} bpw; {r['products']} products spanning {r['nominal_bpw']} nominal bpw",
        f"  {len(s['moe_layers'])} MoE layers ({format_layers(s['moe_layers'])}) x {s['n_experts']} experts; "
        f"block size {plan.block_size}: {len(plan.blocks)} blocks, {len(frags)} fragments",
        f"  {len(plan.windows)} window(s), {plan.windows_on_disk} on disk at once; {len(plan.straddling)} shard(s) straddle "
        f"windows (kept, not fetched twice); {len(plan.skeleton_only_shards)} skeleton-only shard(s) staged with window 0",
        "",
        f"{'window':>6}  {'layers':<9} {'blocks':>6} {'fetch':>5} {'fetch bytes':>12} {'kept':>4} {'retire':>6} "
        f"{'skel-only':>9} {'source on disk':>14} {'local bytes':>12}",
    ]
    for w in plan.windows:
        nblocks = sum(1 for blk in plan.blocks if blk.window == w.index)
        lines.append(f"{w.index:>6}  {format_layers(w.layers):<9} {nblocks:>6} {len(w.stage):>5} {fmt_bytes(w.stage_bytes):>12} "
                     f"{len(w.keep):>4} {len(w.retire):>6} {len(w.skeleton_only):>9} {fmt_bytes(w.source_bytes):>14} "
                     f"{fmt_bytes(w.local_bytes):>12}")
    shared = [n for n in plan.nodes if n.get("experts_from")]
    if shared:
        n_copied = sum(1 for f in frags if plan.experts_from(f.node))
        lines += ["", f"{len(frags) - n_copied} fragments encoded; {n_copied} copied from another base's encoding of the "
                      "same experts: " + ", ".join(f"{n['name']} takes {n['experts_from']}'s" for n in shared)]
    lines += ["", f"source {fmt_bytes(b['source_total'])} (skeleton {fmt_bytes(b['skeleton'])}); encoded outputs "
                  f"{fmt_bytes(b['outputs_total'])}; peak source on disk {fmt_bytes(b['peak_source'])}; "
                  f"peak local {fmt_bytes(b['peak_local'])}"]
    if plan.linears:
        lines += ["", f"{len(plan.linears)} linear node(s), {len(plan.linear_jobs())} linear jobs: "
                      + ", ".join(f"{n['name']} ({len(n['layers'])})" for n in plan.linears),
                  "", f"{'product':<16} {'bpw experts':>11} {'bpw model':>9} {'head':>4}  chain"]
        for p in plan.products:
            lines.append(f"{p['name']:<16} {p['bpw']:>11} {p.get('model_bpw', p['bpw']):>9} "
                         f"{p.get('head_bits', 16):>4}  {' -> '.join(p['chain'])}")
    return "\n".join(lines)
