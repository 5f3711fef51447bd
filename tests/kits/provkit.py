"""A small published campaign built with fq's real writers, signers and planners, for provenance tests.

Layers 1 and 3, 8 experts each, blocks of 4. Nodes: base ``k2`` (K=2 mul1), stage ``r1`` on k2
(K=1 mcg, every expert), stage ``r2`` on r1 (K=2 3inst, hot experts 1, 2, 5 only); each chain entry
carries its node digest (``node_digest``: like ``Recipe.node_digest``, over the node and its ancestors),
which every fragment of the node attests; plans record ``RECIPE_SHA256``. Products
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

from fq.codec.codebook import marker_value
from fq.core.canonical import dumps, sha256_hex
from fq.model.experts import STANDARD
from fq.provenance.assembly import SignedPlan, build_assembly, write_assembly
from fq.provenance.attest import keys
from fq.provenance.attest.campaign import campaign_identity
from fq.provenance.attest.fragment import attest_fragment, attest_skeleton
from fq.provenance.exl3config import specs as derived_specs, write_derived
from fq.provenance.fragments import fragment_filename, write_fragment, write_skeleton
from fq.provenance.identity import encoder_identity
from fq.provenance.manifest import write_base_manifest
from fq.provenance import model_sig
from fq.provenance.model_card import card_params, write_card
from fq.provenance.publication import build_publication, write_publication

LAYERS = (1, 3)
N_EXPERTS = 8
BLOCK = 4
DIMS = {"gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128)}  # torch (out, in)
DEFINITIONS = {  # each node's definition in the test recipe
    "k2": {"node": "k2", "role": "base", "K": 2, "codebook": "mul1", "parent": None},
    "r1": {"node": "r1", "role": "stage", "K": 1, "codebook": "mcg", "parent": "k2"},
    "r2": {"node": "r2", "role": "stage", "K": 2, "codebook": "3inst", "parent": "r1"},
}


def node_digest(node: str, definitions: dict | None = None) -> str:
    """Digest of a node's definition and its ancestors' (the shape of ``Recipe.node_digest``);
    ``definitions`` overrides some nodes' definitions (a changed recipe)."""
    defs = {**DEFINITIONS, **(definitions or {})}
    chain = []
    while node is not None:
        chain.insert(0, defs[node])
        node = defs[node]["parent"]
    return sha256_hex(dumps({"format": "provkit-node/1", "chain": chain}))


NODES = {n: {**d, "digest": node_digest(n)} for n, d in DEFINITIONS.items()}  # the plans' chain entries
RECIPE_SHA256 = sha256_hex(dumps({"format": "provkit-recipe/1", "nodes": DEFINITIONS}))
HOT = {1, 2, 5}
PRODUCTS = {"k2r1": ["k2", "r1"], "k2r1r2": ["k2", "r1", "r2"]}
NOW = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
EXPIRES = dt.datetime(2100, 1, 1, tzinfo=dt.timezone.utc)  # CLI tests run on the real clock
SOURCE_SHARD = "model-00001-of-00001.safetensors"
DERIVED = derived_specs(2, "mul1")  # what base k2's manifest declares derived (config.json, quantization_config.json)
# a model of 4 decoder layers, 1 and 3 MoE (0 and 2 dense: mlp_only_layers), that the skeleton below fills as far
# as fq's completeness check reads a model (fq.provenance.complete): every layer holds a tensor, the MoE layers
# their router, the head is there
N_LAYERS = 4
SOURCE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": N_EXPERTS,
                 "num_hidden_layers": N_LAYERS, "mlp_only_layers": [0, 2], "hidden_size": 128, "vocab_size": 64}

_ENCODER = None


def encoder():
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = encoder_identity()
    return _ENCODER


def random_set(out_f: int, in_f: int, K: int, codebook: str, gen: torch.Generator) -> dict:
    t = {"trellis": torch.randint(-32768, 32768, (in_f // 16, out_f // 16, 16 * K), dtype=torch.int16, generator=gen),
         "suh": ((torch.rand(in_f, generator=gen) < 0.5).float() * 2 - 1).mul(0.05).half(),
         "svh": ((torch.rand(out_f, generator=gen) < 0.5).float() * 2 - 1).mul(0.05).half()}
    if marker_value(codebook) is not None:
        t[codebook] = torch.tensor(marker_value(codebook), dtype=torch.int32)
    return t


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


PLAN_IDENTITY = "0" * 64


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


def _read_signed_plan(path: Path, c: Campaign) -> SignedPlan:
    """A plan as its signer knows it: signature and statement only (a producer lists expired plans, and an
    insider what it signed, without the consumer's checks)."""
    from fq.provenance.attest import dsse
    from fq.provenance.attest.statement import ASSEMBLY, parse_statement

    data = path.read_bytes()
    payload = dsse.open_envelope(data, c.pub, str(path))
    _, pred = parse_statement(payload, str(path), ASSEMBLY)
    return SignedPlan(str(path), sha256_hex(data), pred, sha256_hex(payload))


def publish(c: Campaign, version: int | None = None, key=None, recipe_name: str = "provkit",
            root: Path | None = None) -> Path:
    """Sign ``ROOT/publication.intoto.jsonl`` over the tree as it is (every plan in assemblies/, read back under
    the campaign key); ``version`` defaults to the highest plan version."""
    root = Path(root or c.root)
    plans = [_read_signed_plan(p, c) for p in sorted((root / "assemblies").glob("*.assembly.intoto.jsonl"))]
    version = version or max(p.predicate["version"] for p in plans)
    subjects, pred = build_publication(root, version=version, campaign=c.campaign,
                                       recipe={"name": recipe_name, "sha256": RECIPE_SHA256},
                                       plan_identity_sha256=PLAN_IDENTITY, plans=plans, public_key=c.pub)
    path, _ = write_publication(root, subjects, pred, key or c.priv)
    return path


def _plan(c: Campaign, product: str, version: int, expires, key) -> Path:
    chain = [NODES[n] for n in PRODUCTS[product]]
    names = [c.frag(n, layer, b) for n in PRODUCTS[product] for layer in LAYERS
             for b in range(N_EXPERTS // BLOCK) if experts_of(n, b)]
    plan = build_assembly(c.root, product=product, chain=chain, fragments=names, base_dir="base/k2",
                          campaign=c.campaign, recipe_sha256=RECIPE_SHA256, version=version, expires=expires,
                          public_key=c.pub)
    return write_assembly(c.root, plan, key)


def private_copy(pristine: Campaign, dest: Path) -> Campaign:
    """A copy of a built campaign under ``dest`` (tests tamper with it); same key, same tensors."""
    import shutil

    shutil.copytree(pristine.root.parent, dest)
    root = dest / pristine.root.name
    return Campaign(root, pristine.key_path, pristine.pub_path, pristine.priv, pristine.pub, pristine.campaign,
                    pristine.source, dict(pristine.sets),
                    {p: root / path.relative_to(pristine.root) for p, path in pristine.plans.items()})


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
    if signer is None:
        key_path, pub_path, fp = keys.generate(tmp / "signer")
    else:
        key_path, pub_path, fp = signer.key_path, signer.pub_path, keys.fingerprint(signer.pub)
    priv, pub = keys.load_private(key_path), keys.load_public(pub_path)
    enc = encoder()
    camp = campaign_identity(name=name, source_repo="fq-test/tiny-moe", source_revision="0" * 40,
                             block_size=BLOCK, signer=fp, encoder=enc["digest"])
    root = tmp / "campaign"
    source = {"repo": "fq-test/tiny-moe", "revision": "0" * 40, "shards": [{"name": SOURCE_SHARD, "sha256": "2" * 64}]}
    c = Campaign(root, key_path, pub_path, priv, pub, camp, source)
    gen = torch.Generator().manual_seed(seed)
    base = root / "base/k2"
    skel = [("model.embed_tokens.weight", torch.randn(64, 128, generator=gen).bfloat16()),
            ("model.norm.weight", torch.ones(128, dtype=torch.bfloat16))]
    skel += [(f"model.layers.{layer}.mlp.gate.weight", torch.randn(N_EXPERTS, 128, generator=gen).bfloat16())
             for layer in LAYERS]
    skel += [(f"model.layers.{layer}.input_layernorm.weight", torch.ones(128, dtype=torch.bfloat16))
             for layer in range(N_LAYERS)]
    skel += [("lm_head.weight", torch.zeros(64, 128, dtype=torch.bfloat16))]  # no draw: the sets stay as they were
    write_skeleton(base / SOURCE_SHARD, tensors=skel, source_shard=SOURCE_SHARD)
    attest_skeleton(base / SOURCE_SHARD, key=priv, campaign=camp, source=source, encoder=enc)
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
                        s = (codec_sets or {}).get(k) or random_set(o, i, spec["K"], spec["codebook"], gen)
                        c.sets[k] = experts[e][proj] = s
                if not experts:
                    continue
                path = root / c.frag(node, layer, b)
                write_fragment(path, layout=STANDARD, node=node, role=spec["role"], layer=layer, block=b,
                               K=spec["K"], codebook=spec["codebook"], experts=experts)
                parent = None
                if spec["parent"]:
                    pp = root / c.frag(spec["parent"], layer, b)
                    parent = {"name": pp.name, "sha256": sha256_hex(pp.read_bytes())}
                attest_fragment(path, key=priv, campaign=camp, source=source, encoder=enc,
                                quant_args={"seed": 0, "K": spec["K"], "codebook": spec["codebook"]},
                                node_digest=spec["digest"], parent=parent)
    write_derived(base, bits=2, codebook="mul1")
    oms = model_sig.load_private(model_sig.generate(tmp / "model-signing")[0]) if model_signing else None
    pem = model_sig.public_pem(oms) if oms else None
    derived = DERIVED + ([write_card(base, card_params_of(camp, model_signing=pem and model_sig.hint(pem)))]
                         if card else [])
    write_base_manifest(base, node="k2", campaign=camp, key=priv, derived=derived, model_signing=pem)
    if oms:
        from fq.provenance.manifest import read_base_manifest

        model_sig.write_signature(base, read_base_manifest(base, pub).digests(), oms)
    for product in PRODUCTS:
        c.plans[product] = _plan(c, product, version, EXPIRES, priv)
    publish(c)
    return c


SECOND_BASE = {"node": "k3", "role": "base", "K": 3, "codebook": "mul1", "parent": None}


def add_base(c: Campaign, seed: int = 1) -> Path:
    """A second base, ``base/k3`` (K=3 mul1, every expert; its own skeleton, source config, derived files and
    manifest, like the demo campaign's second base), product ``k3`` (chain [k3]) in ``c.plans``, and the
    publication statement re-signed over both. Returns the plan's path. Not in NODES/PRODUCTS: other helpers
    (``replan``, ``insider_resign``) leave it alone."""
    gen = torch.Generator().manual_seed(seed)
    spec = {**SECOND_BASE, "digest": sha256_hex(dumps({"format": "provkit-node/1", "chain": [SECOND_BASE]}))}
    node, base = spec["node"], c.root / "base" / SECOND_BASE["node"]
    enc = encoder()
    skel = [("model.embed_tokens.weight", torch.randn(64, 128, generator=gen).bfloat16()),
            ("model.norm.weight", torch.ones(128, dtype=torch.bfloat16))]
    skel += [(f"model.layers.{layer}.mlp.gate.weight", torch.randn(N_EXPERTS, 128, generator=gen).bfloat16())
             for layer in LAYERS]
    skel += [(f"model.layers.{layer}.input_layernorm.weight", torch.ones(128, dtype=torch.bfloat16))
             for layer in range(N_LAYERS)]
    skel += [("lm_head.weight", torch.zeros(64, 128, dtype=torch.bfloat16))]  # no draw: the sets stay as they were
    write_skeleton(base / SOURCE_SHARD, tensors=skel, source_shard=SOURCE_SHARD)
    attest_skeleton(base / SOURCE_SHARD, key=c.priv, campaign=c.campaign, source=c.source, encoder=enc)
    (base / "source_config.json").write_text(json.dumps(SOURCE_CONFIG))
    names = []
    for layer in LAYERS:
        for b in range(N_EXPERTS // BLOCK):
            experts = {}
            for e in range(b * BLOCK, (b + 1) * BLOCK):
                experts[e] = {}
                for proj, (o, i) in DIMS.items():
                    s = random_set(o, i, spec["K"], spec["codebook"], gen)
                    c.sets[(node, layer, e, proj)] = experts[e][proj] = s
            name = f"base/{node}/{fragment_filename(node, layer, b)}"
            write_fragment(c.root / name, layout=STANDARD, node=node, role="base", layer=layer, block=b,
                           K=spec["K"], codebook=spec["codebook"], experts=experts)
            attest_fragment(c.root / name, key=c.priv, campaign=c.campaign, source=c.source, encoder=enc,
                            quant_args={"seed": 0, "K": spec["K"], "codebook": spec["codebook"]},
                            node_digest=spec["digest"])
            names.append(name)
    write_derived(base, bits=spec["K"], codebook=spec["codebook"])
    write_base_manifest(base, node=node, campaign=c.campaign, key=c.priv,
                        derived=derived_specs(spec["K"], spec["codebook"]))
    version = max(_read_signed_plan(p, c).predicate["version"] for p in c.plans.values())
    plan = build_assembly(c.root, product=node, chain=[spec], fragments=names, base_dir=f"base/{node}",
                          campaign=c.campaign, recipe_sha256=RECIPE_SHA256, version=version, expires=EXPIRES,
                          public_key=c.pub)
    c.plans[node] = write_assembly(c.root, plan, c.priv)
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
        _, manifest_sha = write_base_manifest(c.root / "base/k2", node="k2", campaign=c.campaign, key=c.priv,
                                              derived=DERIVED)
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
