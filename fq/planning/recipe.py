"""fq-cartridge/2 recipes: which passes a campaign encodes and which products it publishes.

A recipe is a forest of **nodes**. A base encodes every routed expert at K bits; a stage encodes
the K-bit residual ``W - Ŵ(parent chain)`` for a selection of experts (all, the N hottest per
layer, or explicit per-layer lists). A **product** is a chain base -> stage -> ... whose weight is
the sum of the chain's reconstructions. A base may also quantize the non-expert linear classes (``skeleton``), and a
stage may add a residual on those its chain's base quantizes (``skeleton`` on a stage: ``LinearNode`` with a parent);
one node can serve many products, which is the point:
the GLM-5.2 dag publishes 9 products (35 nominal bpw) from 9 passes emitting 14 bpw.

Validation is the JSON schema first (shape, K in 1..8, codebook names), then the rules a schema
cannot state: unique names, known parents, no cycles, stage experts within the parent's,
products that are real chains, no node outside every product. Everything here is pure: the
loader reads one file, the rest takes data.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from pathlib import Path
from fq.core import canonical, kbits
from fq.core.layer_ranges import format_layers
from fq.core.schema_check import validate
from fq.core.targets import EXLLAMAV3
from fq.errors import FqError

FORMAT = "fq-cartridge/2"
CODEBOOKS = ("3inst", "mcg", "mul1")
# Non-expert linear classes a base may quantize (``skeleton``: class -> bits; 16 = as published).
LINEAR_CLASSES = ("attention", "shared", "dense", "head")
UNQUANTIZED = 16


@dataclass(frozen=True)
class SelectionRule:
    """The experts a node encodes: ``all``, the ``hot`` N most used per layer, or explicit ``layers``."""

    mode: str  # "all" | "hot" | "layers" | "budget" (a budgeted stage's, before resolve_budgets makes it "layers")
    hot: int | None = None
    layers: tuple[tuple[int, tuple[int, ...]], ...] = ()  # ((layer, sorted experts), ...) sorted by layer

    def layer_map(self) -> dict[int, tuple[int, ...]]:
        return dict(self.layers)

    def to_json(self):
        if self.mode == "all":
            return "all"
        if self.mode == "hot":
            return {"hot": self.hot}
        if self.mode == "budget":
            return "budget"
        return {"layers": {str(layer): list(experts) for layer, experts in self.layers}}

    def describe(self) -> str:
        if self.mode == "all":
            return "all experts"
        if self.mode == "hot":
            return f"{self.hot} hottest per layer"
        if self.mode == "budget":
            return "experts chosen by measured gain per byte"
        n = sum(len(e) for _, e in self.layers)
        return f"{n} listed experts in {len(self.layers)} layers"


ALL = SelectionRule("all")
BUDGET = SelectionRule("budget")


@dataclass(frozen=True)
class Node:
    name: str
    kind: str  # "base" | "stage"
    # routed experts' K: an int, or for a budgeted base resolved against its allocation a fq.core.kbits node spec
    # ({layer: K or {gate, up, down: K}}); None for a budgeted base not resolved yet (resolve_budgets)
    K: "int | dict | None"
    codebook: str
    parent: str | None  # None for a base
    experts: SelectionRule  # ALL for a base
    description: str = ""
    # a base's quantized non-expert classes, ((class, K), ...) in LINEAR_CLASSES order; classes at 16 bits omitted.
    # A stage's: the classes it adds a K-bit residual to (against its chain's reconstruction of those linears).
    # Not part of to_json (so not of node_digest): the expert fragments do not depend on it; each (class, K,
    # codebook[, the linear nodes it corrects]) is its own linear node (Recipe.linear_nodes) with its own digest.
    skeleton: tuple[tuple[str, int], ...] = ()
    # a base whose routed experts are another base's encoding (same K and codebook: the same expert bytes), set by
    # parse_recipe (expert_owners); part of to_json, so of node_digest: a changed owner changes this base's digest
    experts_from: str | None = None
    # a budgeted base's bits budget (recipe ``bits``): every class quantized, K per allocation unit; its ``skeleton``
    # then maps a class to an int (every layer at that K) or to ((layer, K), ...) (the head's layer is None).
    # A budgeted stage's: the bits it adds over its parent ("+B"), its experts those of most measured gain per byte
    bits: float | None = None

    @property
    def is_base(self) -> bool:
        return self.kind == "base"

    @property
    def is_budgeted(self) -> bool:
        return self.bits is not None

    def skeleton_bits(self, cls: str):
        return dict(self.skeleton).get(cls, UNQUANTIZED)

    def expert_bits(self) -> float:
        """Mean trellis bits per routed-expert weight (an int's float for a fixed-K node)."""
        if self.K is None:
            raise FqError(f"node {self.name!r}: its bits budget is not resolved into K per unit yet (no allocation)")
        return kbits.bits(self.K)

    def K_at(self, layer: int):
        """The fragment K spec of this node's experts in ``layer`` (fq.core.kbits)."""
        if self.K is None:
            raise FqError(f"node {self.name!r}: its bits budget is not resolved into K per unit yet (no allocation)")
        return kbits.at_layer(self.K, layer, f"node {self.name!r} K")

    def to_json(self) -> dict:
        out = {"name": self.name, "kind": self.kind, "K": kbits.to_json(self.K) if self.K is not None else None,
               "codebook": self.codebook}
        if not self.is_base and self.is_budgeted:
            out["bits"] = f"+{self.bits:g}"  # its selection (to_json below) is what the budget chose
        if not self.is_base:
            out["parent"] = self.parent
            out["experts"] = self.experts.to_json()
        if self.experts_from is not None:
            out["experts_from"] = self.experts_from
        return out


@dataclass(frozen=True)
class LinearNode:
    """One encoding of a non-expert class (attention, shared, dense, head) at K bits with one codebook: shared by
    every base of the recipe that names that class at those bits (one DAG node, one set of fragments).

    A stage's linear node (``parent`` set) encodes the K-bit residual of each linear against the reconstruction of
    the linear nodes it corrects (``parent``, its parent, ... down to a base's): it is shared by every stage naming
    the class at those bits and codebook on the same linear ancestry. Its name extends the parent's
    (``attention-K4-mul1+K2-mul1``) and its digest binds the parent's."""

    cls: str
    K: int
    codebook: str
    parent: "LinearNode | None" = None

    @property
    def name(self) -> str:
        if self.parent is not None:
            return f"{self.parent.name}+K{self.K}-{self.codebook}"
        return f"{self.cls}-K{self.K}-{self.codebook}"

    @property
    def role(self) -> str:
        return "base" if self.parent is None else "stage"

    @property
    def depth(self) -> int:
        """0 for a base's linear node, 1 for a residual on it, ..."""
        return 0 if self.parent is None else self.parent.depth + 1

    def ancestry(self) -> tuple["LinearNode", ...]:
        """The linear nodes this one corrects, base first (empty for a base's)."""
        return () if self.parent is None else self.parent.ancestry() + (self.parent,)

    def to_json(self) -> dict:
        out = {"name": self.name, "class": self.cls, "K": self.K, "codebook": self.codebook}
        if self.parent is not None:
            out["parent"] = self.parent.name
        return out

    @property
    def digest(self) -> str:
        """sha256 of the definition (and of the parent's digest, for a residual): what the fragments attest and a
        plan names; it changes with every linear node the residual corrects."""
        doc = {"format": FORMAT, "linear": self.to_json()}
        if self.parent is not None:
            doc["parent_digest"] = self.parent.digest
        return canonical.sha256_hex(canonical.dumps(doc))


@dataclass(frozen=True)
class ProductSpec:
    name: str
    chain: tuple[str, ...]  # base first; each element's parent is the previous one
    description: str = ""


@dataclass(frozen=True, eq=False)
class Recipe:
    name: str
    description: str
    nodes: tuple[Node, ...]  # topological: parents before children, file order otherwise
    products: tuple[ProductSpec, ...]
    sha256: str  # of the canonical JSON document: formatting does not change a recipe's identity
    source: str  # where it came from, for messages

    # -- lookups ---------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise FqError(f"recipe {self.source}: no node named {name!r} (nodes: {', '.join(self.node_names)})")

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    @property
    def bases(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.is_base)

    @property
    def stages(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if not n.is_base)

    @property
    def edges(self) -> tuple[tuple[str, str], ...]:
        """(parent, child) for every stage: the graph Snakemake's DAG mirrors."""
        return tuple((n.parent, n.name) for n in self.nodes if not n.is_base)

    def children(self, name: str) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes if n.parent == name)

    def chain(self, name: str) -> tuple[str, ...]:
        """The ancestry of ``name``, base first: the chain whose sum a stage corrects."""
        out = [name]
        while (parent := self.node(out[-1]).parent) is not None:
            out.append(parent)
        return tuple(reversed(out))

    def descendants(self, name: str) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes if n.name != name and name in self.chain(n.name))

    @property
    def linear_nodes(self) -> tuple[LinearNode, ...]:
        """Every distinct linear node a base or a stage encodes, in LINEAR_CLASSES order, then depth (a residual
        after the nodes it corrects), then K, codebook and name."""
        found = {ln for n in self.nodes for _, ln, _ in self.linear_assignments(n.name)}
        return tuple(sorted(found, key=lambda n: (LINEAR_CLASSES.index(n.cls), n.depth, n.K, n.codebook, n.name)))

    def linear_assignments(self, name: str) -> tuple[tuple[str, LinearNode, tuple | None], ...]:
        """(class, linear node, layers) for every class node ``name`` encodes: a fixed base's or a stage's one linear
        node per class on every layer of the class (layers None); a budgeted base's one linear node per K its
        allocation gives the class, on the layers it gives that K (the head's layer is None)."""
        n = self.node(name)
        if not n.is_base:
            if not n.skeleton:
                return ()
            below = self.chain_linears(n.parent)
            return tuple((cls, LinearNode(cls, K, n.codebook, below[cls][-1]), None) for cls, K in n.skeleton)
        out = []
        for cls, K in n.skeleton:
            if kbits.is_one(K):
                out.append((cls, LinearNode(cls, K, n.codebook), None))
                continue
            for k in sorted({k for _, k in K}):
                out.append((cls, LinearNode(cls, k, n.codebook), tuple(layer for layer, kk in K if kk == k)))
        return tuple(out)

    def base_linears(self, base: str) -> dict[str, LinearNode]:
        """class -> the linear node a fixed base's published directory takes that class from (quantized classes
        only); a budgeted base takes a class from several (``linear_assignments``)."""
        b = self.node(base)
        if not b.is_base:
            raise FqError(f"recipe {self.source}: {base!r} is a stage, not a base")
        return self.node_linears(base)

    def node_linears(self, name: str) -> dict[str, LinearNode]:
        """class -> the linear node ``name`` itself encodes on every layer: a fixed base's quantized classes, or the
        classes a stage adds a residual to (its parent being the chain's last linear node of that class). A
        budgeted base's classes have one linear node per K: see ``linear_assignments``."""
        found = self.linear_assignments(name)
        if any(layers is not None for _, _, layers in found):
            raise FqError(f"recipe {self.source}: budgeted base {name!r} takes a class from one linear node per K of "
                          "its allocation, not one (linear_assignments)")
        return {cls: ln for cls, ln, _ in found}

    def chain_linears(self, name: str) -> dict[str, tuple[LinearNode, ...]]:
        """class -> the linear nodes whose reconstructions a product ending at ``name`` sums, base first."""
        out: dict[str, tuple[LinearNode, ...]] = {}
        for element in self.chain(name):
            for cls, ln in self.node_linears(element).items():
                out[cls] = out.get(cls, ()) + (ln,)
        return out

    def linear_users(self, name: str) -> tuple[str, ...]:
        """The nodes (bases or stages) whose own linears include linear node ``name``: who publishes it."""
        return tuple(n.name for n in self.nodes if any(ln.name == name for _, ln, _ in self.linear_assignments(n.name)))

    def linear_node(self, name: str) -> LinearNode:
        for n in self.linear_nodes:
            if n.name == name:
                return n
        raise FqError(f"recipe {self.source}: no node quantizes a non-expert class as {name!r} "
                      f"(linear nodes: {', '.join(n.name for n in self.linear_nodes) or 'none'})")

    def expert_owner(self, name: str) -> str:
        """The node whose expert encoding ``name`` publishes: itself, or for a base sharing another's experts
        (``Node.experts_from``) that base."""
        return self.node(name).experts_from or name

    @property
    def encoding_nodes(self) -> tuple[Node, ...]:
        """The nodes whose routed experts are encoded (every node but the bases that take another base's)."""
        return tuple(n for n in self.nodes if n.experts_from is None)

    @property
    def uses_hot(self) -> bool:
        return any(n.experts.mode == "hot" for n in self.nodes)

    # -- derived numbers -------------------------------------------------------------------
    @property
    def passes(self) -> int:
        """Quantization passes over the routed experts: one per node, a base sharing another's experts none."""
        return len(self.encoding_nodes)

    @property
    def encoded_bpw(self):
        """Trellis bits per expert weight emitted, summing the K of every node that encodes (a partial stage counts
        fully; a budgeted base its mean over layers and projections): an int unless a budgeted base is in it."""
        return _bits_sum(self.node(n.name) for n in self.encoding_nodes)

    def product_bpw(self, product: ProductSpec):
        return _bits_sum(self.node(n) for n in product.chain)

    @property
    def nominal_bpw(self):
        """Sum over products of the bits per expert weight a consumer of that product loads."""
        total = sum(self.product_bpw(p) for p in self.products)
        return round(total, 4) if isinstance(total, float) else total

    @property
    def budgeted(self) -> tuple[Node, ...]:
        """The budgeted bases (recipe ``bits``)."""
        return tuple(n for n in self.nodes if n.is_budgeted and n.is_base)

    @property
    def budgeted_stages(self) -> tuple[Node, ...]:
        """The stages whose experts a bits budget over their parent chooses (recipe ``bits`` on a stage)."""
        return tuple(n for n in self.nodes if n.is_budgeted and not n.is_base)

    @property
    def needs_allocation(self) -> bool:
        """Whether planning needs a measured allocation (a budgeted base or stage)."""
        return any(n.is_budgeted for n in self.nodes)

    @property
    def resolved(self) -> bool:
        """Every budgeted base has its K per unit and every budgeted stage its experts (resolve_budgets)."""
        return all(n.K is not None and n.experts.mode != "budget" for n in self.nodes)

    def node_digest(self, name: str) -> str:
        """sha256 of the node's definition and its ancestors': changes exactly when this node's
        output would change, so a workflow can rerun a node and its descendants only."""
        chain = [self.node(n).to_json() for n in self.chain(name)]
        return canonical.sha256_hex(canonical.dumps({"format": FORMAT, "chain": chain}))

    def summary(self) -> dict:
        return {
            "recipe": self.name,
            "sha256": self.sha256,
            "passes": self.passes,
            "encoded_bpw": self.encoded_bpw,
            "products": len(self.products),
            "nominal_bpw": self.nominal_bpw,
        }


# -- parsing and validation ------------------------------------------------------------------


def _check_half_k(node: "Node", i: int, err: str) -> None:
    """A half-integer K (1.5, 2.5, 3.5) is exllamav3's mul1-only rate: refuse it with another codebook."""
    ks = [("K", node.K)] + [(f"skeleton.{c}", k) for c, k in node.skeleton]
    for field, k in ks:
        if isinstance(k, float) and node.codebook != "mul1":
            raise FqError(f"{err}: nodes[{i}] ({node.name!r}) {field} {k}: a half-integer K needs codebook mul1 (as "
                          f"exllamav3 {EXLLAMAV3} codes it), got {node.codebook!r}")


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file."""
    path = Path(path)
    return parse_recipe(canonical.load(path), str(path))


def parse_recipe(doc, source: str = "<recipe>") -> Recipe:
    """Validate a parsed recipe document (schema, then graph rules) and build a Recipe."""
    validate(doc, "recipe", f"recipe {source}", describe=lambda path: _describe(doc, path))
    err = f"recipe {source}"

    nodes: dict[str, Node] = {}
    file_index: dict[str, int] = {}
    for i, raw in enumerate(doc["nodes"]):
        name = raw["name"]
        if name in nodes:
            raise FqError(f"{err}: node name {name!r} is used twice (nodes[{file_index[name]}] and nodes[{i}])")
        if raw["kind"] == "base" and "bits" in raw:  # K per unit once resolve_budgets has its allocation
            node = Node(name, "base", None, raw["codebook"], None, ALL, raw.get("description", ""), (),
                        bits=float(raw["bits"]))
        elif raw["kind"] == "base":
            skel = tuple((c, raw.get("skeleton", {})[c]) for c in LINEAR_CLASSES
                         if raw.get("skeleton", {}).get(c, UNQUANTIZED) != UNQUANTIZED)
            node = Node(name, "base", raw["K"], raw["codebook"], None, ALL, raw.get("description", ""), skel)
        elif "bits" in raw:  # experts chosen by resolve_budgets from the measured allocation
            node = Node(name, "stage", raw["K"], raw["codebook"], raw["parent"], BUDGET, raw.get("description", ""),
                        bits=float(raw["bits"][1:]))
            if not node.bits > 0:
                raise FqError(f"{err}: stage {name!r} (nodes[{i}]) bits {raw['bits']!r}: expected a positive number of "
                              "bits over its parent, such as \"+0.5\"")
        else:
            skel = tuple((c, raw["skeleton"][c]) for c in LINEAR_CLASSES if c in raw.get("skeleton", {}))
            node = Node(name, "stage", raw["K"], raw["codebook"], raw["parent"],
                        _selection(raw["experts"]), raw.get("description", ""), skel)
        _check_half_k(node, i, err)
        nodes[name] = node
        file_index[name] = i

    for node in nodes.values():
        if node.parent is not None and node.parent not in nodes:
            raise FqError(f"{err}: node {node.name!r} names parent {node.parent!r}, which is not a node of this recipe "
                          f"(nodes: {', '.join(nodes)})")
    order = _topological(nodes, file_index, err)
    for node in order:
        if node.experts.mode == "budget" and not nodes[node.parent].is_base:
            raise FqError(f"{err}: stage {node.name!r} (nodes[{file_index[node.name]}]) chooses its experts under a "
                          f"bits budget over its parent, which must be a base; {node.parent!r} is a stage")
        if node.parent is not None and nodes[node.parent].experts.mode == "budget":
            raise FqError(f"{err}: stage {node.name!r} (nodes[{file_index[node.name]}]) has parent {node.parent!r}, "
                          "whose experts a budget chooses: a stage on it is not supported yet")
        if node.parent is not None:
            _check_subset_static(node, nodes[node.parent], err)
            _check_stage_skeleton(node, nodes, file_index[node.name], err)

    products = _products(doc["products"], nodes, err)
    owners = expert_owners(order)
    return Recipe(
        name=doc["name"],
        description=doc.get("description", ""),
        nodes=tuple(replace(n, experts_from=owners.get(n.name)) for n in order),
        products=products,
        sha256=canonical.sha256_hex(canonical.dumps(doc)),
        source=source,
    )


def expert_owners(nodes) -> dict[str, str]:
    """base -> the base whose expert encoding it takes, for every base that shares one (``nodes`` in file order
    among bases). A base's routed experts are a function of K, the codebook and the campaign (source, calibration,
    seed) alone, so bases of one (K, codebook) are encoded once: by the first experts-only base of the recipe of that
    (K, codebook) (else the first), whose name seeds the encode; the others publish its bytes. Preferring an
    experts-only owner keeps that base's encoding where it was when a whole-model base is added beside it."""
    groups: dict[tuple[str, str], list[Node]] = {}
    for n in nodes:
        if n.is_base and n.K is not None:  # a budgeted base's experts are known once resolved
            groups.setdefault((canonical.dumps(kbits.to_json(n.K)).decode(), n.codebook), []).append(n)
    out = {}
    for group in groups.values():
        owner = next((n for n in group if not n.skeleton), group[0])
        out.update({n.name: owner.name for n in group if n is not owner})
    return out


def _describe(doc, path: tuple) -> str:
    """Name the node/product a schema error sits in, so the message points at it by name."""
    if len(path) >= 2 and path[0] in ("nodes", "products") and isinstance(path[1], int):
        try:
            name = doc[path[0]][path[1]].get("name")
        except (AttributeError, IndexError, KeyError, TypeError):
            return ""
        if isinstance(name, str):
            return f"{path[0][:-1]} {name!r}"
    return ""


def _selection(raw) -> SelectionRule:
    if raw == "all":
        return ALL
    if "hot" in raw:
        return SelectionRule("hot", hot=raw["hot"])
    layers = tuple(sorted((int(k), tuple(sorted(v))) for k, v in raw["layers"].items()))
    return SelectionRule("layers", layers=layers)


def _topological(nodes: dict[str, Node], file_index: dict[str, int], err: str) -> list[Node]:
    """Parents before children; among ready nodes, file order (deterministic)."""
    ready = [(file_index[n.name], n.name) for n in nodes.values() if n.parent is None]
    if not ready:
        raise FqError(f"{err}: no base node (a recipe needs at least one node of kind 'base')")
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(nodes[name])
        for child in nodes.values():
            if child.parent == name:
                heapq.heappush(ready, (file_index[child.name], child.name))
    if len(order) < len(nodes):
        placed = {n.name for n in order}
        start = min((n for n in nodes if n not in placed), key=file_index.__getitem__)
        seen: list[str] = []
        cur = start
        while cur not in seen:
            seen.append(cur)
            cur = nodes[cur].parent
        cycle = seen[seen.index(cur):] + [cur]
        raise FqError(f"{err}: parents form a cycle {' -> '.join(cycle)}; every stage must descend from a base")
    return order


def _check_stage_skeleton(node: Node, nodes: dict[str, Node], index: int, err: str) -> None:
    """A stage's ``skeleton`` corrects linears its chain's base quantizes: a residual on a class the base keeps as
    published (16 bits) would correct an exact weight."""
    base = node
    while base.parent is not None:
        base = nodes[base.parent]
    if node.skeleton and base.is_budgeted:
        raise FqError(f"{err}: stage {node.name!r} (nodes[{index}]) corrects non-expert linears (skeleton), but its "
                      f"chain's base {base.name!r} is budgeted (bits): a residual on linears whose K varies per layer "
                      "is not supported; drop the stage's skeleton (its experts may still take a residual)")
    for cls, _ in node.skeleton:
        if base.skeleton_bits(cls) == UNQUANTIZED:
            raise FqError(f"{err}: stage {node.name!r} (nodes[{index}]) skeleton.{cls}: its chain's base {base.name!r} "
                          f"leaves {cls} unquantized ({UNQUANTIZED} bits, as published), so there is no reconstruction "
                          f"to correct; quantize {cls} in base {base.name!r} or drop skeleton.{cls} from the stage")


def _check_subset_static(node: Node, parent: Node, err: str) -> None:
    """The parts of 'stage experts within the parent's' decidable without the model or usage data.

    Hot-vs-listed combinations are checked once selections are resolved (resolve_selections).
    """
    c, p = node.experts, parent.experts
    what = f"{err}: stage {node.name!r} selects {c.describe()}"
    if p.mode == "all":
        return
    if c.mode == "all":
        raise FqError(f"{what} but its parent {parent.name!r} covers only {p.describe()}: a residual needs the parent's "
                      f"reconstruction of every expert it corrects")
    if c.mode == "hot" and p.mode == "hot" and c.hot > p.hot:
        raise FqError(f"{what} but its parent {parent.name!r} covers only the {p.hot} hottest: expected hot <= {p.hot}")
    if c.mode == "layers" and p.mode == "layers":
        pm = p.layer_map()
        for layer, experts in c.layers:
            if layer not in pm:
                raise FqError(f"{what}, including layer {layer}, where its parent {parent.name!r} has no experts")
            extra = sorted(set(experts) - set(pm[layer]))
            if extra:
                raise FqError(f"{what}: layer {layer} experts {_ints(extra)} are not in parent {parent.name!r}'s selection")


def _products(raw_products, nodes: dict[str, Node], err: str) -> tuple[ProductSpec, ...]:
    out: list[ProductSpec] = []
    seen_names: dict[str, int] = {}
    seen_chains: dict[tuple[str, ...], str] = {}
    for i, raw in enumerate(raw_products):
        name, chain = raw["name"], tuple(raw["chain"])
        where = f"{err}: product {name!r}"
        if name in seen_names:
            raise FqError(f"{err}: product name {name!r} is used twice (products[{seen_names[name]}] and products[{i}])")
        seen_names[name] = i
        for element in chain:
            if element not in nodes:
                raise FqError(f"{where}: chain element {element!r} is not a node of this recipe")
        if not nodes[chain[0]].is_base:
            raise FqError(f"{where}: chain starts with {chain[0]!r}, a stage; a chain starts at a base "
                          f"(here {nodes[chain[0]].parent!r}'s chain)")
        for prev, element in zip(chain, chain[1:]):
            if nodes[element].parent != prev:
                raise FqError(f"{where} is not a chain: {element!r} has parent {nodes[element].parent!r}, "
                              f"not the previous element {prev!r}")
        if chain in seen_chains:
            raise FqError(f"{where} repeats the chain of product {seen_chains[chain]!r} ({' -> '.join(chain)})")
        seen_chains[chain] = name
        out.append(ProductSpec(name, chain, raw.get("description", "")))
    used = {n for p in out for n in p.chain}
    unused = [n for n in nodes if n not in used]
    if unused:
        raise FqError(f"{err}: node(s) {', '.join(repr(n) for n in unused)} are in no product's chain: "
                      f"they would be encoded and never published")
    return tuple(out)


def _ints(values) -> str:
    values = list(values)
    shown = ", ".join(str(v) for v in values[:12])
    return shown + (f", ... ({len(values)} in all)" if len(values) > 12 else "")


# -- selections resolved against a model -----------------------------------------------------


def selection_counts(recipe: Recipe, moe_layers, n_experts: int) -> dict[str, dict[int, int]]:
    """Experts each node encodes per MoE layer, without needing usage data (hot N counts N).

    Enough for pricing; planning needs the experts themselves (resolve_selections).
    """
    layers = tuple(moe_layers)
    out: dict[str, dict[int, int]] = {}
    for node in recipe.nodes:
        sel = node.experts
        if sel.mode == "budget":
            raise FqError(f"recipe {recipe.source}: stage {node.name!r} chooses its experts from the measured "
                          "allocation: resolve the recipe first (fq.planning.budget.resolve_budgets)")
        if sel.mode == "all":
            out[node.name] = {layer: n_experts for layer in layers}
        elif sel.mode == "hot":
            _check_hot(recipe, node, n_experts)
            out[node.name] = {layer: sel.hot for layer in layers}
        else:
            lm = _checked_layers(recipe, node, layers, n_experts)
            out[node.name] = {layer: len(lm.get(layer, ())) for layer in layers}
    return out


def resolve_selections(recipe: Recipe, moe_layers, n_experts: int, usage=None) -> dict[str, dict[int, tuple[int, ...]]]:
    """Each node's experts per MoE layer (sorted; layers without experts omitted).

    ``usage`` (fq.model.usage.ExpertUsage) is required when a stage selects hot experts. Checks that
    every stage's experts are within its parent's, now that hot selections are concrete.
    """
    layers = tuple(moe_layers)
    everything = tuple(range(n_experts))
    out: dict[str, dict[int, tuple[int, ...]]] = {}
    for node in recipe.nodes:  # topological: the parent is resolved first
        sel = node.experts
        if sel.mode == "all":
            mine = {layer: everything for layer in layers}
        elif sel.mode == "hot":
            _check_hot(recipe, node, n_experts)
            if usage is None:
                raise FqError(f"recipe {recipe.source}: stage {node.name!r} selects the {sel.hot} hottest experts per layer, "
                              f"but no expert-usage statistics were given (pass --usage FILE, format fq-expert-usage/1)")
            mine = {layer: usage.hottest(layer, sel.hot, n_experts) for layer in layers}
        else:
            mine = {layer: experts for layer, experts in _checked_layers(recipe, node, layers, n_experts).items()}
        if node.parent is not None:
            parent = out[node.parent]
            for layer, experts in mine.items():
                missing = sorted(set(experts) - set(parent.get(layer, ())))
                if missing:
                    raise FqError(f"recipe {recipe.source}: stage {node.name!r} selects layer {layer} experts {_ints(missing)}, "
                                  f"which its parent {node.parent!r} does not encode (a residual needs the parent's reconstruction)")
        out[node.name] = mine
    return out


def _check_hot(recipe: Recipe, node: Node, n_experts: int) -> None:
    if node.experts.hot > n_experts:
        raise FqError(f"recipe {recipe.source}: stage {node.name!r} selects the {node.experts.hot} hottest experts per layer, "
                      f"but the model has {n_experts} experts per layer")


def _checked_layers(recipe: Recipe, node: Node, layers: tuple[int, ...], n_experts: int) -> dict[int, tuple[int, ...]]:
    lm = node.experts.layer_map()
    bad_layers = sorted(set(lm) - set(layers))
    if bad_layers:
        raise FqError(f"recipe {recipe.source}: stage {node.name!r} lists layer(s) {_ints(bad_layers)}, which are not MoE layers "
                      f"of the model (MoE layers: {format_layers(layers)})")
    for layer, experts in lm.items():
        bad = [e for e in experts if e >= n_experts]
        if bad:
            raise FqError(f"recipe {recipe.source}: stage {node.name!r} layer {layer} lists expert(s) {_ints(bad)}; "
                          f"the model has experts 0..{n_experts - 1}")
    return lm


def recipe_table(recipe: Recipe) -> str:
    """A readable listing: nodes in topological order, then products."""
    lines = [f"recipe {recipe.name}  sha256 {recipe.sha256[:16]}", "",
             f"{'node':<16} {'kind':<6} {'parent':<14} {'K':>2} {'codebook':<8} experts"]
    for n in recipe.nodes:
        skel = ("; " + ", ".join(f"{c} K{k}" for c, k in n.skeleton if kbits.is_one(k))) if n.skeleton else ""
        skel += f"; experts encoded once, as {n.experts_from}'s" if n.experts_from else ""
        if n.is_budgeted:
            skel += f"; budget {n.bits:g} bits, " + ("K per unit from the allocation" if n.K is not None
                                                      else "allocation not measured yet")
        K = "b" if n.is_budgeted else n.K
        lines.append(f"{n.name:<16} {n.kind:<6} {n.parent or '-':<14} {K:>2} {n.codebook:<8} {n.experts.describe()}{skel}")
    lines += ["", f"{'product':<16} {'bpw':>3}  chain"]
    for p in recipe.products:
        bpw = recipe.product_bpw(p) if recipe.resolved else "?"
        lines.append(f"{p.name:<16} {bpw:>3}  {' -> '.join(p.chain)}")
    if recipe.resolved:
        s = recipe.summary()
        lines += ["", f"{s['passes']} passes emitting {s['encoded_bpw']} bpw; {s['products']} products spanning "
                      f"{s['nominal_bpw']} nominal bpw"]
    return "\n".join(lines)


def _bits_sum(nodes):
    """Sum of nodes' expert bits (fq.core.kbits.chain_bits): an int when every node has one K, else rounded to 4
    decimals; an unresolved budgeted node is refused by name."""
    nodes = list(nodes)
    for n in nodes:
        if n.K is None:
            n.expert_bits()  # raises: its budget has no K per unit yet
    total = kbits.chain_bits(n.K for n in nodes)
    return round(total, 4) if isinstance(total, float) else total
