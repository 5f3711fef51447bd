"""One signed, published test tree: the one place the kits sign and publish one (provkit, runtimekit, basekit, tpkit),
with fq's own writers and signers and without Snakemake. Its node digests and recipe sha256 are fq's own: a kit's
nodes and products are a fq-cartridge/2 recipe (``recipe``) parsed by fq.planning.recipe, whose ``node_digest`` each
fragment attests and whose chain entries and ``sha256`` the plans carry, as finalize writes them.

    signer(prefix) -> Signer(key_path, pub_path, fingerprint, priv, pub)   a new campaign key (keys.generate)
    signer_of(key_path, pub_path) -> Signer                               an existing one
    recipe(name, nodes, products, experts=None, K=None, skeleton=None) -> fq Recipe
    chain_entry(recipe, node) -> dict                      a plan's chain entry (finalize's)
    random_set(out_f, in_f, K, codebook, gen, sign=0.05)   a random valid EXL3 tensor set
    read_signed_plan(path, pub) -> SignedPlan              a plan as its signer knows it (no consumer checks)
    Tree.create(root, recipe, signer, name=, repo=, block_size=, shards=) -> Tree
    Tree(root, priv, pub, campaign, source, recipe, encoder=None)   (None: fq's encoder identity, ``encoder()``)
        .skeleton(base, shard, tensors, source=None)                          a skeleton shard, attested
        .fragment(node, layer, block, experts, layout=STANDARD, quant_args=None) -> its name under root
        .linears(base, node, layer, sets, shard) -> {name, digest}      a whole-model base's linear fragment
        .manifest(base, derived, model_signing=None) -> the manifest's sha256
        .plan(product, chain, fragments, version=1, expires=EXPIRES, key=None, linears=None) -> its path
        .publish(version=None, key=None, recipe_name=None) -> the publication statement's path

``recipe``'s nodes are chain entries without their digest ({node: {"role", "K", "codebook", "parent", ...}}, other
keys ignored); a stage's ``experts`` selection is given apart (``experts``: {node: "all" | {layer: [experts]}},
"all" where not given), and so are a base's quantized non-expert classes (``skeleton``: {node: {class: K}}).
``K`` ({node: a fq.core.kbits node spec as JSON}) sets a node's K after parsing, as fq.planning.budget's resolution
sets a budgeted node's: the recipe file (and so its sha256) keeps the node's own K.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import torch

from fq.codec.codebook import marker_value
from fq.core import kbits
from fq.core.canonical import sha256_hex
from fq.model.experts import STANDARD
from fq.planning.recipe import FORMAT, Recipe, parse_recipe
from fq.provenance.assembly import SignedPlan, build_assembly, write_assembly
from fq.provenance.attest import keys
from fq.provenance.attest.campaign import campaign_identity
from fq.provenance.attest.fragment import attest_fragment, attest_skeleton
from fq.provenance.fragments import fragment_filename, write_fragment, write_skeleton
from fq.provenance.identity import encoder_identity
from fq.provenance.manifest import write_base_manifest
from fq.provenance.publication import build_publication, write_publication

EXPIRES = dt.datetime(2100, 1, 1, tzinfo=dt.timezone.utc)  # CLI tests run on the real clock
REVISION = "0" * 40
PLAN_IDENTITY = "0" * 64

_ENCODER = None


def encoder() -> dict:
    """fq's encoder identity (computed once per process)."""
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = encoder_identity()
    return _ENCODER


@dataclass(frozen=True)
class Signer:
    key_path: Path
    pub_path: Path
    fingerprint: str
    priv: object
    pub: object


def signer(prefix: Path) -> Signer:
    key_path, pub_path, fp = keys.generate(prefix)
    return signer_of(key_path, pub_path, fp)


def signer_of(key_path: Path, pub_path: Path, fp: str | None = None) -> Signer:
    priv, pub = keys.load_private(key_path), keys.load_public(pub_path)
    return Signer(key_path, pub_path, fp or keys.fingerprint(pub), priv, pub)


def recipe(name: str, nodes: dict, products: dict, experts: dict | None = None, K: dict | None = None,
           skeleton: dict | None = None) -> Recipe:
    """fq's Recipe of a kit's nodes and products ({product: [node, ...]}): see the module's docstring."""
    doc_nodes = []
    for n, d in nodes.items():
        entry = {"name": n, "kind": d["role"], "K": d["K"], "codebook": d["codebook"]}
        if n in (skeleton or {}):
            entry["skeleton"] = skeleton[n]
        if d["role"] != "base":
            sel = (experts or {}).get(n, "all")
            entry.update(parent=d["parent"], experts=sel if sel == "all" else
                         {"layers": {str(layer): list(e) for layer, e in sel.items()}})
        doc_nodes.append(entry)
    doc = {"format": FORMAT, "name": name, "nodes": doc_nodes,
           "products": [{"name": p, "chain": list(chain)} for p, chain in products.items()]}
    r = parse_recipe(doc, f"<kit recipe {name}>")
    if K:
        r = dataclasses.replace(r, nodes=tuple(dataclasses.replace(n, K=kbits.node(K[n.name], f"{n.name} K"))
                                               if n.name in K else n for n in r.nodes))
    return r


def chain_entry(r: Recipe, node: str) -> dict:
    """A plan's chain entry for ``node``, as finalize writes it."""
    n = r.node(node)
    return {"node": node, "role": "base" if n.is_base else "stage", "K": kbits.to_json(n.K), "codebook": n.codebook,
            "parent": n.parent, "digest": r.node_digest(node)}


def node_dir(r: Recipe, node: str) -> str:
    return f"base/{node}" if r.node(node).is_base else f"stages/{node}"


def random_set(out_f: int, in_f: int, K, codebook: str, gen: torch.Generator, sign: float = 0.05) -> dict:
    """A random but valid EXL3 tensor set of one (out_f, in_f) linear at K (an int) with ``codebook``; its sign
    vectors ``suh``/``svh`` are +-``sign``, so its reconstruction is of about sign^2 times the codebook's scale."""
    t = {"trellis": torch.randint(-32768, 32768, (in_f // 16, out_f // 16, 16 * K), dtype=torch.int16, generator=gen),
         "suh": ((torch.rand(in_f, generator=gen) < 0.5).float() * 2 - 1).mul(sign).half(),
         "svh": ((torch.rand(out_f, generator=gen) < 0.5).float() * 2 - 1).mul(sign).half()}
    if marker_value(codebook) is not None:
        t[codebook] = torch.tensor(marker_value(codebook), dtype=torch.int32)
    return t


def read_signed_plan(path: Path, pub) -> SignedPlan:
    """A plan as its signer knows it: signature and statement only (a producer lists expired plans, and an insider
    what it signed, without the consumer's checks)."""
    from fq.provenance.attest import dsse
    from fq.provenance.attest.statement import ASSEMBLY, parse_statement

    data = Path(path).read_bytes()
    payload = dsse.open_envelope(data, pub, str(path))
    _, pred = parse_statement(payload, str(path), ASSEMBLY)
    return SignedPlan(str(path), sha256_hex(data), pred, sha256_hex(payload))


@dataclass
class Tree:
    """What signs one tree: its root, the campaign key, the campaign identity and the source it attests, the
    recipe whose digests the fragments and plans name, the encoder identity its shards attest."""

    root: Path
    priv: object
    pub: object
    campaign: dict
    source: dict
    recipe: Recipe
    encoder: dict | None = None

    def __post_init__(self):
        if self.encoder is None:
            self.encoder = encoder()

    @classmethod
    def create(cls, root: Path, r: Recipe, s: Signer, *, name: str, repo: str, block_size: int,
               shards: dict) -> "Tree":
        """``shards``: {source shard name: its sha256}, the source the tree's statements name."""
        camp = campaign_identity(name=name, source_repo=repo, source_revision=REVISION, block_size=block_size,
                                 signer=s.fingerprint, encoder=encoder()["digest"])
        source = {"repo": repo, "revision": REVISION, "shards": [{"name": n, "sha256": d} for n, d in shards.items()]}
        return cls(Path(root), s.priv, s.pub, camp, source, r)

    def skeleton(self, base: str, shard: str, tensors, source: dict | None = None) -> Path:
        """Base ``base``'s skeleton shard of source shard ``shard``: ``tensors`` ((name, tensor) or RawTensor)."""
        path = self.root / "base" / base / shard
        write_skeleton(path, tensors=tensors, source_shard=shard)
        attest_skeleton(path, key=self.priv, campaign=self.campaign, source=source or self.source, encoder=self.encoder)
        return path

    def fragment(self, node: str, layer: int, block: int, experts: dict, layout=STANDARD,
                 quant_args: dict | None = None) -> str:
        """Node ``node``'s fragment of (layer, block): ``experts`` {expert: {projection: tensor set}} at the node's K
        for the layer, attesting the recipe's node digest and (a stage) its parent fragment of the same block;
        ``quant_args`` adds to {seed, K, codebook}. Returns its name under the root."""
        n = self.recipe.node(node)
        K = n.K_at(layer)
        rel = f"{node_dir(self.recipe, node)}/{fragment_filename(node, layer, block)}"
        path = self.root / rel
        write_fragment(path, layout=layout, node=node, role="base" if n.is_base else "stage", layer=layer,
                       block=block, K=K, codebook=n.codebook, experts=experts)
        parent = None
        if n.parent is not None:
            pp = self.root / node_dir(self.recipe, n.parent) / fragment_filename(n.parent, layer, block)
            parent = {"name": pp.name, "sha256": sha256_hex(pp.read_bytes())}
        attest_fragment(path, key=self.priv, campaign=self.campaign, source=self.source, encoder=self.encoder,
                        quant_args={"seed": 0, "K": kbits.to_json(K), "codebook": n.codebook, **(quant_args or {})},
                        node_digest=self.recipe.node_digest(node), parent=parent)
        return rel

    def linears(self, base: str, node: str, layer: int | None, sets: dict, shard: str) -> dict:
        """Base ``base``'s linear fragment of the recipe's linear node ``node`` (``attention-K2-mul1``) in ``layer``
        (None: the head): ``sets`` {linear prefix: tensor set}, attested as read from source shard ``shard``
        (bf16, placeholder digests). Returns its plan entry {name, digest}."""
        from fq.provenance.attest.fragment import attest_linears
        from fq.provenance.fragments import linear_filename, write_linears

        ln = self.recipe.linear_node(node)
        path = self.root / "base" / base / linear_filename(node, layer)
        write_linears(path, node=node, cls=ln.cls, layer=layer, K=ln.K, codebook=ln.codebook, linears=sets)
        tensors = [{"tensor": f"{p}.weight", "shard": shard, "dtype": "BF16", "shape": [t["svh"].numel(),
                    t["suh"].numel()], "sha256": "3" * 64} for p, t in sets.items()]
        attest_linears(path, key=self.priv, campaign=self.campaign, source=dict(self.source, tensors=tensors),
                       encoder=self.encoder, quant_args={"seed": 0, "K": ln.K, "codebook": ln.codebook},
                       node_digest=ln.digest)
        return {"name": f"base/{base}/{path.name}", "digest": ln.digest}

    def manifest(self, base: str, derived: list, model_signing: str | None = None) -> str:
        """Base ``base``'s signed manifest over its files as they are; ``derived``: the derived files' specs."""
        _, sha = write_base_manifest(self.root / "base" / base, node=base, campaign=self.campaign, key=self.priv,
                                     derived=derived, model_signing=model_signing)
        return sha

    def plan(self, product: str, chain: list, fragments: list, version: int = 1, expires=EXPIRES, key=None,
             linears: list | None = None) -> Path:
        """The signed plan of ``product`` (the nodes of ``chain``, base first) over ``fragments`` (names under the
        root); ``linears``: a whole-model base's linear fragments ([{name, digest}])."""
        plan = build_assembly(self.root, product=product, chain=[chain_entry(self.recipe, n) for n in chain],
                              fragments=fragments, base_dir=f"base/{chain[0]}", campaign=self.campaign,
                              recipe_sha256=self.recipe.sha256, version=version, expires=expires,
                              public_key=self.pub, linears=linears)
        return write_assembly(self.root, plan, key or self.priv)

    def publish(self, version: int | None = None, key=None, recipe_name: str | None = None) -> Path:
        """Sign ``ROOT/publication.intoto.jsonl`` over the tree as it is (every plan in assemblies/, read back under
        the campaign key); ``version`` defaults to the highest plan version."""
        plans = [read_signed_plan(p, self.pub)
                 for p in sorted((self.root / "assemblies").glob("*.assembly.intoto.jsonl"))]
        version = version or max(p.predicate["version"] for p in plans)
        recipe_doc = {"name": recipe_name or self.recipe.name, "sha256": self.recipe.sha256}
        subjects, pred = build_publication(self.root, version=version, campaign=self.campaign, recipe=recipe_doc,
                                           plan_identity_sha256=PLAN_IDENTITY, plans=plans, public_key=self.pub)
        path, _ = write_publication(self.root, subjects, pred, key or self.priv)
        return path
