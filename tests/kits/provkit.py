"""A small published campaign built with fq's real writers, signers and planners, for provenance tests.

Layers 1 and 3, 8 experts each, blocks of 4. Nodes: base ``k2`` (K=2 mul1), stage ``r1`` on k2
(K=1 mcg, every expert), stage ``r2`` on r1 (K=2 3inst, hot experts 1, 2, 5 only); each chain entry
carries its node digest (``Recipe.node_digest`` of the kit's recipe, ``RECIPE``: tests/kits/tree.py), which every
fragment of the node attests; plans record ``RECIPE_SHA256``, the recipe's sha256. Products
``k2r1`` and ``k2r1r2``. Tensor sets are random but valid EXL3 sets (the codec's quality is irrelevant
to provenance); ``codec_sets`` substitutes real encoder output where a test needs it.

    ROOT/base/k2/{model-00001-of-00001.safetensors (skeleton), source_config.json, config.json and
                  quantization_config.json (derived, as finalize writes them: fq.provenance.exl3config),
                  k2-layer001-block000.safetensors, ..., fq-manifest.intoto.jsonl}
    ROOT/stages/r1/..., ROOT/stages/r2/...
    ROOT/assemblies/{k2r1,k2r1r2}.assembly.intoto.jsonl
    ROOT/publication.intoto.jsonl   (the signed publication statement, as finalize writes it: ``publish``)

``Campaign.replan`` re-signs the publication statement too, as finalize would after re-planning.
"""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fq.core.canonical import dumps, sha256_hex
from fq.model.experts import STANDARD
from fq.planning.recipe import Recipe
from fq.provenance.exl3config import specs as derived_specs, write_derived
from fq.provenance.fragments import fragment_filename
from fq.provenance import model_sig
from fq.provenance.model_card import card_params, write_card

from . import tree
from .tree import EXPIRES, encoder, random_set  # noqa: F401  (the tests' names for them)

LAYERS = (1, 3)
N_EXPERTS = 8
BLOCK = 4
DIMS = {"gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128)}  # torch (out, in)
DEFINITIONS = {  # each node's definition in the test recipe (a plan's chain entry without its digest)
    "k2": {"node": "k2", "role": "base", "K": 2, "codebook": "mul1", "parent": None},
    "r1": {"node": "r1", "role": "stage", "K": 1, "codebook": "mcg", "parent": "k2"},
    "r2": {"node": "r2", "role": "stage", "K": 2, "codebook": "3inst", "parent": "r1"},
}
HOT = {1, 2, 5}
PRODUCTS = {"k2r1": ["k2", "r1"], "k2r1r2": ["k2", "r1", "r2"]}
# add_base's second base: in the recipe (its digest and the recipe's sha256 are the tree's), not in NODES/PRODUCTS
SECOND_BASE = {"node": "k3", "role": "base", "K": 3, "codebook": "mul1", "parent": None}


def recipe(definitions: dict | None = None, skeleton: dict | None = None) -> Recipe:
    """The kit's recipe (fq's own: tests/kits/tree.py); ``definitions`` overrides some nodes' definitions (a changed
    recipe), ``skeleton`` gives bases quantized non-expert classes ({node: {class: K}}: tpkit's whole-model base)."""
    return tree.recipe("provkit", {**DEFINITIONS, **(definitions or {}), "k3": SECOND_BASE},
                       {"k2r1": ["k2", "r1"], "k2r1r2": ["k2", "r1", "r2"], "k3": ["k3"]},
                       experts={"r2": {layer: sorted(HOT) for layer in LAYERS}}, skeleton=skeleton)


def node_digest(node: str, definitions: dict | None = None) -> str:
    """fq's digest of a node's definition and its ancestors' (``Recipe.node_digest``) in the kit's recipe, or with
    ``definitions`` overriding some nodes' (a changed recipe)."""
    return recipe(definitions).node_digest(node)


RECIPE = recipe()
NODES = {n: tree.chain_entry(RECIPE, n) for n in DEFINITIONS}  # the plans' chain entries
RECIPE_SHA256 = RECIPE.sha256
NOW = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
SOURCE_SHARD = "model-00001-of-00001.safetensors"
DERIVED = derived_specs(2, "mul1")  # what base k2's manifest declares derived (config.json, quantization_config.json)
# a model of 4 decoder layers, 1 and 3 MoE (0 and 2 dense: mlp_only_layers), that the skeleton below fills as far
# as fq's completeness check reads a model (fq.provenance.complete): every layer holds a tensor, the MoE layers
# their router, the head is there
N_LAYERS = 4
SOURCE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": N_EXPERTS,
                 "num_hidden_layers": N_LAYERS, "mlp_only_layers": [0, 2], "hidden_size": 128, "vocab_size": 64}

def node_dir(node: str) -> str:
    return f"base/{node}" if NODES[node]["role"] == "base" else f"stages/{node}"


def experts_of(node: str, block: int) -> list[int]:
    ex = range(block * BLOCK, (block + 1) * BLOCK)
    return [e for e in ex if node != "r2" or e in HOT]


@dataclass
class Campaign:
    root: Path
    key_path: Path
    pub_path: Path
    priv: object
    pub: object
    campaign: dict
    source: dict
    sets: dict = field(default_factory=dict)  # (node, layer, expert, proj) -> tensor set
    plans: dict = field(default_factory=dict)  # product -> plan path
    recipe: Recipe = RECIPE  # whose digests and sha256 the plans and the publication carry

    def tree(self, root: Path | None = None) -> tree.Tree:
        """What signs this campaign's tree (or the copy of it at ``root``)."""
        return tree.Tree(Path(root or self.root), self.priv, self.pub, self.campaign, self.source, self.recipe)

    def frag(self, node: str, layer: int, block: int) -> str:
        return f"{node_dir(node)}/{fragment_filename(node, layer, block)}"

    def path(self, name: str) -> Path:
        return self.root / name

    def replan(self, product: str, version: int, expires=EXPIRES, key=None) -> Path:
        """Re-sign ``product``'s plan at ``version`` (the others too, at that version, as finalize signs every plan
        of a publication with its version; they keep their expiry) and the publication statement."""
        path = _plan(self, product, version, expires, key or self.priv)
        for other in self.plans:
            if other != product and other in PRODUCTS and self.plans[other].exists():
                _plan(self, other, version, EXPIRES, key or self.priv)
        publish(self, key=key)
        return path


def sign_plan(c: Campaign, plan: dict, product: str, publish_too: bool = True) -> Path:
    """Sign ``plan`` as given under the campaign key, bypassing every producer-side check (an insider, or a
    buggy pipeline), and by default the publication statement listing it, as that pipeline's finalize would."""
    from fq.provenance.attest import dsse
    from fq.provenance.attest.statement import ASSEMBLY, STATEMENT_TYPE

    subjects = [(f["name"], f["sha256"]) for f in plan["fragments"]] + \
               [(plan["base"]["manifest"]["name"], plan["base"]["manifest"]["sha256"])]
    payload = dumps({"_type": STATEMENT_TYPE, "predicateType": ASSEMBLY, "predicate": plan,
                     "subject": [{"name": n, "digest": {"sha256": d}} for n, d in subjects]})
    c.plans[product].write_bytes(dsse.envelope_line(dsse.sign(payload, c.priv)))
    if publish_too:
        publish(c)
    return c.plans[product]


def publish(c: Campaign, version: int | None = None, key=None, recipe_name: str | None = None,
            root: Path | None = None) -> Path:
    """Sign ``ROOT/publication.intoto.jsonl`` over the tree as it is (every plan in assemblies/, read back under
    the campaign key); ``version`` defaults to the highest plan version, ``recipe_name`` to the recipe's."""
    return c.tree(root).publish(version, key, recipe_name)


def _plan(c: Campaign, product: str, version: int, expires, key, linears: list | None = None) -> Path:
    names = [c.frag(n, layer, b) for n in PRODUCTS[product] for layer in LAYERS
             for b in range(N_EXPERTS // BLOCK) if experts_of(n, b)]
    return c.tree().plan(product, PRODUCTS[product], names, version, expires, key, linears=linears)


def private_copy(pristine: Campaign, dest: Path) -> Campaign:
    """A copy of a built campaign under ``dest`` (tests tamper with it); same key, same tensors."""
    import shutil

    shutil.copytree(pristine.root.parent, dest)
    root = dest / pristine.root.name
    return Campaign(root, pristine.key_path, pristine.pub_path, pristine.priv, pristine.pub, pristine.campaign,
                    pristine.source, dict(pristine.sets),
                    {p: root / path.relative_to(pristine.root) for p, path in pristine.plans.items()}, pristine.recipe)


def card_params_of(camp: dict, **over) -> dict:
    """The model card params finalize would give base k2 of campaign identity ``camp``."""
    return card_params(**{"base_model": camp["source"]["repo"], "revision": camp["source"]["revision"], "node": "k2",
                          "campaign": camp["name"], "signer": camp["signer"], **over})


def build_campaign(tmp: Path, seed: int = 0, codec_sets: dict | None = None, dims: dict | None = None,
                   signer: "Campaign | None" = None, name: str = "test", version: int = 1,
                   card: bool = False, model_signing: bool = False) -> Campaign:
    """``codec_sets[(node, layer, expert, proj)]`` overrides the random set of that linear; ``dims``
    overrides DIMS (torch (out, in) per projection); ``signer``: another campaign whose key signs this one
    (two campaigns of one signer), ``name`` the campaign's name, ``version`` its plans' and publication's;
    ``card``: the base carries its model card README.md (declared derived, as finalize writes it);
    ``model_signing``: and its OpenSSF model signature model.sig, by a P-256 key ``TMP/model-signing.key``."""
    dims = dims or DIMS
    tmp = Path(tmp)
    s = tree.signer(tmp / "signer") if signer is None else tree.signer_of(signer.key_path, signer.pub_path)
    t = tree.Tree.create(tmp / "campaign", RECIPE, s, name=name, repo="fq-test/tiny-moe", block_size=BLOCK,
                         shards={SOURCE_SHARD: "2" * 64})
    c = Campaign(t.root, s.key_path, s.pub_path, s.priv, s.pub, t.campaign, t.source)
    gen = torch.Generator().manual_seed(seed)
    base = t.root / "base/k2"
    t.skeleton("k2", SOURCE_SHARD, _skeleton(gen))
    (base / "source_config.json").write_text(json.dumps(SOURCE_CONFIG))
    for node in ("k2", "r1", "r2"):
        spec = NODES[node]
        for layer in LAYERS:
            for b in range(N_EXPERTS // BLOCK):
                experts = {}
                for e in experts_of(node, b):
                    experts[e] = {}
                    for proj, (o, i) in dims.items():
                        k = (node, layer, e, proj)
                        ts = (codec_sets or {}).get(k) or random_set(o, i, spec["K"], spec["codebook"], gen)
                        c.sets[k] = experts[e][proj] = ts
                if experts:
                    t.fragment(node, layer, b, experts)
    write_derived(base, bits=2, codebook="mul1")
    oms = model_sig.load_private(model_sig.generate(tmp / "model-signing")[0]) if model_signing else None
    pem = model_sig.public_pem(oms) if oms else None
    derived = DERIVED + ([write_card(base, card_params_of(t.campaign, model_signing=pem and model_sig.hint(pem)))]
                         if card else [])
    t.manifest("k2", derived, model_signing=pem)
    if oms:
        from fq.provenance.manifest import read_base_manifest

        model_sig.write_signature(base, read_base_manifest(base, s.pub).digests(), oms)
    for product in PRODUCTS:
        c.plans[product] = _plan(c, product, version, EXPIRES, s.priv)
    publish(c)
    return c


def _skeleton(gen: torch.Generator) -> list:
    """A base's skeleton shard: embeddings, final norm, the MoE layers' routers, every layer's input norm, the
    head (fq's completeness check reads a model that far)."""
    skel = [("model.embed_tokens.weight", torch.randn(64, 128, generator=gen).bfloat16()),
            ("model.norm.weight", torch.ones(128, dtype=torch.bfloat16))]
    skel += [(f"model.layers.{layer}.mlp.gate.weight", torch.randn(N_EXPERTS, 128, generator=gen).bfloat16())
             for layer in LAYERS]
    skel += [(f"model.layers.{layer}.input_layernorm.weight", torch.ones(128, dtype=torch.bfloat16))
             for layer in range(N_LAYERS)]
    skel += [("lm_head.weight", torch.zeros(64, 128, dtype=torch.bfloat16))]  # no draw: the sets stay as they were
    return skel


def add_base(c: Campaign, seed: int = 1) -> Path:
    """A second base, ``base/k3`` (K=3 mul1, every expert; its own skeleton, source config, derived files and
    manifest, like the demo campaign's second base), product ``k3`` (chain [k3]) in ``c.plans``, and the
    publication statement re-signed over both. Returns the plan's path. Not in NODES/PRODUCTS: other helpers
    (``replan``, ``insider_resign``) leave it alone."""
    gen = torch.Generator().manual_seed(seed)
    spec, t = SECOND_BASE, c.tree()
    node = spec["node"]
    t.skeleton(node, SOURCE_SHARD, _skeleton(gen))
    (c.root / "base" / node / "source_config.json").write_text(json.dumps(SOURCE_CONFIG))
    names = []
    for layer in LAYERS:
        for b in range(N_EXPERTS // BLOCK):
            experts = {}
            for e in range(b * BLOCK, (b + 1) * BLOCK):
                experts[e] = {}
                for proj, (o, i) in DIMS.items():
                    ts = random_set(o, i, spec["K"], spec["codebook"], gen)
                    c.sets[(node, layer, e, proj)] = experts[e][proj] = ts
            names.append(t.fragment(node, layer, b, experts))
    write_derived(c.root / "base" / node, bits=spec["K"], codebook=spec["codebook"])
    t.manifest(node, derived_specs(spec["K"], spec["codebook"]))
    version = max(tree.read_signed_plan(p, c.pub).predicate["version"] for p in c.plans.values())
    c.plans[node] = t.plan(node, [node], names, version)
    publish(c)
    return c.plans[node]


# --- an insider: bytes changed after encoding, then everything re-signed with the campaign's own key ---
def _statement_line(st: dict, key) -> bytes:
    from fq.provenance.attest import dsse
    return dsse.envelope_line(dsse.sign(dumps(st), key))


def _attested(p: Path) -> dict:
    return _attested_line(p.with_name(p.name + ".intoto.jsonl"))


def _attested_line(p: Path) -> dict:
    """The in-toto statement inside the envelope line at ``p``."""
    import base64
    from fq.core.canonical import loads
    env = loads(p.read_bytes())
    return loads(base64.b64decode(env["payload"]))


def insider_attest_as_is(c: Campaign, rel: str) -> None:
    """Sign, with the campaign's own key, that fragment ``rel`` is exactly its current bytes (subject digest,
    size, header digest), without reading anything else in it: a hostile header reaches the consumer's parser."""
    import hashlib
    import struct
    p = c.root / rel
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    st = _attested(p)
    st["predicate"]["shard"] = {"size": len(data), "header_sha256": hashlib.sha256(data[:8 + n]).hexdigest()}
    st["subject"] = [{"name": p.name, "digest": {"sha256": hashlib.sha256(data).hexdigest()}}]
    p.with_name(p.name + ".intoto.jsonl").write_bytes(_statement_line(st, c.priv))


def insider_resign(c: Campaign, rel: str, quant_args: dict | None = None) -> None:
    """Re-attest fragment ``rel`` as its bytes now are, with the campaign's own key and none of the producer's
    checks (a compromised or buggy pipeline): its attestation, its children's parent edges, the base manifest
    (for a base fragment), every plan and the publication statement. Only the consumer's own checks stand between
    these bytes and a user. ``quant_args``: what the new attestation says it was encoded with."""
    from fq.core.safepath import sha256_stream
    from fq.model.shards import read_header
    from fq.provenance.assembly import read_assembly, sign_assembly
    p = c.root / rel
    st = _attested(p)
    with open(p, "rb") as fh:
        header = read_header(fh, p.name)
        groups: dict = {}
        for e in header.entries:
            groups.setdefault(STANDARD.parse(e.name)[1], []).append(e.name)
        spans = [header.span(groups[k], str(k)) for k in sorted(groups)]
        whole, size, digests = sha256_stream(fh, spans)
    pred = st["predicate"]
    pred["experts"] = [{"expert": k, "offset": o, "length": n, "sha256": d}
                       for k, (o, n), d in zip(sorted(groups), spans, digests)]
    pred["shard"] = {"size": size, "header_sha256": header.sha256}
    if quant_args is not None:
        pred["quant_args"] = quant_args
    st["subject"] = [{"name": p.name, "digest": {"sha256": whole}}]
    lines = {rel: _statement_line(st, c.priv)}
    for child in sorted(c.root.rglob("*.safetensors")):
        cst = _attested(child)
        if cst["predicate"]["parent"] and cst["predicate"]["parent"]["name"] == p.name:
            cst["predicate"]["parent"]["sha256"] = whole
            lines[child.relative_to(c.root).as_posix()] = _statement_line(cst, c.priv)
    for name, line in lines.items():
        (c.root / (name + ".intoto.jsonl")).write_bytes(line)
    manifest_sha = None
    if rel.startswith("base/"):
        manifest_sha = c.tree().manifest("k2", DERIVED)
    for product, plan_path in c.plans.items():
        plan = read_assembly(plan_path, c.pub, now=NOW).predicate
        for f in plan["fragments"]:
            if f["name"] == rel:
                f.update(sha256=whole, size=size, header_sha256=header.sha256, experts=pred["experts"])
            if f["parent"] and f["parent"]["name"] == p.name:
                f["parent"]["sha256"] = whole
            if f["name"] in lines:
                f["attestation_sha256"] = sha256_hex(lines[f["name"]])
        if manifest_sha is not None:
            plan["base"]["manifest"]["sha256"] = manifest_sha
        plan_path.write_bytes(sign_assembly(plan, c.priv))
    publish(c)  # and the publication statement listing all of it


def poison_scale(c: Campaign, rel: str, layer: int, expert: int, proj: str, suffix: str, index: int,
                 bits: int = 0x7E00) -> None:
    """Overwrite one float16 element of a scale tensor in place (0x7E00 NaN, 0x7C00 +Inf, 0xFC00 -Inf)."""
    from fq.model.shards import read_header
    p = c.root / rel
    with open(p, "rb") as fh:
        e = read_header(fh, p.name).entry(STANDARD.key(layer, expert, proj, suffix))
    data = bytearray(p.read_bytes())
    data[e.start + 2 * index: e.start + 2 * index + 2] = bits.to_bytes(2, "little")
    p.write_bytes(bytes(data))
